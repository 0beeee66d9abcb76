"""Exercise 08: context parallelism: ring attention, forward and backward, and its layout.

Each rank of a cp group holds T/c tokens of every sequence; only attention needs the other
ranks' tokens. Notebook 08 shows the ring, the merge and the causal imbalance on real ranks;
here you build them.

A. ``merge_partials(o_a, lse_a, o_b, lse_b)``: the online-softmax merge, exact where the
   formula written out is not (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022).
B. ``zigzag_chunks(rank, cp)``: which two of the 2·cp chunks a rank holds so that causal
   attention costs every rank the same (the Llama 3 report, Dubey et al. 2024, §3.3.2).
C. ``ring_step(rank, src, cp, causal, layout)`` and ``ring_forward(q, k, v, group, causal,
   layout, attention)``: ring attention's forward (Liu et al. 2023): which pairs a step scores,
   and the loop around the ring, yours to design.
D. ``ring_backward(q, k, v, o, lse, do, group, causal, layout, attention)``: the written-out
   backward: how each key block's gradient collects every rank's contribution is yours.

Each function's docstring below is its contract: clauses ``ex08.P.word`` that must hold (the
grader names the clause a failure breaks). The last tests run the library's ring attention on
2 and 4 ranks (and on two cp groups of 2 out of 4) and train the GPT with context parallelism,
your functions in place, and compare with one process. Stuck? ``minipar.hint("ex08", "A")``
(or "B", "C", "D") gives a nudge, then the idea, then the steps. Grade it with
``python -m minipar.grade ex08``.
"""
import pytest
import torch

import minipar
from minipar import comm, cost, data, reference
from minipar import context_parallel as cpm
from minipar.course import grading
from minipar.course.grading import (breaks, diagnose, expect, expect_close, expect_equal, expect_recorded,
                                    expect_same_training, observes)
from minipar.runtime import trace
from minipar.models import GPT, GPTConfig

