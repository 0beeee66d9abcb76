"""Exercise 01: the ring all-reduce, from point-to-point messages.

Write the ring in ``minipar.comm.ring``: its two halves, ``_reduce_scatter_chunks`` and
``_all_gather_chunks``, and ``ring_all_reduce``, which runs one after the other. Move data
only with ``minipar.comm.exchange`` (it sends one tensor to a rank while receiving another
from a rank, and records the bytes so the grader can check them against the cost model).

The algorithm (n ranks on a ring; rank r sends to right = (r+1) % n and receives from
left = (r-1) % n); the flattened tensor is cut into n chunks with ``tensor_split(n)``:

1. reduce-scatter, n-1 steps: at step s send chunk (r-s-1) % n and add the incoming
   chunk (r-s-2) % n into yours. Afterwards chunk r holds the sum over all ranks.
2. all-gather, n-1 steps: at step s send chunk (r-s) % n and overwrite chunk
   (r-s-1) % n with what arrives.

Each rank then sends 2(n-1)/n of the tensor in total, whatever n is (Patarasuk & Yuan
2009). The tests call ``minipar.comm.ring_all_reduce`` with your code in place, on 2 to 4
ranks, and compare with Gloo's all-reduce. Grade it with ``python -m minipar.grade ex01``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import comm, cost

EXERCISE = "ex01_collectives"
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
