"""Exercise 01: ring collectives and a broadcast tree, from point-to-point messages.

Build minipar's collectives from ``minipar.comm.exchange`` (one send and one receive, recorded),
``isend``, ``irecv`` and ``recv``. Every function takes ``group`` (``None``: the world) and works
on **any group**: a sub-group of the ranks too, with group-local ranks. Contract:

* ``ring_all_reduce(tensor, group=None, op="sum")`` sums ``tensor`` over the n ranks of the
  group **in place, and returns that same tensor** (shape kept);
  **``op="avg"`` divides by n**, the size of the group;
  **any size, also one that n does not divide** (or smaller than n).
  It is two halves over the n chunks of the flattened tensor (``tensor_split(n)``):
  ``_reduce_scatter_chunks(chunks, group, name)``, after which
  **chunk r on rank r holds the sum of chunk r over all ranks**, and
  ``_all_gather_chunks(chunks, group, name)``, after which
  **every rank holds every chunk's full sum**.
* **Each step sends one chunk** to the right neighbour and receives one from the left; each
  half takes n-1 steps, so every rank sends 2(n-1)/n of the tensor, whatever n (Patarasuk &
  Yuan 2009; ``minipar.cost.collective_bytes``).
* ``ring_reduce_scatter(tensor, group=None, op="sum")`` returns rank r's chunk r of the sum;
  **the input tensor is left unchanged**.
* ``ring_all_gather(chunk, group=None, sizes=None)`` returns every rank's chunk concatenated
  in rank order, **chunks of different sizes** too when ``sizes`` lists them;
  **sizes that do not match this rank's chunk are a ValueError**, raised before anything is sent.
* ``broadcast(tensor, src=0, group=None, algorithm="tree")`` copies group rank ``src``'s
  tensor to every rank in place, **from any src**: ``"tree"`` a binomial tree (⌈log2 n⌉
  rounds), ``"ring"`` a pipelined chain of ``pieces`` pieces;
  **any other algorithm is a ValueError**.

The invariants, and the picture of the ring for n = 4, are in notebook 01, "All-reduce around
a ring" and "Broadcast: a tree". Graded against Gloo on 2 to 4 ranks and a group of 3 of 4
ranks, and on the bytes each rank sends. Grade it with ``python -m minipar.grade ex01``;
stuck? ``minipar.hint("ex01")``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import comm
from minipar import cost
from minipar.course.grading import diagnose, expect, expect_close, expect_contributions, expect_equal, observes

EXERCISE = "ex01_collectives"
HINTS = {
    '': (
        "Work out one rank's view for n = 3 on paper: which chunk must it send at step 0 so that,"
        ' n-1 steps later, chunk r is complete on rank r? Then ask which chunk it sends next. '
        'The broadcast tree: in round k, which ranks already hold the data?',
        'Reduce-scatter: at every step send the chunk you have just added into (it holds the most'
        ' contributions) and add what arrives from the left into the chunk it belongs to. '
        'All-gather: at every step forward the complete chunk you received last; start from the '
        'one you completed. Work with group ranks (comm.group_rank/group_size(group)) throughout, '
        'and count broadcast ranks relative to src.',
        'At step s, rank r: reduce-scatter sends chunk (r-s-1) % n to the right and adds the '
        'chunk (r-s-2) % n from the left; all-gather sends chunk (r-s) % n and overwrites chunk '
        '(r-s-1) % n. ring_all_reduce: flat view, chunks = flat.tensor_split(n), both halves, '
        "divide once for 'avg', copy back into tensor if the flat view was a copy. "
        'ring_reduce_scatter: clones of the chunks, then the first half. ring_all_gather: check '
        'sizes, an output of sum(sizes), out.split(sizes), copy your chunk in, the second half. '
        'broadcast tree: vr = (r - src) % n; in round k (mask 2^k) ranks vr < mask send to '
        'vr + mask, ranks mask <= vr < 2·mask receive from vr - mask; ring: receive piece i from '
        'the left, then isend it right.',
    ),
}
CONTRACT = {
    "in place, and returns that same tensor": "test_in_place_and_returned",
    "any size, also one that n does not divide": "test_sum_uneven_sizes",
    '``op="avg"`` divides by n': ("test_average_four_ranks", "test_pieces_on_any_group"),
    "chunk r on rank r holds the sum of chunk r over all ranks": ("test_sum_two_ranks", "test_sum_uneven_sizes"),
    "every rank holds every chunk's full sum": ("test_sum_two_ranks", "test_sum_uneven_sizes"),
    "Each step sends one chunk": "test_bytes_match_cost_model",
    "any group": "test_pieces_on_any_group",
    "the input tensor is left unchanged": "test_pieces_on_any_group",
    "chunks of different sizes": "test_pieces_on_any_group",
    "sizes that do not match this rank's chunk are a ValueError": "test_pieces_on_any_group",
    "from any src": "test_pieces_on_any_group",
    "any other algorithm is a ValueError": "test_pieces_on_any_group",
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
        size = f"{reduced.numel()} elements" + (f", a size {n} does not divide" if reduced.numel() % n else "")
        lo, hi = ranges[rank]
        expect_equal(scattered.numel(), hi - lo, f"rank {rank}: elements of its reduce-scatter chunk {rank}")
        expect_contributions(scattered, n, range(n), f"rank {rank}, after the reduce-scatter ({size}): its chunk {rank} "
                             f"(elements {lo}..{hi - 1})", positions=torch.arange(lo, hi))
        for c, (lo, hi) in enumerate(ranges):
            if hi > lo:
                expect_contributions(reduced[lo:hi], n, range(n), f"rank {rank}, after the all-reduce ({size}): chunk {c} "
                                     f"(elements {lo}..{hi - 1})", positions=torch.arange(lo, hi))


def _assert_cases(results, op="sum"):
    n = len(results)
    if op == "sum":
        _assert_contributions([contrib for contrib, _ in results], n)
    for rank, (_, cases) in enumerate(results):
        for got, want, in_place in cases:
            uneven = f", a size {n} does not divide" if want.numel() % n else ""
            expect_close(got, want, "the reduced tensor (compared with Gloo's all-reduce)",
                         where=f"rank {rank}, shape {tuple(want.shape)}{uneven}", rtol=1e-5, atol=1e-5)


@observes('ex01.*.reduce_scatter', 'ex01.*.all_gather')
def test_sum_two_ranks(impl):
    """Sums over 2 ranks for several sizes."""
    _assert_cases(minipar.launch(_all_reduce_cases, 2, args=([(8,), (1000,)], "sum"),
                                 timeout=TIMEOUT))


@observes('ex01.*.any_size', 'ex01.*.reduce_scatter', 'ex01.*.all_gather')
def test_sum_uneven_sizes(impl):
    """Sums over 3 ranks when the size is not divisible by 3 (and smaller than 3)."""
    _assert_cases(minipar.launch(_all_reduce_cases, 3,
                                 args=([(10,), (2,), (7, 5)], "sum"), timeout=TIMEOUT))


@observes('ex01.*.avg')
def test_average_four_ranks(impl):
    """op="avg": every rank holds the mean (4 ranks)."""
    results = minipar.launch(_all_reduce_cases, 4, args=([(64,), (3, 9)], "avg"), timeout=TIMEOUT)
    for rank, (_, cases) in enumerate(results):
        for got, want, _ in cases:
            with diagnose(lambda f, got=got, want=want: torch.allclose(got, want * 4, rtol=1e-5, atol=1e-5),
                          "the result equals the sum over the 4 ranks, not divided by n (op=\"avg\" divides by n)"):
                expect_close(got, want, "the averaged tensor (compared with Gloo's)",
                             where=f"rank {rank}, shape {tuple(want.shape)}", rtol=1e-5, atol=1e-5)


@observes('ex01.*.in_place')
def test_in_place_and_returned(impl):
    """The input tensor itself holds the result (shape kept) and is returned."""
    for rank, (_, cases) in enumerate(minipar.launch(_all_reduce_cases, 2, args=([(4, 6)], "sum"),
                                                     timeout=TIMEOUT)):
        for got, want, in_place in cases:
            expect_equal(tuple(got.shape), tuple(want.shape), f"rank {rank}: shape of the tensor after the call")
            expect(in_place, f"rank {rank}: ring_all_reduce returned another tensor, or None, not the tensor "
                             "it was given (in place, and returns that same tensor)")
            expect_close(got, want, "the tensor given to ring_all_reduce, after the call",
                         where=f"rank {rank}", rtol=1e-5, atol=1e-5)


def _bytes_run(numel):
    from minipar.runtime import trace
    x = torch.ones(numel)
    trace.start(dist.get_rank())  # count only the all-reduce
    comm.ring_all_reduce(x)
    return sum(e["bytes_sent"] for e in trace.events()), x[0].item()


@observes('ex01.*.bytes')
def test_bytes_match_cost_model(impl):
    """The bytes each rank sends, against the cost model's all-reduce (4 ranks, 4096 floats)."""
    n, numel = 4, 4096
    results = minipar.launch(_bytes_run, n, args=(numel,), timeout=TIMEOUT)
    expected = int(cost.collective_bytes("all_reduce", numel * 4, n))
    sent, values = [s for s, _ in results], [v for _, v in results]
    with diagnose(sent == [expected] * n, "the bytes sent are the cost model's; the values "
                                          "are not the sum"):
        expect_equal(values, [float(n)] * n, f"x[0] after all-reducing ones over {n} ranks, per rank", keys="rank")
    with diagnose(lambda f: any(s > expected for s in sent), "a rank sent more bytes than the cost model's"):
        with diagnose(lambda f: any(s < expected for s in sent), "a rank sent fewer bytes through "
                                                                 "minipar.comm than the cost model's"):
            expect_equal(sent, [expected] * n, f"bytes sent by each rank, all-reducing {numel} floats over {n} ranks (the cost model's)",
                         keys="rank")