EXERCISE = "ex08_context_parallel"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNotjcEOwjAMQ3/FN0BC+wBuHPgOlI5MrdY1Jclg+3ta4GDJku3nqzsXT1IgL1YE8YiQZZwNkQxSG'
        'EV0oZysxbXpubLuF3hk2LpAJvBWjzaK8ukHoZwx824DbltVNkPyM6g8wDT+8QeDRVLu+56+UzvOxnf6FrsLw'
        'weeBzfm',
        'sealed:eNo9j01OxDAMha/ydlBBK7EdxIIL9Aoo7TiNRRJD7Awztx9HI7Hz3/veM11/nrPShA/Qo/wKE17+m'
        '216B4U9Ycuyfz8pBKz4Iz6S0RnbDWwKTaERJMJSMGgvC1a6UMMech4sSEVAlmP25TwGLqMcTy7laNjE0oBZI'
        'm4o4cqlFxREbmqvUMHA3QZKKlXjkEcONyuihrcFn4+E7vLbx6USKapjuR4j2fjGn5y5xgmlu+jcxHN1x/sZr'
        'Lc67NFIezZwNcEa1uUOvPNkbg==',
        'sealed:eNpVjk1SwzAMha/ylvE0LVNYMtyCfUcmSuIhjkJlJ4GLsedk2C7phJWevqef5/ECT2s1KF+oRi7WP'
        'GO5UDJ4nW4GjvCF2h21fzTpfAQHDNJVefOQJ5MjiWfw8y0bzdIaPGA3WCP0jIVd1weFvQo1b6QBMvO1WEPua'
        'HWKKo76EZm/uDqejTnhNdlKnjHTEBmk/0Knarbn+9gbtzVsDOVH42anTkbYz9Jr9JD2JnvXBm7uCd+ZJy1OW'
        'ORO04J3Y4cgOMONaKenx9MvgkV15A==',
    ),
    'B': (
        'sealed:eNo1jTEOwjAQBL+yPQiJloaWD/CAU7Iilp2z8V0C/n2Ogm5ni5mnzuwQTLKZFKxiOei9sQ+Io1VLn'
        'qoiBTl1NngNOOGKzGE3UHoZmJZNs0E6Y1LaGUWc/5vfRrW084JH/URLwf1X6KIZLzp8IUxWht2l3A+P3TUG',
        'sealed:eNpFjusNwjAQg1fxAIgBmIIV3OCSquml5NHC9qQpEj9Osiz7O985JRDOV5sxprigeB3CCjzDiDh2J'
        '+tVZU7Yp+IRTf/wQDf37AU5NoelA8X1h6U92kHvVZanTb3OsPOTURI3BZT4VGOlWyeeNavLoJSPBaLzWI+pu'
        'ban8ZzERdgYqq5fdjlG8A==',
        'sealed:eNoLSszLVihSyMjPSSlWSM4oBfMS81IUMkuKFXIzi4ryixQycxPTUxWMDm1PLlDQVTAE4iJroNrU5'
        'GwFAwUbW4UikBk2CkDZtMyi4hI9AMOTG7M=',
    ),
    'C': (
        'sealed:eNo1jzESwjAMBL9yHU2GB9BQ8QQeIBwFe+LYQZJD8ntsA+Wt9uZGt43lgFCaISUpzDOUFkbMeUWe4'
        'KDGq15ABibnh5pJrIu8O0/pyc1r+RGzmxESKh0xBVEb2iHB5WUtVsWE8GdGM/easOOw8fjrT1k6TrxbHz/jn'
        'kYWEBwVpYiFdB7w9sH5b0cRA1eQYzzaPuFV6l8nxVSsCF8/GZFSEw==',
        'sealed:eNpVkcFugzAQRH9lbgUpQU2PVO2ln9Ceeqk24ICF46W7NlH69V1wOfSIdmaYN35PbsYjvILCje6KN'
        'Dr0ngaOFFCpdHiB1C18UojTHBI0kaSilByjjwMqPiCoq5/hFid3BEpOMJsOVyeDU/iY2EIOoNiDyimNlNCxO'
        'RQcwx3KV8vkm6L6/jpTN9W7fTunkbXcG7xxTH7InLXF2vIVslKspS45ZXFWfvJz3eDTDz80tBCKk4lGDr2iG'
        '3OcjGir89QdT0c52O/tE44keGu/6h8U58DdtEYvXv05uL2KcB7GbZaLWJeSuOMV/n8JxcbmtKz9YojF2ODDm'
        'gfSdV57kplUDTuyyW1fju2GVqJunEP/Fyi0uGBQNlzV4YgT1MVe6+YXtWOlfA==',
        'sealed:eNqFUctuwyAQ/JXpoTKoxEquTv0lkYVsRFyEaxwgTtSv79h1m9x6YIV2XrtgFCJq9DFcJ53cl1XbP'
        'bajP8LPBFNujRcnrzA38ohziEhwI0jprTCyQoqGPBGxQ5J4hTnCnUl6h9kdKoz3TFjTJ2Zt7+ZjFfpZYYos8'
        'e2wpSoU0Y299nOhsGfWRAWlazNlO4myLOVqviIvNYrk3VRUuCQFzzPzxHBj1Uvm7OwtiQuxJY0aqoPuFIZkd'
        'UdGm7Mdswuj7obANZ99ftKZYdpragfO9MdebFaTZe+HoSSDe9fYK9gFDSdO/DtR1ay0R6sh89PG3uolyrVDE'
        'v8I1NP0cvsfPq+Q5Tc+OI4z',
    ),
    'D': (
        'sealed:eNoNyMENwjAQBdFW5saFCrjQBA0s8Se2nHiF1yFK9/gy0ptXFmu3VNQG/sGounhvvlRKTMax4z91N'
        'HPRrdVb8D3Ui+LBmZ3FGpYSwynjjrVE9pPkijlYNaZ3Pf8NniWX',
        'sealed:eNo9jzFuwzAMRa/ytySAayBz0aFAtw5Bl+y0RMeCbUmgqBjtCXqEnq8nKW0HBQQN/J//ffoPFKXPg'
        'hQRtEAojs/w7w38FakHoZuSG6FCd56wBB2gA+/TFq8KJjdYBme4NOeqbHrYgw7FZlEldFWDAez97yJEDBQ9j'
        'l8sqaBPYrAyhpzZI5PoqQF5j2UgBYmEu817STPk6bzZdVUKzY9Es1tcYftWSqnzCtwb0w1na9srC9zWtmwmc'
        'q7OdSJd6SsjxBvCrj0uSEvc8w+lxRteIGmx7KO/4Pf7B5eTURw36Ng68bY5pZTbP8mMeLo=',
        'sealed:eNpNUdFuwyAM/JV7a7Jl1fK6ikn7jqhCFNwmIoMUCK329XPSUuXBYHyHucOGxqQgUBmPN/h6H+ff6'
        'qOtDzj7AFK6R0w0fUF7l8JwYuofBR/lOFiqbGaiucpTA2PXNcuFolIilwbv5Gn0mhGl7U0FU11jA8uROXwX/'
        'C0eG4yRSmpeRa3mqEYxqZAgBHaP844pi2KxroX7ek68slXXA8e7WDUeiofu89hpPz4Ru0XaLZI3yFKYyJnBX'
        'aoawxneEYZYaoeSsHkZE4uWdNe9cheqnh0aTCE3cPfU4BL8PDXYBb4hjc1sq61x68lB4xvtHj8JqSdwU1aYs'
        'X28NCx8/p1lXoHSHBw7XWaR2eNjb4/7f2WAo0U=',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT


def _qkv(T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, T, 4, generator=g) for _ in range(4)]


