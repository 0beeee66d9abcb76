"""ex08's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""

from minipar.course.graded import test_ex08_context_parallel as g
from tests.planted import contract_tests

FWD = '''    """``(O, lse)`` of this rank's queries over the whole sequence's keys (no autograd)."""
    c, r = comm.group_size(group), comm.group_rank(group)'''
CACHED_DELTA = ('    delta = (do * o).sum(-1)\n',
                '    global _delta\n    if globals().get("_delta") is None or _delta.dtype != o.dtype:\n        _delta = (do * o).sum(-1)\n'
                '    delta = _delta\n')
ZIGZAG_PAIRS = ("    return rank, 2 * cp - 1 - rank", "    return 2 * rank, 2 * rank + 1")
PLANTS = {  # clause -> (edits, graded test, its extra arguments, what the message must name)
    "The blocks may be of unequal length": (
        [("    o = (w_a.unsqueeze(-1) * o_a + w_b.unsqueeze(-1) * o_b) / (w_a + w_b).unsqueeze(-1)",
          "    o = (o_a + o_b) / 2")],
        g.test_merge_two_blocks, (), r"keys 0\.\.9 merged with 10\.\.15: merged o"),
    "merging the blocks of a split key set, in any order": (
        [("    lse = m + torch.log(w_a + w_b)", "    lse = m")],
        g.test_merge_many_blocks_any_order, (), r"lse of four blocks of 4 keys merged one at a time"),
    "log-sum-exps are near 1000, where a plain ``exp`` overflows": (
        [("    m = torch.maximum(lse_a, lse_b)", "    m = torch.zeros_like(lse_a)")],
        g.test_merge_is_stable_for_large_scores, (), r"(?s)large scores.*holds inf or nan"),
    "together the ranks hold each chunk exactly once": (
        [ZIGZAG_PAIRS], g.test_zigzag_chunks, (), r"rank 1's chunks for cp = 4"),
    "rank's queries do the same attention work": (
        [ZIGZAG_PAIRS], g.test_zigzag_shards_balance_the_causal_work, (), r"positions each rank holds"),
    "A rank outside the group is a ``ValueError``": (
        [("    if not 0 <= rank < cp:\n        raise", "    if False:\n        raise")],
        g.test_zigzag_rank_off_the_group, (), r"off the group: a ValueError"),
    "O and lse equal full attention's rows of that rank's tokens": (
        [("        src = (r - s) % c\n        if s < c - 1:   # send", "        src = (r + s) % c\n        if s < c - 1:   # send")],
        g.test_ring_attention_with_your_code, (4,), r"cp = 4, rank \d \(its zigzag shard\): (O|lse), index"),
    "a later block under the causal mask is skipped, never computed": (
        [('        return "full" if src < rank else "skip"', '        return "full"')],
        g.test_ring_step_parts, (), r"ring_step\(rank, src, cp=2, causal=True, layout='contiguous'\)"),
    "on a non-world group (a cp group of 2 out of 4 ranks), ranks count within their group": (
        [(FWD, FWD.replace("comm.group_rank(group)", "comm.group_rank()"))],
        g.test_ring_attention_on_subgroups, (), r"rank [23] \(rank [01] of cp group \[2, 3\]"),
    "each dtype kept (float64 and bfloat16 in, the same dtype out)": (
        [("        kv = nxt_kv() if s < c - 1 else kv\n    return o, lse",
          "        kv = nxt_kv() if s < c - 1 else kv\n    return o.float(), lse.float()")],
        g.test_ring_attention_on_subgroups, (), r"the dtype of O, float64, causal, contiguous.*: expected"),
    "dQ, dK, dV equal full attention's gradients of the rank's tokens": (
        [("            contrib += pending()", "            pending()")],
        g.test_ring_attention_with_your_code, (4,), r"cp = 4, rank \d \(its zigzag shard\): dK, index"),
    "a second step after the first (another q, k, v and dO) is as exact as the first": (
        [CACHED_DELTA], g.test_ring_attention_on_subgroups, (), r"float64, no mask, contiguous: rank"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex08", g, PLANTS)
