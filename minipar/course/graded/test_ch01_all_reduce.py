"""Challenge 01: an all-reduce that beats gather-to-one, in bytes and in modelled time.

Write ``all_reduce(tensor, group=None)`` in ``exercises/challenges/ch01_all_reduce.py``: the
sum over the ranks, in place, moving data only with ``minipar.comm``'s recorded
point-to-point calls. On 4 ranks and a 1 MiB fp32 tensor, measured from the trace: the
busiest rank sends at most 2(n-1)/n of the tensor's bytes, and its modelled time (each
recorded call α + β·max(sent, received), α = 5 µs, 1/β = 10 GB/s) is at most half of
gather-to-one's. Correct on 2 and 4 ranks within fp32 rounding (rtol 1e-5). The algorithm is yours: a trace
that shows minipar's own collectives (``comm.ring_all_reduce``, ``halving_doubling_all_reduce``,
the ring's halves, ``broadcast``, or a native collective) does not count.

Grade it alone with ``python -m minipar.grade ch01`` (``minipar.hint("ch01")`` for the next of
three hint tiers).
"""

import torch
import torch.distributed as dist

import minipar
from minipar import comm
from minipar.runtime import trace
from minipar.course import grading
from minipar.course.grading import expect_close, fail_if, observes

CHALLENGE = "ch01_all_reduce"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNpVzDEOg0AMBdGr/C5NFiVtmhQcgtoCg1cstmQ74fogOvp509tPE7tQYqEU9pJWTPkRcNIVLwTrF'
        'B9oeZ+ZNUayhnk8kXsducMgdRRQW8xryhZQ/rNfDnQzmN02nPfr/T0AuTwsRw==',
        'sealed:eNo9jjsOgzAQRK8yJRSAQpky6bmDAxtsYa2Rd42UXIyek8XCSdqZN597UqglKLGECMcawBht4kVge'
        'IInBW0UX4iGFwhlzRQA5meJ0no9e6LjGVVfcXOpT1kQnhg6rpHrI40pitsI1vgto80U0sOXzLH7MPd5/R/7Q'
        'hD3Jqlb3ILa8qAMdHzsA1aK57f2A7ZaR1s=',
        'sealed:eNpVkMtOAzEMRX/lfkAmqCypumeH1BVbE3smgdSp8piBv6+nhQU7y9I9PtfnpMsLqvAIMrVAvUt10'
        'OmA1uXaHJooo0dBiEO/8FMGPkfrIGZhJO3F7TO2SLasNa3SjqCcp4Us9h82l7pRffBUNjFOKJdrlv7L93ilv'
        'JrTxGV85LuccTm1ThoEjBP06dnBe+9wgHyHSLoIIuUZZd79qjkvF9GOLfWISqZd8f52tjRZGbM97gaKoVysg'
        'tVfpTZxfzg7e1d8vIV3uLXyN2SLaEQ=',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT
N = 4
NUMEL = 2 ** 18                  # 1 MiB of fp32
ALPHA, BETA = 5e-6, 1 / 10e9     # seconds per call, seconds per byte
TIME_GOAL = 0.5                  # at most this fraction of gather-to-one's modelled time


def naive_all_reduce(x, group=None):
    """Gather-to-one then send back (notebook 01): rank 0 receives and sends n-1 whole tensors."""
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        buf = torch.empty_like(x)
        for src in range(1, n):
            comm.recv(buf, src)
            x += buf
        for dst in range(1, n):
            comm.send(x, dst)
    else:
        comm.send(x, 0)
        comm.recv(x, 0)
    return x


LIBRARY = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "halving_doubling_all_reduce",
           "broadcast", "all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def _modelled(events):
    return sum(ALPHA + BETA * max(e["bytes_sent"], e["bytes_recv"]) for e in events)