@observes("ex08.A.unequal")
def test_merge_two_blocks(impl):
    """merge_partials of attention on keys 0..9 and 10..15 equals attention on all 16 keys."""
    q, k, v, _ = _qkv()
    o, lse = cpm.attention_block(q, k, v)
    a = cpm.attention_block(q, k[..., :10, :], v[..., :10, :])
    b = cpm.attention_block(q, k[..., 10:, :], v[..., 10:, :])
    o_m, lse_m = cpm.merge_partials(*a, *b)
    expect_close(lse_m, lse, "merged lse (attention on all 16 keys), index (batch, head, query)",
                 where="keys 0..9 merged with 10..15", rtol=1e-5, atol=1e-5)
    expect_close(o_m, o, "merged o (attention on all 16 keys), index (batch, head, query, feature)",
                 where="keys 0..9 merged with 10..15", rtol=1e-5, atol=1e-5)


@observes("ex08.A.exact")
def test_merge_many_blocks_any_order(impl):
    """Merging four blocks one at a time, in either order, gives attention on all of them."""
    q, k, v, _ = _qkv()
    o, lse = cpm.attention_block(q, k, v)
    parts = [cpm.attention_block(q, k[..., i:i + 4, :], v[..., i:i + 4, :]) for i in range(0, 16, 4)]
    for name, order in (("first to last", parts), ("last to first", parts[::-1])):
        acc = order[0]
        for p in order[1:]:
            acc = cpm.merge_partials(*acc, *p)
        expect_close(acc[1], lse, "lse of four blocks of 4 keys merged one at a time", where=name, rtol=1e-5, atol=1e-5)
        expect_close(acc[0], o, "o of four blocks of 4 keys merged one at a time", where=name, rtol=1e-5, atol=1e-5)


