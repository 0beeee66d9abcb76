"""Exercise 01: the ring all-reduce, from point-to-point messages.

Contract. ``ring_all_reduce(tensor, group=None, op="sum")`` sums (``op="avg"``: averages)
``tensor`` over the n ranks of ``group``, in place, and returns that same tensor; any shape,
any size (also one that n does not divide, or smaller than n). Its two halves work on the
same list of n chunks of the flattened tensor (``tensor_split(n)``):

* ``_reduce_scatter_chunks(chunks, group, name)``: afterwards chunk r on rank r holds the
  sum of chunk r over all ranks (the other chunks hold partial sums);
* ``_all_gather_chunks(chunks, group, name)``: starting from that state, afterwards every
  rank holds every chunk's full sum.

Every rank talks only to its two ring neighbours, each step sends one chunk and receives
one (``minipar.comm.exchange``, so the bytes are recorded), and each half takes n-1 steps.
The invariant that makes it work, and the picture of the steps for n = 4, are in notebook
01, "All-reduce around a ring"; the resulting cost is that every rank sends 2(n-1)/n of the
tensor, whatever n (Patarasuk & Yuan 2009; ``minipar.analysis.cost.collective_bytes``).

Graded against Gloo's all-reduce on 2 to 4 ranks, and on the bytes each rank sends.
Grade it with ``python -m minipar.grade ex01``; stuck? ``minipar.hint("ex01")``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import comm
from minipar.analysis import cost
from minipar.course.grading import diagnose, expect, expect_close, expect_contributions, expect_equal

EXERCISE = "ex01_collectives"
HINTS = {
    '': (
        "Work out one rank's view for n = 3 on paper: which chunk must it send at step 0 so that,"
        ' n-1 steps later, chunk r is complete on rank r? Then ask which chunk it sends next.',
        'Reduce-scatter: at every step send the chunk you have just added into (it holds the most'
        ' contributions) and add what arrives from the left into the chunk it belongs to. '
        'All-gather: at every step forward the complete chunk you received last; start from the '
        'one you completed.',
        'At step s, rank r: reduce-scatter sends chunk (r-s-1) % n to the right and adds the '
        'chunk (r-s-2) % n from the left; all-gather sends chunk (r-s) % n and overwrites chunk '
        '(r-s-1) % n. ring_all_reduce: flat view, chunks = flat.tensor_split(n), both halves, '
        "divide once for 'avg', copy back into tensor if the flat view was a copy.",
    ),
}
TIMEOUT = 30


def _contributions(numel):
    """Rank r contributes 2^r + 2^n·i at position i: every element of the result says which
    ranks' data it holds (notebook 01's 2^r trick) and from which positions. Reduce-scatter
    alone, then the whole all-reduce."""
    r, n = dist.get_rank(), dist.get_world_size()
    mine = 2.0 ** r + 2.0 ** n * torch.arange(numel, dtype=torch.float32)
    scattered = comm.ring_reduce_scatter(mine.clone())
    x = mine.clone()
    comm.ring_all_reduce(x)
    return scattered, x


def _all_reduce_cases(shapes, op):
    """On each rank: the 2^r contributions, then random tensors reduced with the function
    under test and with Gloo."""
    r = dist.get_rank()
    out = []
    for i, shape in enumerate(shapes):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(100 * r + i))
        want = x.clone()
        dist.all_reduce(want)
        if op == "avg":
            want /= dist.get_world_size()
        got = x.clone()
        ret = comm.ring_all_reduce(got, op=op)
        out.append((got, want, ret is got or (ret is not None and ret.data_ptr() == got.data_ptr())))
    return _contributions(max(torch.Size(s).numel() for s in shapes)) if op == "sum" else None, out


def _chunk_ranges(numel, n):
    bounds = [0]
    for c in torch.arange(numel).tensor_split(n):
        bounds.append(bounds[-1] + c.numel())
    return list(zip(bounds[:-1], bounds[1:]))


def _assert_contributions(contrib, n):
    """Which ranks' data each chunk holds, after the reduce-scatter half and after the whole."""
    for rank, (scattered, reduced) in enumerate(contrib):
        ranges = _chunk_ranges(reduced.numel(), n)
        lo, hi = ranges[rank]
        expect_equal(scattered.numel(), hi - lo, f"rank {rank}: elements of its reduce-scatter chunk {rank}")
        expect_contributions(scattered, n, range(n), f"rank {rank}, after the reduce-scatter: its chunk {rank} "
                             f"(elements {lo}..{hi - 1})", positions=torch.arange(lo, hi))
        for c, (lo, hi) in enumerate(ranges):
            if hi > lo:
                expect_contributions(reduced[lo:hi], n, range(n), f"rank {rank}, after the all-reduce: chunk {c} "
                                     f"(elements {lo}..{hi - 1})", positions=torch.arange(lo, hi))


