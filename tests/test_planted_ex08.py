"""ex08's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""

from minipar.course.graded import test_ex08_context_parallel as g
from tests.planted import contract_tests

FWD = '''    c, r = comm.group_size(group), comm.group_rank(group)
    nxt, prv = (r + 1) % c, (r - 1) % c
    kv, o, lse = torch.stack([k, v]), None, None'''   # the forward's first lines (the backward's differ)
CACHED_DELTA = ('    delta = (do * o).sum(-1)\n',
                '    global _delta\n    if globals().get("_delta") is None or _delta.dtype != o.dtype:\n        _delta = (do * o).sum(-1)\n'
                '    delta = _delta\n')
ZIGZAG_PAIRS = ("    return rank, 2 * cp - 1 - rank", "    return 2 * rank, 2 * rank + 1")
PLANTS = {  # clause -> (edits, graded test, its extra arguments, what the message must name)
    "ex08.A.unequal": (
        [("    o = (w_a.unsqueeze(-1) * o_a + w_b.unsqueeze(-1) * o_b) / (w_a + w_b).unsqueeze(-1)",
          "    o = (o_a + o_b) / 2")],
        g.test_merge_two_blocks, (), r"keys 0\.\.9 merged with 10\.\.15: merged o"),
    "ex08.A.exact": (
        [("    lse = m + torch.log(w_a + w_b)", "    lse = m")],
        g.test_merge_many_blocks_any_order, (), r"lse of four blocks of 4 keys merged one at a time"),
    "ex08.A.stable": (
        [("    m = torch.maximum(lse_a, lse_b)", "    m = torch.zeros_like(lse_a)")],
        g.test_merge_is_stable_for_large_scores, (), r"(?s)large scores.*holds inf or nan"),
    "ex08.B.cover": (
        [ZIGZAG_PAIRS], g.test_zigzag_chunks, (), r"rank 1's chunks for cp = 4"),
    "ex08.B.balance": (
        [ZIGZAG_PAIRS], g.test_zigzag_shards_balance_the_causal_work, (), r"positions each rank holds"),
    "ex08.B.range": (
        [("    if not 0 <= rank < cp:\n        raise", "    if False:\n        raise")],
        g.test_zigzag_rank_off_the_group, (), r"off the group: a ValueError"),
    "ex08.C.exact": (
        [("        src = (r - s) % c\n        if s < c - 1:   # send", "        src = (r + s) % c\n        if s < c - 1:   # send")],
        g.test_ring_attention_with_your_code, (4,), r"cp = 4, rank \d \(its zigzag shard\): (O|lse), index"),
    "ex08.C.skip": (
        [('        return "full" if src < rank else "skip"', '        return "full"')],
        g.test_ring_step_parts, (), r"ring_step\(rank, src, cp=2, causal=True, layout='contiguous'\)"),
    "ex08.A.empty": (   # a stabiliser that is not the maximum: -inf poisons it
        [("    m = torch.maximum(lse_a, lse_b)", "    m = (lse_a + lse_b) / 2")],
        g.test_merge_with_a_block_some_queries_do_not_see, (), r"queries 0\.\.4 see no key of block b"),
    "ex08.D.sends": (   # the backward passes its K/V block on at every step: c sends, not c - 1
        [("        if s < c - 1:\n            nxt_kv = _start_exchange(kv, prv, nxt, group, \"ring_kv\", 0)\n"
          "        part = ring_step(r, src, c, causal, layout)\n        contrib",
          "        if True:\n            nxt_kv = _start_exchange(kv, prv, nxt, group, \"ring_kv\", 0)\n"
          "        part = ring_step(r, src, c, causal, layout)\n        contrib"),
         ("        kv = nxt_kv() if s < c - 1 else kv\n    dkv", "        kv = nxt_kv()\n    dkv")],
        g.test_ring_attention_with_your_code, (2,), r"the ring attention's backward.*bytes sent, as recorded"),
    "ex08.*.recorded": (   # the forward's transfers made with torch.distributed directly: not recorded
        [("            nxt_kv = _start_exchange(kv, prv, nxt, group, \"ring_kv\", 0)\n        part = ring_step(r, src, c, "
          "causal, layout)\n        with trace.region(\"attention\"",
          "            _d, _buf = __import__(\"torch\").distributed, torch.empty_like(kv)\n"
          "            _ops = _d.batch_isend_irecv([_d.P2POp(_d.isend, kv.contiguous(), nxt), _d.P2POp(_d.irecv, _buf, prv)])\n"
          "            nxt_kv = lambda _ops=_ops, _buf=_buf: ([o.wait() for o in _ops], _buf)[1]\n"
          "        part = ring_step(r, src, c, causal, layout)\n        with trace.region(\"attention\"")],
        g.test_ring_attention_with_your_code, (2,), r"the ring attention's forward.*bytes sent, as recorded"),
    "ex08.C.parts": (   # zigzag's two off-diagonal parts swapped
        [('    return "kv_front" if src < rank else "q_back"', '    return "q_back" if src < rank else "kv_front"')],
        g.test_ring_step_parts, (), r"layout='zigzag'"),
    "ex08.*.group": (
        [(FWD, FWD.replace("comm.group_rank(group)", "comm.group_rank()"))],
        g.test_ring_attention_on_subgroups, (), r"rank [23] \(rank [01] of cp group \[2, 3\]"),
    "ex08.*.dtype": (
        [("        kv = nxt_kv() if s < c - 1 else kv\n    return o, lse",
          "        kv = nxt_kv() if s < c - 1 else kv\n    return o.float(), lse.float()")],
        g.test_ring_attention_on_subgroups, (), r"the dtype of O, float64, causal, contiguous.*: expected"),
    "ex08.D.exact": (
        [("            contrib += pending()", "            pending()")],
        g.test_ring_attention_with_your_code, (4,), r"cp = 4, rank \d \(its zigzag shard\): dK, index"),
    "ex08.D.second": (
        [CACHED_DELTA], g.test_ring_attention_on_subgroups, (), r"float64, no mask, contiguous: rank"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex08", g, PLANTS, elsewhere={"ex08.C.sends"})  # planted in tests/test_planted_wrong_answers.py