def _pieces():
    """On 4 ranks: the reduce-scatter, the uneven all-gather and the broadcasts on the world,
    then the all-reduce (averaging) and both broadcasts on the group of ranks 1, 2, 3."""
    r, n = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group([1, 2, 3])
    out = {}
    x = torch.randn(10, generator=torch.Generator().manual_seed(7 + r))
    before, total = x.clone(), x.clone()
    dist.all_reduce(total)
    got = comm.ring_reduce_scatter(x, op="avg")
    out["reduce_scatter"] = (got, (total / n).tensor_split(n)[r], torch.equal(x, before))
    sizes = [1, 2, 3, 4]
    out["all_gather"] = (comm.ring_all_gather(torch.full((sizes[r],), float(r)), sizes=sizes),
                         torch.cat([torch.full((k,), float(i)) for i, k in enumerate(sizes)]))
    try:
        comm.ring_all_gather(torch.zeros(2), sizes=[3, 3, 3, 3])
        out["bad_sizes"] = "returned"
    except ValueError:
        out["bad_sizes"] = "ValueError"
    except Exception as e:  # noqa: BLE001 - reported as seen
        out["bad_sizes"] = f"{type(e).__name__}: {e}"
    try:
        comm.broadcast(torch.zeros(3), algorithm="star")
        out["bad_algorithm"] = "returned"
    except ValueError:
        out["bad_algorithm"] = "ValueError"
    except Exception as e:  # noqa: BLE001 - reported as seen
        out["bad_algorithm"] = f"{type(e).__name__}: {e}"
    for algorithm in ("tree", "ring"):
        t = torch.arange(6.0) + 100 * r
        out[f"broadcast {algorithm}, src 2, 4 ranks"] = (comm.broadcast(t, src=2, algorithm=algorithm),
                                                         torch.arange(6.0) + 200)
    if r in (1, 2, 3):
        g = r - 1
        y = torch.randn(7, generator=torch.Generator().manual_seed(50 + r))
        want = y.clone()
        dist.all_reduce(want, group=sub)
        out["group avg"] = (comm.ring_all_reduce(y, sub, op="avg"), want / 3)
        for algorithm in ("tree", "ring"):
            t = torch.arange(5.0) + 100 * g
            out[f"broadcast {algorithm}, src 1, group"] = (comm.broadcast(t, src=1, group=sub,
                                                                          algorithm=algorithm),
                                                           torch.arange(5.0) + 100)
    return out