@observes("ex08.A.stable")
def test_merge_is_stable_for_large_scores(impl):
    """Log-sum-exps near 1000: the merge is finite and correct (ex08.A.stable's tolerance)."""
    o_a, o_b = torch.ones(3, 2), torch.full((3, 2), 3.0)
    lse_a, lse_b = torch.tensor([1000.0, 1000.0, 5.0]), torch.tensor([1000.0, 999.0, 1000.0])
    o, lse = cpm.merge_partials(o_a, lse_a, o_b, lse_b)
    w = torch.sigmoid(lse_a - lse_b)                      # weight of block a
    with diagnose(lambda e: not bool(torch.isfinite(lse).all() and torch.isfinite(o).all()),
                  "the merged lse or o holds inf or nan: an exp of a log-sum-exp near 1000 overflows fp32"):
        expect_close(lse, torch.logaddexp(lse_a, lse_b), "merged lse for lse_a = [1000, 1000, 5], "
                     "lse_b = [1000, 999, 1000]", where="large scores", rtol=1e-5, atol=1e-5)
        expect_close(o[:, 0], w * 1 + (1 - w) * 3, "merged o (o_a = 1, o_b = 3), per query", where="large scores",
                     rtol=1e-5, atol=1e-5)


@observes("ex08.A.empty")
def test_merge_with_a_block_some_queries_do_not_see(impl):
    """Where a query sees no key of a block (lse -inf, o zeros), the merge is the other block's, finite."""
    q, k, v, _ = _qkv()
    a = cpm.attention_block(q, k[..., :10, :], v[..., :10, :])
    o_b, lse_b = (t.clone() for t in cpm.attention_block(q, k[..., 10:, :], v[..., 10:, :]))
    o_b[..., :5, :], lse_b[..., :5] = 0.0, float("-inf")          # queries 0..4 see none of block b
    want_o, want_lse = cpm.attention_block(q, k, v)
    want_o[..., :5, :], want_lse[..., :5] = a[0][..., :5, :], a[1][..., :5]
    for order, (x, y) in (("a then b", (a, (o_b, lse_b))), ("b then a", ((o_b, lse_b), a))):
        o, lse = cpm.merge_partials(*x, *y)
        where = f"{order}: queries 0..4 see no key of block b (its lse -inf)"
        expect(bool(torch.isfinite(o).all() and torch.isfinite(lse).all()),
               f"{where}: the merged o or lse holds inf or nan (ex08.A.empty)")
        expect_close(lse, want_lse, "merged lse, index (batch, head, query)", where=where, rtol=1e-5, atol=1e-5)
        expect_close(o, want_o, "merged o, index (batch, head, query, feature)", where=where, rtol=1e-5, atol=1e-5)


@observes("ex08.B.cover")
def test_zigzag_chunks(impl):
    """zigzag_chunks for several cp: each rank's chunks against the contract's, and every chunk held once."""
    expect_equal(tuple(cpm.zigzag_chunks(0, 1)), (0, 1), "rank 0's chunks for cp = 1 (zigzag_chunks(0, 1))",
                 keys="entry")
    expect_equal(tuple(cpm.zigzag_chunks(1, 4)), (1, 6), "rank 1's chunks for cp = 4 (zigzag_chunks(1, 4))",
                 keys="entry")
    for cp in (2, 3, 4):
        got = {r: tuple(cpm.zigzag_chunks(r, cp)) for r in range(cp)}
        expect_equal(sorted(c for pair in got.values() for c in pair), list(range(2 * cp)),
                     f"cp = {cp}: the chunks all ranks hold together (each of the {2 * cp} once); per rank: {got}")
        expect_equal(got, {r: (r, 2 * cp - 1 - r) for r in range(cp)}, f"zigzag chunks, cp = {cp}", keys="rank")


@observes("ex08.B.range")
def test_zigzag_rank_off_the_group(impl):
    """A rank outside the group is a ValueError."""
    for bad in (4, -1):
        try:
            got = cpm.zigzag_chunks(bad, 4)
        except ValueError:
            continue
        expect(False, f"zigzag_chunks({bad}, cp=4) returned {got}; rank {bad} is off the group: a ValueError")


