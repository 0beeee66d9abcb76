"""ex04's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""

from minipar.course.graded import test_ex04_pipeline as g
from tests.planted import contract_tests

STEADY = '        out += [Action("F", warmup + i, rank), Action("B", i, rank)]'
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex04.A.valid": (
        [("    return bounds[::-1]", "    return bounds")], g.test_partition_is_valid,
        r"first and last boundary .* \(p contiguous, non-empty stages\)"),
    "ex04.A.optimal": (
        [("    limit = _min_max(prefix, p)", "    limit = prefix[L] / p")], g.test_partition_is_balanced,
        r"the most expensive stage is as cheap as possible"),
    "ex04.A.range": (
        [("    if p > L:\n        raise", "    if p > L + 1:\n        raise")],
        g.test_partition_rejects_too_many_stages, r"raises ``ValueError`` unless 1 <= p <= L"),
    "ex04.B.valid": (
        [(STEADY, '        out += [Action("B", i, rank), Action("F", warmup + i, rank)]')],
        g.test_one_f_one_b_is_a_valid_schedule, r"check_schedule says .* \(a valid schedule \(no deadlock"),
    "ex04.B.bubble": (
        [("    warmup = min(p - rank - 1, m)\n    out = [", "    warmup = min(1, p - rank - 1, m)\n    out = [")],
        g.test_one_f_one_b_is_a_valid_schedule, r"bubble .* \(keep GPipe's bubble\)"),
    "ex04.B.memory": (
        [("    warmup = min(p - rank - 1, m)\n    out = [", "    warmup = min(p - rank, m)\n    out = [")],
        g.test_one_f_one_b_is_a_valid_schedule, r"rank r hold at most min\(p - r, m\) micro-batches"),
    "ex04.C.comms": (
        [("        out += before + [a] + after", "        out += [a] + before + after")],
        g.test_add_comms, r"GPipe, p = 3, m = 2: rank 0's actions"),
    "ex04.C.peer": (
        [("src % p)] if 0 <= src", "src)] if 0 <= src"), ("dst % p)] if 0 <= dst", "dst)] if 0 <= dst")],
        g.test_add_comms, r"interleaved 1F1B, p = 2, m = 2, v = 2: rank 0's actions"),
    "ex04.C.divide": (
        [("        if inputs.shape[0] % m:\n", "        if False:\n")],
        g.test_pipeline_step, r"a batch m does not divide is a ValueError"),
    "ex04.C.loss": (
        [("        return float(self.loss) if self.last in self.stages else None", "        return float(self.loss)")],
        g.test_pipeline_step, r"returned \[0\.0, .*\] on ranks 0, 1"),
    "ex04.C.clean": (
        [("targets.chunk(m), 0.0", 'targets.chunk(m), getattr(self, "loss", 0.0)')],
        g.test_pipeline_step, r"(?s)step 1: loss.*seen: step 0's loss equals one process's"),
    "ex04.C.peak": (
        [("        self.peak_stash = self.stash.peak", "        self.peak_stash = len(self.stash)")],
        g.test_trains_the_gpt, r"the most micro-batches held at once"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex04", g, PLANTS)
