"""Exercise 09: dispatch and combine, the two all-to-alls of expert parallelism.

Under expert parallelism rank j of an ep group holds the j-th block of E/ep experts of an MoE
layer. Every rank routes its own tokens; each (token, expert) assignment travels to the rank
holding its expert, is computed there and comes back (notebook 09, "The layer" and "The two
all-to-alls"; GShard, Lepikhin et al. 2020, §2-3; DeepSpeed-MoE, Rajbhandari et al. 2022).
You write the whole exchange:

A. The counts the ranks agree on: ``count_tokens``, ``exchange_counts``, ``kept_counts``.
B. Where the rows go: ``split_sizes`` and ``permutation``.
C. The exchange: ``exchange`` and the autograd function ``AllToAll`` behind ``all_to_all``.
D. The layer: ``ExpertParallelMoE.__init__`` (which experts a rank holds) and
   ``ExpertParallelMoE.forward``, from the routed assignments to the output and the
   auxiliary losses: the order of its steps is yours to design.

Each function's docstring below is its contract: clauses ``ex09.P.word`` that must hold (the
grader names the clause a failure breaks). The last tests run the library's
``ExpertParallelMoE`` with your code in place, in float64, and compare it with the MoE layer on
one device. Stuck? ``minipar.hint("ex09", "A")`` (or "B", "C", "D") gives a nudge, then the
idea, then the steps. Grade it with ``python -m minipar.grade ex09``.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist

import minipar
from minipar.expert_parallel import (ExpertParallelMoE, all_to_all, count_tokens, exchange_counts, kept_counts,
                                     permutation, split_sizes)
from minipar.course import grading
from minipar.course.grading import breaks, diagnose, expect, expect_close, expect_equal, expect_recorded, observes
from minipar.runtime import trace
from minipar.models.moe import MoE

EXERCISE = "ex09_expert_parallel"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNolzEEKQjEMhOGrzM6NeIC38RKC69CX1wTbtCRR9PYW3c3HwH8TZ0Z0ag1TuXBsIIhGjurUzwuVU'
        'tjXsn3Jn2ZqFTmSGsaLHeuGkz3igrtokR9OAYrQap0tA2V0xqEeiWP4aoHfkz3/hUKTiubn+gVhGjOz',
        'sealed:eNo9jkFOw0AMRa/yd4DUjGDLEsQNukfTxM1Y7djR2CGNEHfHCSobW7be9/OxEAqb69hyhRANBhXCi'
        'QUTNdAtqoO+SLCUKKInHVb0RY3AnnCMCzV74xvYkAX5eu3G7CXSet6SbUXLcnkwfKDXWXxTIACMTecp4W3Fp'
        'MbOKocdRQs4m/EolTbe9f4JwzxHz2cPge9vhGZLGZ5Tat3LKxb2gn6uu6TNIiwjLOZBlz/zzt9luBBNhsryG'
        'KHPdsD7E7r/+Ttu/my79AvKU2mL',
        'sealed:eNpdjU1uwyAQha8y8gpLGDXbRCy77RUQJRMblQHET5z2Yt33ZMHYUqRuRjPve/NeCcks4tN6E6ovD'
        'B8RU1HhxoGsd+jnskivdjmPF8AIEkwgEnMKNapsf5D1tcFQS6ctKQuPq0KK5Zth/Pt9b7i/aefUrMuCiTU7P'
        '9wceobsk4PXhHLAqHY6cLha2oRhbxF3i2vL5TCdmvKFsZzBVHq1tyNXYm9bbSVhnKbISD+k0XGECdjmng73+'
        'I9zCOlAYEtGd4N1QQ+Ngc3wETyKJ1W0bgs=',
    ),
    'B': (
        'sealed:eNotjEEOgzAMBL+y4gF8gWM/gMQ5BZe4JTZyHAK/J6163FnNTJHnCDp3Ms/Y+CCowIJ88B7wMC07P'
        'BJm3UqSDH39ZxFHCm584nl9GdtP6zG2n+Ugy4SWTcWDc4sGybVBdDWSERZeYFrBWHXo+hts+DFB',
        'sealed:eNpNj8FOA0EMQ3/FN6hUlTsVBw58AdwQhzBrdqPuzkyTTBe+hA/ix5hFCHGzZSsvfmzLonkEJU2ws'
        'l45Hm5YkcrcluyoNAz00CyhJWPUCx2Scd1LX59g3WGRMH3Hs5dmifv//ZdbxKQOk3zqpzsA3a2TBDTgzIPvu'
        '/Jf3l9iTNxIB9xniI1eLLBqTPCQ15l3T9aIE1kdPDeZu/5waEaxgXbsVHZ3oTk3osCTRPQx5e0nq8V1e9AP3'
        '0vzXZk=',
        'sealed:eNpVTssKwjAQ/JU9phADXpX+hbdSJNalDc2L3U2hf29jxephnzM7sxnpTjbO0MKQShQ2hDzZjAqzh'
        'hqnc2O4BLXVKxBKoQj5c9XV1BtJ3rGoRh/ARcM/ZioWNhtJNEzG0siJRM24sgYW+/DY3qjgZuLigsT45WLIs'
        't69m1FVjYPR1bH/0bRx3DkmloC+fvTExQ3Yvpd735gXDWtWLg==',
    ),
    'C': (
        'sealed:eNpVi9ENgzAMBVd5A5SuUDEF31ZqsNXUjmIjGJ/wyddJp7vZQLVO6dMANEBo3P97UqobfEX3Y9jSP'
        'QKd7BdvLEJ5tymMHC6aB9/tY36B7ItDtAj4LEK2Mai1qhzQ/FyxrSyJ',
        'sealed:eNo1jV0OgjAQhK8yb2pCuIDGU/BulnahjfQn7ZaCp7dgfNlkNt/MNxhGKBKLYCzTxAmGMnJx18Rqv'
        'SGFmhEmbJcMSWQX62dkQ5FBXkPLHrnH0FZGUu9KScM2suVMjsGbMuRnPj+hnYRKe4dqxfyouFhBth9u1koxs'
        'r4jsWM3NrYRDtZDydadPn+MHj1e2QseR36+/ur+C/LKSfw=',
        'sealed:eNp1z01qwzAQBeCrPLJyUiHo1sVX6AVKMYoysU3lkdGP49y+msjNoqWb0SAx39PQZkfDA7XwOaHDp'
        'pluPc1Lujcxz00gux4VTpuOo1no47X9PL7B+nnWxrk++V6OOPHgqCmEKoL1nKYh+xybMiqCQiS+KAzB56V7V'
        'AU2M3VSCn9y5kwuFjpQyoHlNxpXH24mXFpEs9JfqBIKdRaeYdP2FGjfrNnU/6PPYI2zsV817TcwBFPmiq2rI'
        'F0Vpds9acXECw79j3WQBHnZUxTSSIx3zyTLgVYKd/hyGTDxUnb+Bjd9isc=',
    ),
    'D': (
        'sealed:eNotjMkNgDAMBFvZAqiADz/6sIghFsFGsVHaJxzPnRntbKVYgymD3GXTgzVGtCxLRiXdsdhxXsEOi'
        'QGiv7KauCJZ55EpvtSZe+Wo1nwAaULu32/0YvarBFbp4tlhOytoI9HpBkunMV8=',
        'sealed:eNpVk8Fu2zAMhl+FtzpAEOycHYsdt8t2G4aCsWhHiC0apFTHe7He+2QjpaRLb0ZE/vz5/cwzLtjHv'
        'EHPJWUFeiXZQDBdnhQyXyjpHjAFyGeqPyvMuMGZpwAhDgMJpQypzCcSBR68bj7CMwzCc22aMUu8VrWME7ANg'
        'At0iTP8eH+jZXfXj3qfi6pxTDO5ocxA14UkQzSPMwEO2RRceeLVvqqpJ+i+/z7655+Dlrn7stsd4Cdblxdea'
        'MmfRE/bXXSN+VxrgvCyUABOpDCh5j0o15chimZwVaUUdiC8KowMXMxTqvOBJZAc4Je7ws03JFqMR5o2iD5w4'
        'v7ieNpYY2oWTDwK8JpMJsSetAlU/XxGsywSX21jIRiFi9uzNuUifQvjKwjVl4rdH22OQb4t12nG00THx5a9l'
        '6YWbbNtAUhJQNif742cHlx37SYMTMv3f04fy1g9msK82CG1psx8rBqjYIh+I3MxinSNThbhLwm7pA0vKTTQt'
        '11iGo29oYYTmtJHQrpMLqgrelB7WIy/yygMLJ8ydIIPump30I4MQ4D1/e1bd90Zcz8tX7qysHWsrSWA5Rqni'
        'OI4Ve1leIntD3L7f9zo1Wtv0UD36dZ7nsqc/GjUNjR7XutNL6169QycqMEcLeN0+Adm6kSb',
        'sealed:eNplVMFu2zAM/RUiwAAJU931miC35ZgddzEMQ7GZWLBsGZKcpB32Xb33y0ZKTpZul0iiycfHRzJ1b'
        'UYT63oNOCnweuxhC40bhuLk3TzVwbyhSFepHu3sudg3sIMvFL6Gn9rOuPPe+Q1Y12hLWOR4QsHuH++7Z06SH'
        'l9fZH5TOKFE9OQ7OCzyYwN4ndDHQNa9a2eL300Txa8QvTBynTwXj9JUcHQeDJgxZ/0tC7ZctG/XxHkeE0y61'
        'NH1OAaRY2t3VLAjBnv6jtemY651jhD5UHArstETo+hJNya+in0R5kFIeH6GnkAU/x51E50n3x6nSM583OD2i'
        'mPTN5zSN5zqi4mdGes76COt5K/ggFQKbvflmmWrUtZvknACji11DJszoYXJUhe5WUFw1txKBUlfwhwUqXNGH'
        '5Cc+T1HHY0bxaVDj4LJKPgkCsVp780ZW4rQ1pJyNR3iWiYJyatknHLNhJiLrKoq81ELt6ScglEPuF1Rta0Jk'
        '45Nt1LQmoFNK8oymBEXrcq1yh2sNnB4rTMfkkA3/T+0dR4ri6NIAVIWHifUUVDFy5UmmybJoj6j4CRkDp2eU'
        'Dy9SC6PBi01NC6yi6abx16mYUrXAO54E6G886EWsNgZcumGLJljRRoH0yJErxtOd2Kqq2VOqWrvLmF7j2MOn'
        'Rvws77ESj309n8VaQkPBPFZRCpttrdySkZV8IbeBfHj472HJ7h3SUEnK1ku00BCv1JUcq2t6VFcZWHGFq+1b'
        'lvxTcGt2+qW4+MdLmhOXQwPgip44XKii9qmnV2UUUBi8pSDXpBSOX8d83YUjXUjCt4y/othOTy2c4MiOy4qb'
        'B8gHhTJ1ox0k6VNsuj5SjrwfqA9FvSqrQuBdsS6k+Hlnrw7hE+TnxPK4g+f+sVF',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT


@observes("ex09.A.count")
def test_count_tokens(impl):
    """count_tokens: assignments per expert, zeros for experts nobody chose, int64."""
    e = torch.tensor([3, 0, 3, 1, 3])
    expect_equal(count_tokens(e, 6).tolist(), [1, 1, 0, 3, 0, 0], "count_tokens([3, 0, 3, 1, 3], 6)", keys="expert")
    r = torch.randint(0, 8, (200,), generator=torch.Generator().manual_seed(0))
    expect_equal(count_tokens(r, 8).tolist(), [int((r == i).sum()) for i in range(8)],
                 "count_tokens of 200 random assignments to 8 experts", keys="expert")
    got = count_tokens(torch.zeros(0, dtype=torch.long), 3)
    expect_equal(got.tolist(), [0, 0, 0], "count_tokens of no assignments, 3 experts", keys="expert")
    expect_equal(str(got.dtype), "torch.int64", "the dtype of count_tokens' result")


@observes("ex09.A.capacity")
def test_kept_counts(impl):
    """kept_counts: the assignments kept per expert and rank under a capacity; None keeps everything."""
    M = torch.tensor([[3, 1, 0, 2], [2, 2, 1, 0], [1, 0, 4, 1]])
    expect_equal(kept_counts(M, None).tolist(), M.tolist(), "kept_counts(M, None) (no capacity: M itself)",
                 keys="(rank, expert)")
    want = {2: [[2, 1, 0, 2], [0, 1, 1, 0], [0, 0, 1, 0]], 3: [[3, 1, 0, 2], [0, 2, 1, 0], [0, 0, 2, 1]]}
    for cap, w in want.items():
        expect_equal(kept_counts(M, cap).tolist(), w, f"kept_counts(M = {M.tolist()}, cap = {cap}): assignments "
                     "each rank keeps per expert (the first cap, rank 0's before rank 1's)", keys="(rank, expert)")


@observes("ex09.B.pairs", "ex09.B.ints")
def test_split_sizes(impl):
    """split_sizes: rows sent to and received from every rank, as Python ints; send and recv agree."""
    M = torch.arange(32).reshape(4, 8)
    got = {r: split_sizes(M, r, 4) for r in range(4)}
    for r, (send, recv) in got.items():
        types = sorted({type(v).__name__ for v in list(send) + list(recv)})
        with breaks("ex09.B.ints"):
            expect(types == ["int"], f"rank {r}: the split sizes are of type {', '.join(types)}; expected Python ints")
    with breaks("ex09.B.pairs"):
        expect_equal({(a, b): got[a][0][b] for a in range(4) for b in range(4)},
                     {(a, b): got[b][1][a] for a in range(4) for b in range(4)},
                     "rank a's send[b] against rank b's recv[a], counts = arange(32).reshape(4, 8), ep = 4",
                     keys="(a, b)")
    for r, want in ((0, ([3, 7], [3, 11])), (1, ([11, 15], [7, 15]))):
        two = split_sizes(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), r, 2)
        with breaks("ex09.B.pairs"):
            with diagnose(lambda e, two=two: tuple(map(list, two))[::-1] == want,
                          "send equals the expected recv and recv the expected send"):
                expect_equal({"send": list(two[0]), "recv": list(two[1])}, {"send": want[0], "recv": want[1]},
                             f"split_sizes(counts = [[1, 2, 3, 4], [5, 6, 7, 8]], rank {r}, ep = 2)")
    for r, (send, recv) in got.items():
        with breaks("ex09.B.pairs"):
            expect_equal({"send": send, "recv": recv},
                         {"send": [int(M[r, 2 * j:2 * j + 2].sum()) for j in range(4)],
                          "recv": [int(M[j, 2 * r:2 * r + 2].sum()) for j in range(4)]},
                         f"split_sizes(counts = arange(32).reshape(4, 8), rank {r}, ep = 4): rows to and from each rank")


@observes("ex09.B.stable", "ex09.B.inverse")
def test_permutation_is_stable_with_inverse(impl):
    """permutation: keys[perm] sorted, equal keys in their original order, x[perm][inverse] == x."""
    keys = torch.tensor([2, 0, 3, 2, 1, 0, 2])
    perm, inv = permutation(keys)
    with breaks("ex09.B.stable"):
        with diagnose(lambda e: sorted(perm.tolist()) == list(range(7)) and keys[perm].tolist() == sorted(keys.tolist()),
                      "keys[perm] is sorted, and rows of equal keys are in another order than the input's"):
            expect_equal(perm.tolist(), [1, 5, 4, 0, 3, 6, 2], "perm for keys [2, 0, 3, 2, 1, 0, 2]", keys="position")
    with breaks("ex09.B.inverse"):
        expect_equal(inv.tolist(), [3, 0, 6, 4, 2, 1, 5], "inverse for keys [2, 0, 3, 2, 1, 0, 2] "
                     "(x[perm][inverse] == x for every x)", keys="position")
    k = torch.randint(0, 4, (300,), generator=torch.Generator().manual_seed(1))
    perm, inv = permutation(k)
    s = k[perm]
    with breaks("ex09.B.stable"):
        expect_close(s, torch.sort(k, stable=True).values, "keys[perm] for 300 random keys (sorted)", rtol=0, atol=0)
    for i in range(4):                                  # stable: positions ascending per key
        p = perm[s == i]
        with breaks("ex09.B.stable"):
            expect_equal(p.tolist(), sorted(p.tolist()), f"positions of key {i} in perm (ascending: equal keys in their original order)",
                         keys="entry")
    x = torch.randn(300)
    with breaks("ex09.B.inverse"):
        expect_close(x[perm][inv], x, "x[perm][inverse] (x itself)", rtol=0, atol=0)


# ----------------------------------------------------------------------------- on ranks
def _split(a, b, case):
    """Rows group rank a sends group rank b in exchange case ``case`` (some are 0)."""
    return (a + 2 * b + case) % 3


EXCHANGES = [  # (name, dtype, on subgroups): run in turn on 4 ranks
    ("float64, the world of 4 ranks", torch.float64, False),
    ("bfloat16, two groups of 2 ([0, 1] and [2, 3])", torch.bfloat16, True),
    ("float32, the world of 4 ranks, other split sizes (a second exchange)", torch.float32, False),
]


def _rows(a, b, n, dtype):
    """The rows group rank a sends group rank b: 16a + 4b + i, exact in bfloat16."""
    return torch.tensor([[16.0 * a + 4 * b + i, -1.0] for i in range(n)], dtype=dtype).reshape(n, 2)


def _sent(since):
    """Bytes sent in the communication recorded since event ``since``."""
    return sum(e["bytes_sent"] for e in trace.events()[since:] if e["kind"] == "comm")


def _names(since):
    """(name, dim label) of the communication recorded since event ``since``."""
    return [(e["name"], e["labels"].get("dim")) for e in trace.events()[since:] if e["kind"] == "comm"]


def _exchanges():
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]          # every rank creates both
    rank, dev = dist.get_rank(), minipar.device()
    counts = torch.tensor([rank, 2 * rank, 0, 7 - rank, 1, 5], device=dev)
    since = len(trace.events())
    out = {"counts": [exchange_counts(counts, None).cpu(), exchange_counts(counts, groups[rank // 2]).cpu()],
           "counts sent": _sent(since)}
    for case, (_, dtype, sub) in enumerate(EXCHANGES):
        group, n, r = (groups[rank // 2], 2, rank % 2) if sub else (None, 4, rank)
        send, recv = [_split(r, b, case) for b in range(n)], [_split(a, r, case) for a in range(n)]
        x = torch.cat([_rows(r, b, send[b], dtype) for b in range(n)]).to(dev).requires_grad_()
        try:                    # an error every rank raises alike is reported with its case
            since = len(trace.events())
            y = all_to_all(x, recv, send, group, name="graded_a2a", dim="ep")
            forward, names, since = _sent(since), _names(since), len(trace.events())
            (y * (0.5 * y.detach() + r)).sum().backward()              # ∂/∂row = 0.5·row + its receiver
            out[case] = (y.detach().cpu(), x.grad.cpu(), forward, _sent(since), names + _names(since))
        except Exception as e:  # noqa: BLE001
            out[case] = f"{type(e).__name__}: {e}"
    return out


@observes("ex09.A.exchange", "ex09.C.order", "ex09.C.empty", "ex09.C.dtype", "ex09.C.backward", "ex09.C.named",
          "ex09.*.group", "ex09.*.recorded")
def test_exchanges_on_ranks(impl):
    """On 4 ranks: exchange_counts on the world and on two groups of 2; all_to_all with uneven (some
    empty) splits in float64, bfloat16 on the groups and float32, forward and backward."""
    res = minipar.launch(_exchanges, 4, timeout=TIMEOUT)
    counts = [[rank, 2 * rank, 0, 7 - rank, 1, 5] for rank in range(4)]
    for rank, out in enumerate(res):
        with breaks("ex09.A.exchange"):
            expect_equal(out["counts"][0].tolist(), counts, f"rank {rank}: exchange_counts on the world of 4 ranks",
                         keys="(rank, expert)")
        g = rank // 2
        with breaks("ex09.*.group"):
            expect_equal(out["counts"][1].tolist(), counts[2 * g:2 * g + 2],
                         f"rank {rank}: exchange_counts on the group [{2 * g}, {2 * g + 1}]", keys="(group rank, expert)")
        with breaks("ex09.*.recorded"):
            expect_recorded(out["counts sent"], (3 + 1) * 6 * 8, "bytes exchange_counts sent, as recorded (its 6 "
                            "int64 counts to each other rank: 3 on the world, 1 in its group)", f"rank {rank}")
    for case, (name, dtype, sub) in enumerate(EXCHANGES):
        for rank, out in enumerate(res):
            n, r = (2, rank % 2) if sub else (4, rank)
            where = f"{name}: rank {rank}" + (f" (rank {r} of its group)" if sub else "")
            on = ("ex09.*.group",) if sub else ()                     # a group's case fails its own clause too
            with breaks("ex09.C.empty", *on):
                expect(not isinstance(out[case], str), f"{where}: all_to_all raised {out[case]} (sending "
                       f"{[_split(r, b, case) for b in range(n)]} rows, receiving {[_split(a, r, case) for a in range(n)]})")
            y, grad, forward, backward, names = out[case]
            with breaks("ex09.C.dtype"):
                expect_equal(str(y.dtype), str(dtype), f"the dtype of all_to_all's output, {where}")
            # then what was recorded (its bytes per row: this dtype's): an exchange never waited on shows
            # here, before its values
            size = 2 * torch.finfo(dtype).bits // 8                    # bytes per row of 2 elements
            with breaks("ex09.*.recorded"):
                expect_recorded(forward, size * sum(_split(r, b, case) for b in range(n) if b != r), "bytes all_to_all "
                                "sent forward, as recorded (the rows for the other ranks)", where)
                expect_recorded(backward, size * sum(_split(a, r, case) for a in range(n) if a != r), "bytes sent in "
                                "its backward, as recorded (the gradients of the rows that came from the other ranks)",
                                where)
            want = torch.cat([_rows(a, r, _split(a, r, case), torch.float64) for a in range(n)])
            with breaks("ex09.C.order", *on):
                expect_close(y.double(), want, "all_to_all's output rows (16·source + 4·this rank + i, in rank "
                             f"order; received from each rank: {[_split(a, r, case) for a in range(n)]})",
                             where=where, rtol=0, atol=0)
            x = torch.cat([_rows(r, b, _split(r, b, case), torch.float64) for b in range(n)])
            dest = torch.cat([torch.full((_split(r, b, case), 2), float(b), dtype=torch.float64) for b in range(n)])
            with breaks("ex09.C.dtype"):
                expect_equal(str(grad.dtype), str(dtype), f"the dtype of the input's gradient, {where}")
            with breaks("ex09.C.backward", *on):
                expect_close(grad.double(), 0.5 * x + dest, "the input's gradient (0.5·row + the rank it went to; sent "
                             f"to each rank: {[_split(r, b, case) for b in range(n)]})", where=where, rtol=0, atol=0)
            with breaks("ex09.C.named"):
                expect_equal(names, [("graded_a2a", "ep"), ("graded_a2a_backward", "ep")], f"{where}: (name, dim) of "
                             "what all_to_all(..., name='graded_a2a', dim='ep') recorded, forward then backward",
                             keys="collective")


def _moe(k, cf):
    torch.manual_seed(0)
    return MoE(8, 4, k, cf, hidden=16).double()


def _tokens(step, seed=1):
    return torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(seed + 10 * step)).double()


def _grads(layer, x):
    def cpu(g):                          # None: no gradient reached it (the test says so)
        return None if g is None else g.cpu()
    return {"input": cpu(x.grad), "router": cpu(layer.router.weight.grad),
            **{f"expert {i}": None if any(p.grad is None for p in e.parameters())
               else torch.cat([p.grad.reshape(-1) for p in e.parameters()]).cpu() for i, e in layer.experts.items()}}


def _weights(y):
    return torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)


LAYERS = [(2, None), (1, 1.0), (2, 1.0)]
UNEVEN = (2, 1.0, (3, 5))  # top-2, capacity factor 1, ranks holding 3 and 5 sequences: one device's 8
# top-1 dropless on the first 2 sequences of _tokens(0, seed): experts no token chooses
IDLE = [(1, None, 2, "expert 3"),                   # rank 1's second; the other three get 2, 4 and 2
        (1, None, 1505, "experts 2 and 3 (rank 1's: its experts compute no row)")]   # 3, 5, 0, 0
RECORDED_FORWARD = [("ep_counts", "all_gather"), ("ep_dispatch", "all_to_all"), ("ep_combine", "all_to_all")]
RECORDED_BACKWARD = [("ep_combine_backward", "all_to_all"), ("ep_dispatch_backward", "all_to_all")]  # ex09.D.recorded


def _on(events, ranks):
    """RECORDED_* as recorded on the ep group of global ranks ``ranks``: (name, op, dim label, group)."""
    return [(name, op, "ep", list(ranks)) for name, op in events]


@contextmanager
def _agreed_splits():
    """Inside, every all-to-all first checks that its ranks agree on the rows (rank a's send[b] is
    rank b's recv[a]): a disagreement would abort the ranks' processes, so it is a ValueError on
    every rank instead. The check's own all-gather goes around minipar.comm: nothing is recorded."""
    real = dist.all_to_all_single

    def checked(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        n = dist.get_world_size(group)
        sizes = [list(s) if s is not None else [t.shape[0] // n] * n
                 for s, t in ((input_split_sizes, input), (output_split_sizes, output))]
        mine = torch.tensor(sizes, device=input.device)
        every = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(every, mine, group=group)
        send, recv = torch.stack([e[0] for e in every]).cpu(), torch.stack([e[1] for e in every]).cpu()
        if not torch.equal(send, recv.T):
            raise ValueError(f"the ranks disagree on an all-to-all's rows: rank a sends rank b {send.tolist()} "
                             f"(row a), rank b expects from rank a {recv.T.tolist()} (row a)")
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
    dist.all_to_all_single = checked
    try:
        yield
    finally:
        dist.all_to_all_single = real


def _ep_layer(steps):
    r, n, dev = dist.get_rank(), dist.get_world_size(), minipar.device()
    out = []
    for k, cf in LAYERS:
        layer = ExpertParallelMoE(_moe(k, cf).to(dev))
        for step in range(steps):
            layer.zero_grad()
            x = _tokens(step).chunk(n)[r].to(dev).requires_grad_()
            y = layer(x)
            (y * _weights(_tokens(step)).chunk(n)[r].to(dev)).sum().backward()
            out.append((y.detach().cpu(), layer.stats["dropped"].cpu(), _grads(layer, x), layer.stats["aux"].cpu(),
                        _forward_record(layer, x.detach())))
    k, cf, shards = UNEVEN                                             # rank 0 holds fewer tokens than rank 1
    layer = ExpertParallelMoE(_moe(k, cf).to(dev))
    x = _tokens(0).split(shards)[r].to(dev).requires_grad_()
    try:                    # the ranks may disagree on the split sizes: reported with the case
        with _agreed_splits():
            y = layer(x)
            (y * _weights(_tokens(0)).split(shards)[r].to(dev)).sum().backward()
        out.append((y.detach().cpu(), layer.stats["dropped"].cpu(), _grads(layer, x), layer.stats["aux"].cpu()))
    except Exception as e:  # noqa: BLE001
        out.append(f"{type(e).__name__}: {e}")
    for k, cf, seed, _ in IDLE:                                         # experts no token chooses
        layer = ExpertParallelMoE(_moe(k, cf).to(dev))
        every = _tokens(0, seed=seed)[:2]
        x = every.chunk(n)[r].to(dev).requires_grad_()
        try:
            with _agreed_splits():
                y = layer(x)
                (y * _weights(every).chunk(n)[r].to(dev)).sum().backward()
            out.append((y.detach().cpu(), _grads(layer, x)))
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return out


def _comm(since):
    """(name, op, dim label, group: its global ranks) of every collective recorded since event ``since``."""
    return [(e["name"], e.get("op"), e["labels"].get("dim"), e.get("group")) for e in trace.events()[since:]
            if e["kind"] == "comm"]


def _forward_record(layer, x):
    """What one more forward and backward of ``layer`` record: every collective (name, dim) of
    each, and the rows label of each "experts" region of the forward."""
    layer.zero_grad()                    # the step's gradients, already read, stay as they were
    x = x.detach().requires_grad_()
    since = len(trace.events())
    y = layer(x)
    events = trace.events()[since:]
    forward, since = _comm(since), len(trace.events())
    y.sum().backward()
    layer.zero_grad()
    regions = [e for e in events if e["name"] == "experts"]
    return {"forward": forward, "backward": _comm(since),
            "experts regions (rows)": [e["labels"].get("rows") for e in regions],
            "collectives inside an 'experts' region": [e["name"] for e in events if e["kind"] == "comm" and any(
                r["start"] <= e["start"] and e["end"] <= r["end"] for r in regions)]}


def _rows_computed(k, cf, step, rank, ep=2):
    """Assignments the experts of ``rank`` compute on one device's routing (the kept ones)."""
    moe = _moe(k, cf)
    with torch.no_grad():
        moe(_tokens(step))
    experts, kept = moe.stats["experts"].reshape(-1), ~moe.stats["dropped"].reshape(-1)
    per = moe.n_experts // ep
    return int(((experts // per == rank) & kept).sum())


def _single(k, cf, step, x=None):
    moe = _moe(k, cf)
    x = (_tokens(step) if x is None else x).clone().requires_grad_()
    y = moe(x)
    (y * _weights(x)).sum().backward()
    return y.detach(), moe.stats["dropped"], moe.stats["aux"], {"input": x.grad, "router": moe.router.weight.grad,
                                              **{f"expert {i}": torch.cat([p.grad.reshape(-1) for p in e.parameters()])
                                                 for i, e in enumerate(moe.experts)}}


@observes("ex09.D.exact", "ex09.D.grads", "ex09.D.second", "ex09.D.aux", "ex09.D.recorded")
def test_expert_parallel_layer(impl):
    """The expert-parallel MoE layer on 2 ranks equals one device, in float64: outputs, dropped
    assignments and gradients, for top-2 dropless, top-1 and top-2 at capacity factor 1, two steps each,
    top-2 at capacity factor 1 with the ranks holding 12 and 20 tokens, and top-1 dropless on 8
    tokens none of which chooses expert 3."""
    steps = 2
    res = minipar.launch(_ep_layer, 2, args=(steps,), timeout=TIMEOUT)
    for c, (k, cf) in enumerate(LAYERS):
        for step in range(steps):
            y, dropped, aux, grads = _single(k, cf, step)
            case = f"top-{k}, capacity factor {cf}, step {step + 1} of {steps}" + (" (other tokens)" if step else "")
            ranks = [res[r][c * steps + step] for r in range(2)]
            for r, (y_r, dropped_r, _, _, record) in enumerate(ranks):
                where = f"{case}, rank {r}"
                with breaks("ex09.D.second" if step else "ex09.D.exact"):
                    expect_close(dropped_r.float(), dropped.chunk(2)[r].float(), "assignments dropped (over capacity), "
                                 "index (token·k + j)", where=where, rtol=0, atol=0)
                    expect_close(y_r, y.chunk(2)[r], "layer output (the MoE layer on one device), index "
                                 "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
                with breaks("ex09.D.grads"):
                    for name, g in ranks[r][2].items():
                        expect(g is not None, f"{where}: {name} got no gradient (None) from the layer's backward")
                    expect_close(ranks[r][2]["input"], grads["input"].chunk(2)[r], "the input's gradient, index "
                                 "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
                    _expect_expert_grads(ranks[r][2], grads, where)
                with breaks("ex09.D.recorded"):
                    expect_equal(record, {"forward": _on(RECORDED_FORWARD, [0, 1]),
                                          "backward": _on(RECORDED_BACKWARD, [0, 1]),
                                          "experts regions (rows)": [_rows_computed(k, cf, step, r)],
                                          "collectives inside an 'experts' region": []},
                                 f"{where}: what the layer recorded: (name, op, dim label, global ranks of its "
                                 "group) of every collective of one "
                                 "forward and of its backward, the rows label of its 'experts' regions and the "
                                 "collectives that ran inside one")
            with breaks("ex09.D.aux"):
                expect_close((ranks[0][3] + ranks[1][3]) / 2, aux, "the load-balancing loss (aux) averaged over the "
                             "2 ranks", where=case, rtol=1e-6, atol=1e-7)
            with breaks("ex09.D.grads"):
                expect_close(ranks[0][2]["router"] + ranks[1][2]["router"], grads["router"],
                             "the router's gradient summed over the 2 ranks, index (expert, feature)", where=case,
                             rtol=1e-5, atol=1e-7)
    _uneven([res[r][len(LAYERS) * steps] for r in range(2)])
    for i, idle in enumerate(IDLE):
        _idle(idle, [res[r][len(LAYERS) * steps + 1 + i] for r in range(2)])


def _idle(idle, ranks):
    """The layer where no token chooses some experts (a case of IDLE) against one device on the same tokens."""
    k, cf, seed, which = idle
    every = _tokens(0, seed=seed)[:2]
    y, _, _, grads = _single(k, cf, 0, x=every)
    case = f"top-{k}, capacity factor {cf}, 8 tokens of which none chooses {which}"
    for r, got in enumerate(ranks):
        where = f"{case}, rank {r}"
        with breaks("ex09.D.exact"):
            expect(not isinstance(got, str), f"{where}: the layer raised {got}")
            expect_close(got[0], y.chunk(2)[r], "layer output (the MoE layer on one device), index "
                         "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
        with breaks("ex09.D.grads"):
            _expect_expert_grads(got[1], grads, where)


def _expect_expert_grads(got: dict, grads: dict, where: str) -> None:
    """Each expert's gradient of this rank (``_grads``) against one device's (``_single``): there, not
    None, and equal."""
    for name, g in got.items():
        if name.startswith("expert"):
            expect(g is not None, f"{where}: {name} got no gradient (None) from the layer's backward; "
                                  f"on one device its gradient is {'zero' if not grads[name].any() else 'not zero'}")
            expect_close(g, grads[name], f"{name}'s gradient (its parameters flattened)", where=where,
                         rtol=1e-8, atol=1e-10)


def _uneven(ranks):
    """The layer on ranks holding different numbers of tokens (UNEVEN) against one device on all of them."""
    k, cf, shards = UNEVEN
    y, dropped, aux, grads = _single(k, cf, 0)
    tokens = [4 * n for n in shards]                                   # 4 positions per sequence
    case = (f"top-{k}, capacity factor {cf}, rank 0 holding {tokens[0]} tokens and rank 1 {tokens[1]} "
            f"(one device: all {sum(tokens)})")
    for r, got in enumerate(ranks):
        where = f"{case}, rank {r}"
        with breaks("ex09.D.exact"):
            expect(not isinstance(got, str), f"{where}: the layer raised {got}")
            expect_close(got[1].float(), dropped.split([n * k for n in tokens])[r].float(), "assignments dropped "
                         "(over capacity), index (token·k + j)", where=where, rtol=0, atol=0)
            expect_close(got[0], y.split(shards)[r], "layer output (the MoE layer on one device), index "
                         "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
        with breaks("ex09.D.grads"):
            expect_close(got[2]["input"], grads["input"].split(shards)[r], "the input's gradient, index "
                         "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
            _expect_expert_grads(got[2], grads, where)
    with breaks("ex09.D.grads"):
        expect_close(ranks[0][2]["router"] + ranks[1][2]["router"], grads["router"], "the router's gradient summed "
                     "over the 2 ranks, index (expert, feature)", where=case, rtol=1e-5, atol=1e-7)
    with breaks("ex09.D.aux"):
        expect_close((tokens[0] * ranks[0][3] + tokens[1] * ranks[1][3]) / sum(tokens), aux, "the load-balancing "
                     "loss (aux) averaged over the 2 ranks, each weighted by its tokens", where=case, rtol=1e-6,
                     atol=1e-7)


def _on_subgroups():
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]        # token groups that are not the world
    g, r, dev = dist.get_rank() // 2, dist.get_rank() % 2, minipar.device()
    try:
        ExpertParallelMoE(MoE(8, 6, 2), group=groups[g])              # 6 experts over 2 ranks: fine
        ExpertParallelMoE(MoE(8, 6, 2))                               # over the world of 4: refused
        refused = None
    except ValueError as e:
        refused = str(e)
    moe = _moe(2, 1.0).to(dev)
    layer = ExpertParallelMoE(moe, group=groups[g], token_group=dist.group.WORLD)
    held = {f"router.{n}": q for n, q in moe.router.named_parameters()}
    held.update({f"experts.{i}.{n}": q for i in layer.local for n, q in moe.experts[i].named_parameters()})
    own = [id(q) for q in layer.parameters()]
    copied = [n for n, q in held.items() if id(q) not in own]       # moe's parameters the layer does not hold
    since = len(trace.events())
    y = layer(_tokens(0, seed=5 + g).chunk(2)[r].to(dev))
    recorded = _comm(since)
    other = ExpertParallelMoE(_moe(2, 1.0).to(dev), group=groups[g], token_group=across[r])
    other(_tokens(0, seed=5 + g).chunk(2)[r].to(dev))
    return (y.detach().cpu(), layer.stats["dropped"].cpu(), layer.stats["matrix"].cpu(), refused,
            {int(i): float(e.fc.weight.detach().sum()) for i, e in layer.experts.items()}, layer.local,
            layer.stats["aux"].cpu(), recorded, copied, other.stats["aux"].cpu())


@observes("ex09.D.exact", "ex09.D.experts", "ex09.D.divide", "ex09.D.aux", "ex09.D.token_group", "ex09.*.group",
          "ex09.D.recorded")
def test_layer_on_subgroups(impl):
    """4 ranks in two ep groups of 2 ([0, 1] and [2, 3]), each with its own tokens: every group's
    layer equals one device on that group's tokens (top-2, capacity factor 1); its experts are the
    group rank's block; the aux loss (token_group: all 4 ranks, then [0, 2] and [1, 3]) averages
    to one device's on that token group's tokens; 6 experts over 4 ranks are refused."""
    res = minipar.launch(_on_subgroups, 4, timeout=TIMEOUT)
    fc = {i: float(e.fc.weight.detach().sum()) for i, e in enumerate(_moe(2, 1.0).experts)}
    for rank, out in enumerate(res):
        with breaks("ex09.D.divide"):
            expect(isinstance(out[3], str), f"rank {rank}: ExpertParallelMoE(MoE(8, n_experts=6)) over the world of 4 "
                                            "ranks was built; 6 experts over 4 ranks: a ValueError")
        want = [2 * (rank % 2), 2 * (rank % 2) + 1]
        with breaks("ex09.D.experts"):
            expect_equal({"local": list(out[5]), "experts": out[4]}, {"local": want, "experts": {i: fc[i] for i in want}},
                         f"rank {rank} (rank {rank % 2} of ep group [{rank // 2 * 2}, {rank // 2 * 2 + 1}]): the experts "
                         "it holds, of 4 (self.local, and self.experts by index: the sum of each one's fc weight)")
            expect_equal(out[8], [], f"rank {rank}: parameters of the given MoE's router and of this rank's experts that "
                         "are not the layer's own parameters (the layer holds them, not copies)")
    one = _moe(2, 1.0)
    one(torch.cat([_tokens(0, seed=5), _tokens(0, seed=6)]))
    with breaks("ex09.D.token_group"):
        expect_close(sum(out[6] for out in res) / 4, one.stats["aux"], "the load-balancing loss (aux) averaged over "
                     "the 4 ranks (token_group: all of them), against one device on all 32 sequences", rtol=1e-6,
                     atol=1e-7)
    for r in (0, 1):                     # token groups [0, 2] and [1, 3], across the ep groups
        one = _moe(2, 1.0)
        one(torch.cat([_tokens(0, seed=5).chunk(2)[r], _tokens(0, seed=6).chunk(2)[r]]))
        with breaks("ex09.D.token_group"):
            expect_close((res[r][9] + res[2 + r][9]) / 2, one.stats["aux"], f"the load-balancing loss (aux) averaged "
                         f"over the token group [{r}, {r + 2}] (ep groups [0, 1] and [2, 3]), against one device on "
                         "that group's 8 sequences", rtol=1e-6, atol=1e-7)
    for rank, out in enumerate(res):
        with breaks("ex09.D.recorded"):
            mine = [2 * (rank // 2), 2 * (rank // 2) + 1]
            got = [(name, op, "ep" if dim == "ep" else "not ep", group) for name, op, dim, group in out[7]]
            expect_equal({"on the ep group": [c for c in got if c[3] == mine],
                          "elsewhere": [c for c in got if c[3] != mine]},
                         {"on the ep group": _on(RECORDED_FORWARD, mine),
                          "elsewhere": [("ep_token_counts", "all_reduce", "not ep", [0, 1, 2, 3])]},
                         f"rank {rank}: what the layer's forward recorded with a token_group (all 4 ranks): (name, op, "
                         "whether its dim label is 'ep', global ranks of its group) of every collective, those on its ep "
                         f"group {mine} and elsewhere")
    for g in range(2):
        x = _tokens(0, seed=5 + g)
        moe = _moe(2, 1.0)
        y = moe(x).detach()
        for r in range(2):
            rank = 2 * g + r
            y_r, dropped_r, M = res[rank][:3]
            where = f"rank {rank} (rank {r} of ep group [{2 * g}, {2 * g + 1}], its own 16 tokens)"
            with breaks("ex09.*.group"):
                expect_equal(list(M.shape), [2, 4], f"the shape of the count matrix (ep × E), {where}")
                expect_close(dropped_r.float(), moe.stats["dropped"].chunk(2)[r].float(),
                             "assignments dropped (over capacity), index (token·k + j)", where=where, rtol=0, atol=0)
                expect_close(y_r, y.chunk(2)[r], "layer output (the MoE layer on one device), index "
                             "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