def _run(fn, shapes):
    """On each rank: the sums (against Gloo's) for ``shapes``, then one measured 1 MiB call of
    the challenge's all-reduce and of gather-to-one."""
    r = dist.get_rank()
    cases = []
    for i, shape in enumerate(shapes):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(100 * r + i))
        want = x.clone()
        dist.all_reduce(want)
        got = x.clone()
        ret = fn(got)
        cases.append((shape, got, want, ret is got))
    measured = {}
    for name, f in (("yours", fn), ("naive", naive_all_reduce)):
        x = torch.full((NUMEL,), float(2 ** r))
        trace.start(r)
        f(x)
        evs = [e for e in trace.events() if e["kind"] == "comm"]
        measured[name] = {"sent": sum(e["bytes_sent"] for e in evs), "recv": sum(e["bytes_recv"] for e in evs),
                          "calls": len(evs), "time": _modelled(evs), "value": x[0].item(),
                          "library": sorted({e["name"] for e in evs if e["name"] in LIBRARY})}
    return cases, measured


def _launch(challenge, n, shapes):
    return minipar.launch(_run, n, args=(challenge.all_reduce, shapes), timeout=TIMEOUT)


def _check_sums(results):
    for rank, (cases, _) in enumerate(results):
        for shape, got, want, in_place in cases:
            expect_close(got, want, "the sum over the ranks", where=f"rank {rank}, shape {shape}",
                         rtol=1e-5, atol=1e-5)
            fail_if(not in_place, f"rank {rank}: all_reduce must return the tensor it was given")


@observes('ch01.*.sum')
def test_sums_on_two_ranks(challenge):
    """Every rank holds the sum on 2 ranks (sizes 8, 1000, 3)."""
    _check_sums(_launch(challenge, 2, [(8,), (1000,), (3,)]))


@observes('ch01.*.sum', 'ch01.*.any_size')
def test_sums_on_four_ranks(challenge):
    """Every rank holds the sum on 4 ranks, also for sizes 4 does not divide (10, 3, 7x5)."""
    _check_sums(_launch(challenge, 4, [(64,), (10,), (3,), (7, 5)]))


@observes('ch01.*.bytes', 'ch01.*.time')
def test_bandwidth_and_time_beat_gather_to_one(challenge):
    """4 ranks, 1 MiB: the busiest rank sends <= 2(n-1)/n of it; modelled time <= half the naive's."""
    results = _launch(challenge, N, [])
    size = 4 * NUMEL
    yours = [m["yours"] for _, m in results]
    naive = [m["naive"] for _, m in results]
    for rank, m in enumerate(yours):
        fail_if(m["value"] != 2 ** N - 1, f"rank {rank}: the 1 MiB all-reduce holds {m['value']:g} in "
                 f"element 0, expected {2 ** N - 1} (rank r contributed 2^r)")
        fail_if(m["recv"] < size, f"rank {rank} received {m['recv']} B through minipar.comm, less than the "
                 f"tensor's {size} B: every element of the sum needs data from the other ranks, so "
                 "some data moved outside minipar.comm's recorded calls")
        fail_if(m["library"], f"rank {rank}: the trace of your all-reduce holds minipar's own collectives "
                 f"(events named {', '.join(m['library'])}), not an algorithm of your own")
    busiest = max(range(N), key=lambda r: yours[r]["sent"])
    goal = 2 * (N - 1) / N * size
    fail_if(yours[busiest]["sent"] > goal,
             f"bandwidth: rank {busiest} sent {yours[busiest]['sent'] / 2**20:.3f} MiB, the goal is at most "
             f"2(n-1)/n = {goal / 2**20:.3f} MiB (gather-to-one: {max(m['sent'] for m in naive) / 2**20:.3f} MiB "
             "from rank 0)")
    t_yours, t_naive = max(m["time"] for m in yours), max(m["time"] for m in naive)
    slow = max(range(N), key=lambda r: yours[r]["time"])
    fail_if(t_yours > TIME_GOAL * t_naive,
             f"modelled time: {1e6 * t_yours:.0f} µs on rank {slow} ({yours[slow]['calls']} calls, "
             f"α = {1e6 * ALPHA:g} µs each, plus β·bytes), the goal is at most {TIME_GOAL:g} x gather-to-one's "
             f"{1e6 * t_naive:.0f} µs ({max(m['calls'] for m in naive)} calls of the whole tensor)")