@observes("ex08.B.balance")
def test_zigzag_shards_balance_the_causal_work(impl):
    """With your chunks, shard_sequence and unshard_sequence round-trip and every rank's tokens
    have the same total position (the causal work each rank's queries do)."""
    x = torch.arange(16).view(1, 16)
    shards = [cpm.shard_sequence(x, r, 4, "zigzag") for r in range(4)]
    expect_equal({r: sh.tolist()[0] for r, sh in enumerate(shards)},
                 {r: [2 * r, 2 * r + 1, 14 - 2 * r, 15 - 2 * r] for r in range(4)},
                 "positions each rank holds (16 tokens, cp = 4, zigzag)", keys="rank")
    expect_close(cpm.unshard_sequence(shards, "zigzag"), x, "unshard_sequence(shard_sequence(x)) (x = 0..15)",
                 rtol=0, atol=0)
    expect_equal([int(sh.sum()) for sh in shards], [int(shards[0].sum())] * 4,
                 "the sum of the positions each rank holds (its causal work)", keys="rank")


def _sent(since):
    """(bytes sent, messages sent) in the communication recorded since event ``since``."""
    evs = [e for e in trace.events()[since:] if e["kind"] == "comm" and e["bytes_sent"]]
    return sum(e["bytes_sent"] for e in evs), len(evs)


def _ring(layout):
    c, r = comm.group_size(), comm.group_rank()
    q, k, v, w = _qkv(T=16)
    ql, kl, vl = (cpm.shard_sequence(t, r, c, layout, dim=2).requires_grad_() for t in (q, k, v))
    since = len(trace.events())
    o, lse = cpm.ring_attention(ql, kl, vl, None, True, layout)
    forward, since = _sent(since), len(trace.events())
    (o * cpm.shard_sequence(w, r, c, layout, dim=2)).sum().backward()
    return [o.detach(), lse, ql.grad, kl.grad, vl.grad, {"forward": forward, "backward": _sent(since)}]


def _check_ring_traffic(results, cp, shape):
    """Each rank's recorded bytes and messages in the forward and the backward: the ring's
    (cost.cp_comm_bytes): its K/V block c - 1 times forward; backward the K/V block c - 1 times
    and the dK/dV accumulators c times."""
    b, heads, T, d = shape
    want = cost.cp_comm_bytes("ring", b, T, heads * d, cp, 4)
    messages = {"forward": cp - 1, "backward": 2 * cp - 1}
    said = {"forward": "the forward sends its K/V block to the next rank c - 1 times, one message each",
            "backward": "the backward sends the K/V block on c - 1 times and the dK/dV accumulator c times"}
    for r, res in enumerate(results):
        for phase in ("forward", "backward"):
            sent, count = res[5][phase]
            where = f"cp = {cp}, rank {r}, the ring attention's {phase}"
            with breaks("ex08.*.recorded" if sent == 0 else "ex08.C.sends" if phase == "forward" else "ex08.D.sends"):
                expect_recorded(sent, int(want[phase]), f"bytes sent, as recorded (cost.cp_comm_bytes('ring', ...)"
                                f"['{phase}']: {said[phase]})", where)
                expect_equal(count, messages[phase], f"{where}: messages sent, as recorded ({said[phase]})")


@pytest.mark.parametrize("cp", [2, 4])
@observes("ex08.C.exact", "ex08.D.exact", "ex08.C.sends", "ex08.*.recorded", "ex08.D.sends")
def test_ring_attention_with_your_code(impl, cp):
    """The library's ring attention (zigzag, causal) equals full attention: O, lse, dQ, dK, dV;
    each rank sends the ring's bytes and messages (cost.cp_comm_bytes), forward and backward."""
    q, k, v, w = (t.clone() for t in _qkv(T=16))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = cpm.masked_attention(q, k, v, causal=True)
    (o * w).sum().backward()
    want = [o.detach(), lse.detach(), q.grad, k.grad, v.grad]
    results = minipar.launch(_ring, cp, args=("zigzag",), timeout=TIMEOUT)
    T = 16
    for i, name in enumerate(("O", "lse", "dQ", "dK", "dV")):
        for r, res in enumerate(results):
            c0, c1 = r, 2 * cp - 1 - r                    # zigzag, written out independently
            parts = want[i].chunk(2 * cp, dim=2)
            mine = torch.cat([parts[c0], parts[c1]], dim=2)
            with breaks("ex08.C.exact" if i < 2 else "ex08.D.exact"):     # O and lse forward, the rest backward
                expect_close(res[i], mine, f"{name}, index (batch, head, position within the rank's shard, ...)",
                             where=f"cp = {cp}, rank {r} (its zigzag shard)", rtol=1e-5, atol=1e-5)
    _check_ring_traffic(results, cp, tuple(q.shape))