def _assert_cases(results, op="sum"):
    n = len(results)
    if op == "sum":
        _assert_contributions([contrib for contrib, _ in results], n)
    for rank, (_, cases) in enumerate(results):
        for got, want, in_place in cases:
            expect_close(got, want, "the reduced tensor (compared with Gloo's all-reduce)",
                         where=f"rank {rank}, shape {tuple(want.shape)}", rtol=1e-5, atol=1e-5)


def test_sum_two_ranks(impl):
    """Sums over 2 ranks for several sizes."""
    _assert_cases(minipar.launch(_all_reduce_cases, 2, args=([(8,), (1000,)], "sum"),
                                 timeout=TIMEOUT))


def test_sum_uneven_sizes(impl):
    """Sums over 3 ranks when the size is not divisible by 3 (and smaller than 3)."""
    _assert_cases(minipar.launch(_all_reduce_cases, 3,
                                 args=([(10,), (2,), (7, 5)], "sum"), timeout=TIMEOUT))


def test_average_four_ranks(impl):
    """op="avg" divides the sum by the number of ranks (4 here)."""
    results = minipar.launch(_all_reduce_cases, 4, args=([(64,), (3, 9)], "avg"), timeout=TIMEOUT)
    for rank, (_, cases) in enumerate(results):
        for got, want, _ in cases:
            with diagnose(lambda f, got=got, want=want: torch.allclose(got, want * 4, rtol=1e-5, atol=1e-5),
                          "your result is the sum: op=\"avg\" divides it by the number of ranks"):
                expect_close(got, want, "the averaged tensor (compared with Gloo's)",
                             where=f"rank {rank}, shape {tuple(want.shape)}", rtol=1e-5, atol=1e-5)


def test_in_place_and_returned(impl):
    """The input tensor itself holds the result (shape kept) and is returned."""
    for rank, (_, cases) in enumerate(minipar.launch(_all_reduce_cases, 2, args=([(4, 6)], "sum"),
                                                     timeout=TIMEOUT)):
        for got, want, in_place in cases:
            expect_equal(tuple(got.shape), tuple(want.shape), f"rank {rank}: shape of the tensor after the call")
            expect(in_place, f"rank {rank}: ring_all_reduce must return the tensor it was given, reduced in "
                             "place (it returned another tensor, or None)")
            expect_close(got, want, "the tensor given to ring_all_reduce, after the call",
                         where=f"rank {rank}", rtol=1e-5, atol=1e-5)


def _bytes_run(numel):
    from minipar.runtime import trace
    x = torch.ones(numel)
    trace.start(dist.get_rank())  # count only the all-reduce
    comm.ring_all_reduce(x)
    return sum(e["bytes_sent"] for e in trace.events()), x[0].item()


def test_bytes_match_cost_model(impl):
    """Each rank sends exactly 2(n-1)/n of the tensor's bytes (4 ranks, 4096 floats)."""
    n, numel = 4, 4096
    results = minipar.launch(_bytes_run, n, args=(numel,), timeout=TIMEOUT)
    expected = int(cost.collective_bytes("all_reduce", numel * 4, n))
    sent, values = [s for s, _ in results], [v for _, v in results]
    with diagnose(sent == [expected] * n, "the bytes are right, so each step moves one chunk: check which "
                                          "chunk each step adds into, and that every chunk is gathered"):
        expect_equal(values, [float(n)] * n, f"x[0] after all-reducing ones over {n} ranks, per rank", keys="rank")
    with diagnose(lambda f: any(s > expected for s in sent), "more than the ring's bytes: send one chunk per "
                                                             "step (a slice of tensor_split(n)), never the whole tensor"):
        with diagnose(lambda f: any(s < expected for s in sent), "fewer than the ring's bytes: every step sends "
                                                                 "a chunk, 2(n-1) steps in all, through comm.exchange"):
            expect_equal(sent, [expected] * n, f"bytes sent by each rank (2(n-1)/n of {numel} floats: {expected})",
                         keys="rank")