@observes('ex01.*.avg', 'ex01.*.group', 'ex01.*.input_kept', 'ex01.*.uneven_chunks', 'ex01.*.size_error', 'ex01.*.src', 'ex01.*.algorithm_error')
def test_pieces_on_any_group(impl):
    """ring_reduce_scatter, an uneven ring_all_gather and both broadcasts on 4 ranks; the all-reduce and broadcasts on a group of 3 of them."""
    for rank, out in enumerate(minipar.launch(_pieces, 4, timeout=TIMEOUT)):
        got, want, unchanged = out["reduce_scatter"]
        expect_close(got, want, "ring_reduce_scatter(x, op='avg'): chunk r of the average (10 elements)",
                     where=f"rank {rank}", rtol=1e-5, atol=1e-5)
        expect(unchanged, f"rank {rank}: ring_reduce_scatter changed its input x (the input tensor is left "
                          "unchanged)")
        got, want = out["all_gather"]
        expect_close(got, want, "ring_all_gather of chunks of different sizes (sizes=[1, 2, 3, 4], rank r's "
                     "chunk all r)", where=f"rank {rank}")
        expect_equal(out["bad_sizes"], "ValueError", f"rank {rank}: ring_all_gather(2 elements, sizes=[3, 3, 3, 3])"
                     " (sizes that do not match this rank's chunk are a ValueError)")
        expect_equal(out["bad_algorithm"], "ValueError", f"rank {rank}: broadcast(..., algorithm='star') "
                     "(any other algorithm is a ValueError)")
        for key in [k for k in out if k.startswith("broadcast")]:
            got, want = out[key]
            expect_close(got, want, f"{key}: the root's tensor, in place (from any src)", where=f"rank {rank}")
        if rank:
            got, want = out["group avg"]
            expect_close(got, want, "ring_all_reduce(y, group, op='avg') on the group of ranks 1, 2, 3 "
                         "(any group; op=\"avg\" divides by n = 3, the group's size)",
                         where=f"rank {rank} (group rank {rank - 1})", rtol=1e-5, atol=1e-5)
