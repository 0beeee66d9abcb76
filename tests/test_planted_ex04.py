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
        g.test_one_f_one_b_is_valid, r"action \d+ \(B0s\d\): B0 before F0 .*each F before its B"),
    "ex04.B.bubble": (
        [("    warmup = min(p - rank - 1, m)\n    out = [", "    warmup = min(1, p - rank - 1, m)\n    out = [")],
        g.test_one_f_one_b_bubble, r"idles .* \(keep GPipe's bubble\)"),
    "ex04.B.memory": (        # one warm-up forward too many: p - r + 1 held
        [("    warmup = min(p - rank - 1, m)\n    out = [", "    warmup = min(p - rank, m)\n    out = [")],
        g.test_one_f_one_b_memory, r"rank 0, action \d+ \(F\d+s0\): \d+ micro-batches held after it, the bound is "
        r"min\(p - r, m\) = \d+ \(rank r holds the activations of at most min\(p - r, m\)"),
    "ex04.B.own": (
        [("    warmup = min(p - rank - 1, m)\n    out = [",
          "    from minipar.pipeline import zb_h1\n"
          "    return [a for a in zb_h1(p, m, rank) if a.op != 'W']\n    warmup = min(p - rank - 1, m)\n    out = [")],
        g.test_one_f_one_b_builds_its_own_order, r"one_f_one_b\(1, 1, 0\) called one of the library's schedules"),
    "ex04.C.keep": (
        [("        out += before + [a] + after", "        out += before + [a] + after + ([a] if a.op == 'W' else [])")],
        g.test_add_comms, r"GPipe with split backwards, p = 2, m = 2, rank 0, compute action 5: expected W1s0, got W0s0 \(the result holds order's "
        r"compute actions unchanged"),
    "ex04.C.comms": (
        [("        out += before + [a] + after", "        out += [a] + before + after")],
        g.test_add_comms, r"GPipe, p = 2, m = 2, rank 0, action 5 \(RECV_B0s0<-1\): outside the span .*exactly one send"),
    "ex04.C.peer": (
        [("src % p)] if 0 <= src", "src)] if 0 <= src"), ("dst % p)] if 0 <= dst", "dst)] if 0 <= dst")],
        g.test_add_comms, r"interleaved GPipe, p = 2, m = 2, rank 0, action 6 \(SEND_F0s2->3\): peer 3, stage's rank 1 "
        r"\(the peer of a message is the rank holding the other stage\)"),
    "ex04.C.deadlock": (     # each run of messages posts its receives before its sends
        [("        out += before + [a] + after\n    return out",
          "        out += before + [a] + after\n"
          "    runs = [[]]\n"
          "    for a in out:\n"
          "        runs[-1].append(a)\n"
          "        if a.op in ('F', 'B', 'W'):\n"
          "            runs.append([])\n"
          "    return [a for run in runs for a in sorted(run, key=lambda a: (a.op in ('F', 'B', 'W'), "
          "not a.op.startswith('RECV')))]")],
        g.test_add_comms_cannot_deadlock, r"GPipe, p = 2, m = 2: the simulation stops: .*deadlocks.* \(in that model the p "
        r"ranks' actions finish"),
    "ex04.C.divide": (
        [("        if inputs.shape[0] % m:\n", "        if False:\n")],
        g.test_pipeline_step, r"a batch m does not divide is a ValueError"),
    "ex04.C.loss": (
        [("        return float(self.loss) if self.last in self.stages else None", "        return float(self.loss)")],
        g.test_pipeline_step, r"returned \[0\.0, .*\] on ranks 0, 1"),
    "ex04.C.clean": (
        [("targets.chunk(m), 0.0", 'targets.chunk(m), getattr(self, "loss", 0.0)')],
        g.test_pipeline_step, r"(?s)step 1: loss.*seen: step 0's loss equals one process's"),
    "ex04.C.batched": (
        [("            with nullcontext() if compute else batched():", "            with nullcontext():")],
        g.test_pipeline_step, r"message 0 posted outside any batched\(\) block \(every send and receive is posted"),
    "ex04.C.sent": (     # the sends never waited on: a hang, or (Gloo delivered them) missing from the record
        [("        self.mail.flush()\n", "")],
        g.test_pipeline_step, r"(?s)(sends completed and recorded by the time Pipeline\.step returned|or one never waited on \(ex04\.C\.sent\))"),
    "ex04.C.peak": (
        [("        self.peak_stash = self.stash.peak", "        self.peak_stash = len(self.stash)")],
        g.test_trains_the_gpt, r"peak micro-batches held, per rank, measured while training(?s:.*)breaks ex04\.C\.peak"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex04", g, PLANTS)


def test_a_warm_up_not_capped_at_m_fails_where_m_is_below_p(tmp_path):
    """1F1B whose warm-up ignores m runs forwards of micro-batches that do not exist once m < p."""
    from tests.planted import fails, planted
    with planted("ex04", tmp_path, ("    warmup = min(p - rank - 1, m)\n    out = [",
                                    "    warmup = p - rank - 1\n    out = [")):
        fails(g.test_one_f_one_b_is_valid, match=r"p = 3, m = 1, rank 0, action 1 \(F1s0\): the Fs so far ran "
              r"micro-batches 0\.\.0, this one is micro-batch 1 \(m = 1\) \(every rank's order has exactly 2m")


def test_a_min_max_that_partition_does_not_expose_fails(tmp_path):
    """A _min_max that returns a feasible but not the best cost (the total): partition, taking the most
    even split under it, still passes its own tests; _min_max graded on its own fails, naming ex04.A.optimal."""
    from tests.planted import fails, planted
    edit = ("    return best[p][L]\n", "    return prefix[L]\n")
    with planted("ex04", tmp_path, edit):
        g.test_partition_is_balanced("exercise")            # not exposed by partition
        fails(g.test_min_max_is_the_best_costliest_stage, match=r"_min_max\(\[.*\], p=\d\) .*: the cost of the costliest "
              r"stage of the best split, by brute force \(the most expensive stage is as cheap as possible\)")


def test_an_order_holding_fewer_than_1f1b_names_the_bubble_in_training(tmp_path):
    """A warm-up one forward short (rank r holds p - r - 1 micro-batches, at least one): valid, and it
    trains like one process, but the ranks wait longer; the 4-rank training names ex04.B.bubble for
    the peaks measured, not ex04.B.memory, whose bound it keeps."""
    from tests.planted import fails, planted
    with planted("ex04", tmp_path, ("    warmup = min(p - rank - 1, m)", "    warmup = max(min(p - rank - 2, m), 0)")):
        message = fails(g.test_trains_the_gpt, match=r"peak micro-batches held, per rank(?s:.*)breaks ex04\.B\.bubble")
    assert "breaks ex04.B.memory" not in message


def test_a_send_waited_on_at_once_hangs_naming_both_ways_a_send_can_be_waited_wrong(tmp_path):
    """Each send waited on as soon as it is posted: the schedules' messages are right (they finish in
    the simulator), but two ranks that send to each other first wait for each other; the hang's
    message names the send waited on at once (the model's sends never wait, ex04.C.deadlock) as well
    as the send never waited on (ex04.C.sent), not one of them only."""
    from tests.planted import fails, planted
    with planted("ex04", tmp_path, ("        self.mail.send(a, self.outbox.pop((a.op[-1], a.microbatch, a.stage)))",
                                    "        self.mail.send(a, self.outbox.pop((a.op[-1], a.microbatch, a.stage)))\n"
                                    "        self.mail.flush()")):
        message = fails(g.test_pipeline_step, match=r"(?s)a send waited on before the step went on")
    assert "ex04.C.deadlock" in message and "ex04.C.sent" in message, message


def test_a_loss_kept_from_the_last_step_names_clean_in_training(tmp_path):
    """The loss not reset between steps: the 4-rank training's first step is one process's, its
    second is not; the failure names ex04.C.clean (the clause of every later step), not the
    memory or peak clauses the test also observes."""
    from tests.planted import fails, planted
    with planted("ex04", tmp_path, ("targets.chunk(m), 0.0", 'targets.chunk(m), getattr(self, "loss", 0.0)')):
        fails(g.test_trains_the_gpt, match=r"step 1: loss(?s:.*)breaks ex04\.C\.clean")