def _want_step(r, src, c, causal, layout):
    if not causal:
        return "full"
    if src == r:
        return "causal"
    if layout == "contiguous":
        return "full" if src < r else "skip"
    return "kv_front" if src < r else "q_back"


@observes("ex08.C.skip", "ex08.C.parts")
def test_ring_step_parts(impl):
    """ring_step on rings of 1 to 5 ranks, with and without a mask, both layouts: the part of the attention
    each rank computes with each source's block, against the contract's."""
    for causal in (False, True):
        for layout in ("contiguous", "zigzag"):
            for c in range(1, 6):
                got = {(r, src): cpm.ring_step(r, src, c, causal, layout) for r in range(c) for src in range(c)}
                want = {(r, src): _want_step(r, src, c, causal, layout) for r in range(c) for src in range(c)}
                wrong = [key for key in want if got[key] != want[key]]
                skip = any("skip" in (got[key], want[key]) for key in wrong)
                with breaks("ex08.C.skip" if skip else "ex08.C.parts"):
                    expect_equal(got, want, f"ring_step(rank, src, cp={c}, causal={causal}, layout={layout!r})",
                                 keys="(rank, src)")


def _subgroup_case(seed, dtype, causal, layout, T=12):
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(1, 2, T, 4, generator=g).to(dtype) for _ in range(4))
    return q, k, v, w


SUB_CASES = [  # (name, dtype, causal, layout): run in turn, so the later ones are later steps
    ("float64, causal, contiguous", torch.float64, True, "contiguous"),
    ("float64, no mask, contiguous", torch.float64, False, "contiguous"),
    ("float64, causal, zigzag (a second step)", torch.float64, True, "zigzag"),
    ("bfloat16, causal, zigzag", torch.bfloat16, True, "zigzag"),
]


def _on_subgroups():
    import torch.distributed as dist
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # every rank creates both
    gi = dist.get_rank() // 2
    group, r = groups[gi], dist.get_rank() % 2
    out = []
    for i, (_, dtype, causal, layout) in enumerate(SUB_CASES):
        q, k, v, w = _subgroup_case(10 * gi + i, dtype, causal, layout)
        ql, kl, vl = (cpm.shard_sequence(t, r, 2, layout, dim=2).requires_grad_() for t in (q, k, v))
        o, lse = cpm.ring_attention(ql, kl, vl, group, causal, layout, "materialized")
        if o.dtype != dtype or lse.dtype != dtype:     # reported by the driver, before any backward
            out.append([o.detach(), lse, None, None, None])
            continue
        (o * cpm.shard_sequence(w, r, 2, layout, dim=2)).sum().backward()
        out.append([o.detach(), lse, ql.grad, kl.grad, vl.grad])
    return out


