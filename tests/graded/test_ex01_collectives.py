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
tensor, whatever n (Patarasuk & Yuan 2009; ``minipar.cost.collective_bytes``).

Graded against Gloo's all-reduce on 2 to 4 ranks, and on the bytes each rank sends.
Grade it with ``python -m minipar.grade ex01``; stuck? ``minipar.hint("ex01")``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import comm, cost

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


def _all_reduce_cases(shapes, op):
    """On each rank: reduce random tensors with the function under test and with Gloo."""
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
    return out


def _assert_cases(results):
    for rank, cases in enumerate(results):
        for got, want, in_place in cases:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank}, shape {tuple(want.shape)}: {m}")


def test_sum_two_ranks(impl):
    """Sums over 2 ranks for several sizes.
    Hint: with n=2 there is one reduce-scatter step and one all-gather step."""
    _assert_cases(minipar.launch(_all_reduce_cases, 2, args=([(8,), (1000,)], "sum"),
                                 timeout=TIMEOUT))


def test_sum_uneven_sizes(impl):
    """Sums over 3 ranks when the size is not divisible by 3 (and smaller than 3).
    Hint: cut with tensor.tensor_split(n), which allows unequal chunks (even empty ones)."""
    _assert_cases(minipar.launch(_all_reduce_cases, 3,
                                 args=([(10,), (2,), (7, 5)], "sum"), timeout=TIMEOUT))


def test_average_four_ranks(impl):
    """op="avg" divides the sum by the number of ranks (4 here).
    Hint: reduce the sum first, then divide once."""
    _assert_cases(minipar.launch(_all_reduce_cases, 4, args=([(64,), (3, 9)], "avg"),
                                 timeout=TIMEOUT))


def test_in_place_and_returned(impl):
    """The input tensor itself holds the result (shape kept) and is returned.
    Hint: work on a flat view or copy, then copy the result back into `tensor`."""
    for cases in minipar.launch(_all_reduce_cases, 2, args=([(4, 6)], "sum"),
                                timeout=TIMEOUT):
        for got, want, in_place in cases:
            assert got.shape == want.shape
            assert in_place, "ring_all_reduce must return the tensor it was given"


def _bytes_run(numel):
    from minipar import trace
    x = torch.ones(numel)
    trace.start(dist.get_rank())  # count only the all-reduce
    comm.ring_all_reduce(x)
    return sum(e["bytes_sent"] for e in trace.events()), x[0].item()


def test_bytes_match_cost_model(impl):
    """Each rank sends exactly 2(n-1)/n of the tensor's bytes (4 ranks, 4096 floats).
    Hint: send only chunks, one per step, with minipar.comm.exchange (so it is recorded)."""
    n, numel = 4, 4096
    results = minipar.launch(_bytes_run, n, args=(numel,), timeout=TIMEOUT)
    expected = cost.collective_bytes("all_reduce", numel * 4, n)
    for rank, (sent, value) in enumerate(results):
        assert value == n, f"rank {rank}: wrong sum {value}"
        assert sent == expected, f"rank {rank} sent {sent} bytes, the ring sends {expected:.0f}"