@observes("ex08.C.exact", "ex08.*.group", "ex08.*.dtype", "ex08.D.exact", "ex08.D.second")
def test_ring_attention_on_subgroups(impl):
    """4 ranks in two cp groups of 2 ([0, 1] and [2, 3], each its own sequence): float64 causal
    contiguous, float64 without a mask, float64 zigzag, bfloat16 zigzag, one after another. O, lse,
    dQ, dK, dV equal full attention's (float64: rtol = atol = 1e-10), in the inputs' dtype."""
    results = minipar.launch(_on_subgroups, 4, timeout=TIMEOUT)
    for i, (name, dtype, causal, layout) in enumerate(SUB_CASES):
        for gi in range(2):
            q, k, v, w = (t.double().requires_grad_() for t in _subgroup_case(10 * gi + i, dtype, causal, layout))
            o, lse = cpm.masked_attention(q, k, v, causal=causal)
            (o * w).sum().backward()
            want = [o.detach(), lse.detach(), q.grad, k.grad, v.grad]
            for rr in range(2):
                res, rank = results[2 * gi + rr][i], 2 * gi + rr
                where = (f"{name}: rank {rank} (rank {rr} of cp group {[2 * gi, 2 * gi + 1]}, "
                         f"12 tokens over 2 ranks)")
                for j, part in enumerate(("O", "lse", "dQ", "dK", "dV")):
                    with breaks("ex08.*.dtype"):
                        expect_equal(str(res[j].dtype), str(dtype), f"the dtype of {part}, {where}")
                    mine = cpm.shard_sequence(want[j], rr, 2, layout, dim=2)
                    tol = 1e-10 if dtype == torch.float64 else 5e-2
                    clause = ("ex08.*.group" if gi == 1 else "ex08.*.dtype" if dtype != torch.float64 else
                              "ex08.C.exact" if j < 2 else "ex08.D.second" if i else "ex08.D.exact")
                    with breaks(clause):       # group [2, 3] checked after [0, 1] passed the same case
                        expect_close(res[j].double(), mine, f"{part}, index (batch, head, position within the "
                                     "rank's shard, ...)", where=where, rtol=tol, atol=tol)


@observes("ex08.D.second")
def test_training_with_your_code(impl):
    """The GPT trained with ring attention on 2 ranks (zigzag) matches one process."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    batches = data.batches(data.synthetic_tokens(2000, 32), 2, 2, 16)
    want = reference.train_reference(GPT(cfg, seed=0), batches, reference.sgd(0.1))
    got = cpm.run(GPT(cfg, seed=0), batches, 2, optimizer=reference.sgd(0.1), variant="ring",
                  layout="zigzag", timeout=TIMEOUT)
    expect_same_training(got, want, "the GPT with ring attention on 2 ranks", rtol=1e-5, atol=1e-6)


SCORES = [[1000.0, 1000.0], [1000.0, 999.0], [5.0, 1000.0], [1000.0, 700.0], [-990.0, -1000.0]]


@observes("ex08.A.stable")
def test_merge_of_large_score_blocks_is_attention_over_both(impl):
    """Two one-key blocks whose scores are the integers SCORES (near 1000, apart by up to hundreds): each
    block's (o, lse) is exact in fp32, and their merge equals attention over both keys computed in float64
    (softmax and log-sum-exp of the scores), to ex08.A.stable's tolerance."""
    s = torch.tensor(SCORES)
    q = torch.zeros(1, 1, len(s), 4)
    q[..., :2] = 2 * s                                     # scores q·k / √4: exactly SCORES
    k = torch.zeros(1, 1, 2, 4)
    k[0, 0, 0, 0] = k[0, 0, 1, 1] = 1.0
    v = torch.randn(1, 1, 2, 4, generator=torch.Generator().manual_seed(3))
    a = cpm.attention_block(q, k[..., :1, :], v[..., :1, :])
    b = cpm.attention_block(q, k[..., 1:, :], v[..., 1:, :])
    want_o = torch.softmax(s.double(), -1) @ v[0, 0].double()
    want_lse = torch.logsumexp(s.double(), -1)
    o, lse = cpm.merge_partials(*a, *b)
    where = "keys 0 and 1 as two blocks, scores per query " + ", ".join(f"({x:g}, {y:g})" for x, y in SCORES)
    with diagnose(lambda e: not bool(torch.isfinite(lse).all() and torch.isfinite(o).all()),
                  "the merged lse or o holds inf or nan: an exp of a log-sum-exp near 1000 overflows fp32"):
        expect_close(lse[0, 0].double(), want_lse, "merged lse (the log-sum-exp of both scores), per query",
                     where=where, rtol=1e-5, atol=1e-5)
        expect_close(o[0, 0].double(), want_o, "merged o (attention over both keys, in float64), index (query, "
                     "feature)", where=where, rtol=1e-5, atol=1e-5)
