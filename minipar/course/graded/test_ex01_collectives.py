"""Exercise 01: ring collectives and a broadcast tree, from point-to-point messages.

Build minipar's collectives from ``minipar.comm.exchange`` (one send and one receive, recorded),
``isend``, ``irecv`` and ``recv``: ``ring_all_reduce`` on two halves, ``_reduce_scatter_chunks``
and ``_all_gather_chunks``; ``ring_reduce_scatter``; ``ring_all_gather``; and ``broadcast``
(a binomial tree and a pipelined chain). Who sends what to whom at each step is yours to
design (Patarasuk & Yuan 2009).

Each function's docstring below is its contract: clauses ``ex01.*.word`` that must hold (the
grader names the clause a failure breaks). The invariants, and what each rank holds after each
step of the ring for n = 4, are in notebook 01, "All-reduce around a ring" and "Broadcast: a
tree". Graded against Gloo on 2 to 4 ranks and on a group of 3 of 4 ranks, on the messages each
rank posts (how many, how large, to which rank) and on the bytes each rank sends. Grade it with
``python -m minipar.grade ex01``; stuck? ``minipar.hint("ex01")``.
"""
import hashlib
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

import minipar
from minipar import comm
from minipar import cost
from minipar.course import grading
from minipar.course.grading import (attempt, breaks, diagnose, expect, expect_close, expect_contributions,
                                    expect_equal, observes)
from minipar.runtime import checked
from minipar.runtime.launch import LaunchTimeout, RankError

EXERCISE = "ex01_collectives"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNpVjjEOwjAMRa/yN5aCQGyVUC+BxGwSo0QpcWW7FG5PirowWbL93/s30QKZHVIZSrXsDK/MCx6iq'
        'Ljg3C6YaGLtsaQcEkKaa8FzNkd2GNcIatN5whEm8ETeoe5Pv51hJGfttpgiG4I8p5GdV/TqhA64Jq4gK3+Sj'
        'W+o/PbD+oO7CsVATe7K3CM3hMytQ+m26Eo00KhM8YMkY2yVGJGchi+HsFLy',
        'sealed:eNplT8tOAzEM/JU5biW63MuJX+DCEbmJuwmbjSvH2ap8PWZbVCRuI3uebxx74H0LZMZ6ABl4Zb2iG'
        'Z/RuEZYYoTU64yrdCRaGZ+9GShGjsjVBEM2JCmxbeRF/BukmuZjtyy17UBu5AJckieQal654aSybIrCJ7s5P'
        'cLc8shF6uSmMuK1lP1E/v5X8iR6Ib33lOVc2P4WVg7saRGFmr24hNQeyVJ5Y/0K44h30RmXbAmTSj9Dqc4Ng'
        'zOWcbt8/Fyeb7DlLx42uNu5oYMpSbenbXCQXn2FCsXg4Xcn5ULmjXwWmobxG+BFjck=',
        'sealed:eNptUstuwjAQ/JW5VIBKkMqRx6E/UmScDbEIdrTeBNEf671f1rWdUqr2Zs+Od3bG+yqIQj3iEmz8G'
        'bwBUz1YqqI1IsSI5OsI2w5anXMVq5cFnuAhAdIS2J1agfE1TK28BD1w14XbcLjkUkeNbGG6rjoZvf/tXvipX'
        'RiJr+yE/hFfqaw/HbTPoUy7QdMZwejouiz0iH3GVkI+Bj7EvnMy94sljkFatKYbSU3XbnQ1IXhLaAJjZsbTT'
        'FuE/oajsWc4n4zmHnBNNnGXwtVEmEyeJirTHKbsNrBd8GogND/BqKiefenkOEqapXlwVJLRty2pfnTvaU7jE'
        'QbpB0m94nCZZ1zdKLoq3r6RPPstDDzl5nxW1Kht0FyL2pGDqa1RdWHS+EbWvOaMCpFtznirD8Fh0Cea/cXEM'
        '9Zv50Vek5j4O2Qw/WBaBkWeM7KcKLm62xfq+vMj35ksuZHKRoxJL8Hb7H5zr/ZOD3C/92bKzWVBJ2XzVl/Nd'
        'fGi',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT


def _contributions(numel):
    """Rank r contributes 2^r + 2^n·i at position i: every element of the result says which
    ranks' data it holds (notebook 01's 2^r trick) and from which positions. Reduce-scatter
    alone, then the whole all-reduce."""
    r, n = dist.get_rank(), dist.get_world_size()
    mine = 2.0 ** r + 2.0 ** n * torch.arange(numel, dtype=torch.float32)
    scattered = comm.ring_reduce_scatter(mine.clone())
    return scattered, _result(comm.ring_all_reduce, mine.clone())


def _result(fn, x, *args, **kwargs):
    """What ``fn`` returned, where the contract says the result is (the tensor given, when it
    returned nothing): a result that is not in place fails only the in-place clause."""
    ret = fn(x, *args, **kwargs)
    return ret if isinstance(ret, torch.Tensor) else x


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
        given = x.clone()
        ret = comm.ring_all_reduce(given, op=op)
        got = ret if isinstance(ret, torch.Tensor) else given
        out.append((got, want, (ret is given or (ret is not None and ret.data_ptr() == given.data_ptr())), given))
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
        uneven = ("ex01.*.uneven",) if reduced.numel() % n else ()
        with breaks(*uneven or ("ex01.*.scatter",)):
            expect_equal(scattered.numel(), hi - lo, f"rank {rank}: elements of its reduce-scatter chunk {rank}")
            expect_contributions(scattered, n, range(n), f"rank {rank}, after the reduce-scatter ({size}): its chunk "
                                 f"{rank} (elements {lo}..{hi - 1})", positions=torch.arange(lo, hi))
        for c, (lo, hi) in enumerate(ranges):
            if hi > lo:
                with breaks(*uneven or ("ex01.*.gather",)):
                    expect_contributions(reduced[lo:hi], n, range(n), f"rank {rank}, after the all-reduce ({size}): "
                                         f"chunk {c} (elements {lo}..{hi - 1})", positions=torch.arange(lo, hi))


def _assert_cases(results, op="sum"):
    n = len(results)
    if op == "sum":
        _assert_contributions([contrib for contrib, _ in results], n)
    for rank, (_, cases) in enumerate(results):
        for got, want, *_ in cases:
            uneven = f", a size {n} does not divide" if want.numel() % n else ""
            with breaks("ex01.*.uneven" if uneven else "ex01.*.gather"):
                expect_close(got, want, "the reduced tensor (compared with Gloo's all-reduce)",
                             where=f"rank {rank}, shape {tuple(want.shape)}{uneven}", rtol=1e-5, atol=1e-5)


@observes("ex01.*.scatter", "ex01.*.gather")
def test_sum_two_ranks(impl):
    """Sums over 2 ranks for several sizes."""
    _assert_cases(minipar.launch(_all_reduce_cases, 2, args=([(8,), (1000,)], "sum"),
                                 timeout=TIMEOUT))


@observes("ex01.*.uneven", "ex01.*.scatter", "ex01.*.gather")
def test_sum_uneven_sizes(impl):
    """Sums over 3 ranks when the size is not divisible by 3 (and smaller than 3)."""
    _assert_cases(minipar.launch(_all_reduce_cases, 3,
                                 args=([(10,), (2,), (7, 5)], "sum"), timeout=TIMEOUT))


@observes("ex01.*.avg")
def test_average_four_ranks(impl):
    """op="avg": every rank holds the mean (4 ranks)."""
    results = minipar.launch(_all_reduce_cases, 4, args=([(64,), (3, 9)], "avg"), timeout=TIMEOUT)
    for rank, (_, cases) in enumerate(results):
        for got, want, *_ in cases:
            with diagnose(lambda f, got=got, want=want: torch.allclose(got, want * 4, rtol=1e-5, atol=1e-5),
                          "the result equals the sum over the 4 ranks, not divided by n (op=\"avg\" divides by n)"):
                expect_close(got, want, "the averaged tensor (compared with Gloo's)",
                             where=f"rank {rank}, shape {tuple(want.shape)}", rtol=1e-5, atol=1e-5)


@observes("ex01.*.in_place")
def test_in_place_and_returned(impl):
    """The input tensor itself holds the result (shape kept) and is returned."""
    for rank, (_, cases) in enumerate(minipar.launch(_all_reduce_cases, 2, args=([(4, 6)], "sum"),
                                                     timeout=TIMEOUT)):
        for _, want, in_place, given in cases:
            expect_equal(tuple(given.shape), tuple(want.shape), f"rank {rank}: shape of the tensor after the call")
            expect(in_place, f"rank {rank}: ring_all_reduce returned another tensor, or None, not the tensor "
                             "it was given (in place, and returns that same tensor)")
            expect_close(given, want, "the tensor given to ring_all_reduce, after the call",
                         where=f"rank {rank}", rtol=1e-5, atol=1e-5)


def _bytes_run(numel):
    from minipar.runtime import trace
    x = torch.ones(numel)
    trace.start(dist.get_rank())  # count only the all-reduce
    x = _result(comm.ring_all_reduce, x)
    return sum(e["bytes_sent"] for e in trace.events()), x[0].item()


@observes("ex01.*.step")
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


@contextmanager
def _messages():
    """Every message this rank posts while inside, as ``(kind, global peer, elements)``, read
    from ``torch.distributed``'s own ``isend``/``irecv`` beneath ``minipar.comm`` (a batch posts
    its operations through them too; the size checks grading adds are left out)."""
    from torch.distributed import distributed_c10d as c10d
    log, saved = [], {"isend": c10d.isend, "irecv": c10d.irecv}

    def posts(kind, f):
        def post(*args, **kwargs):
            tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
            if tag not in checked.TAGS:
                peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
                log.append((kind, peer, (args[0] if args else kwargs["tensor"]).numel()))
            return f(*args, **kwargs)
        return post

    patched = {"isend": posts("send", saved["isend"]), "irecv": posts("recv", saved["irecv"])}
    for name, f in patched.items():
        setattr(c10d, name, f)
        setattr(dist, name, f)
    try:
        yield log
    finally:
        for name, f in saved.items():
            setattr(c10d, name, f)
            setattr(dist, name, f)


def _watched(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the messages it posts and the comm events it records."""
    from minipar.runtime import trace
    mark = trace.mark()
    with _messages() as log:
        out = fn(*args, **kwargs)
    events = [e for e in trace.since(mark) if e["kind"] == "comm"]
    return out, log, [(e["start"], e["end"], e["bytes_sent"], e["bytes_recv"]) for e in events]


def _traffic(numel, part):
    """With the messages each call posted: ``"ring"``, the two ring halves (through
    ring_reduce_scatter and ring_all_gather) and the whole all-reduce; ``"tree"`` or ``"chain"``,
    that broadcast from src 1 (with its result and comm events)."""
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(numel)
    if part == "ring":
        return {"reduce_scatter": _watched(comm.ring_reduce_scatter, x.clone())[1],
                "all_gather": _watched(comm.ring_all_gather, x.tensor_split(n)[r].clone())[1],
                "all_reduce": _watched(comm.ring_all_reduce, x.clone())[1]}
    return _watched(comm.broadcast, torch.arange(float(numel)) + 1000 * r, src=1,
                    algorithm={"tree": "tree", "chain": "ring"}[part], pieces=4)


def _traffic_run(impl, part, cache={}):
    """One launch of :func:`_traffic` per part, shared by the tests that read it, for the same
    implementation (the same file's text: an edited file launches afresh); a failed launch
    fails each of them the same way."""
    module = sys.modules.get(f"{ {'exercise': 'exercises', 'solution': 'solutions'}.get(impl)}.{EXERCISE}")
    text = Path(module.__file__).read_text() if module is not None and getattr(module, "__file__", None) else ""
    key = (impl, hashlib.sha256(text.encode()).hexdigest())
    if key not in cache:
        cache.clear()
        cache[key] = {}
    runs = cache[key]
    if part not in runs:
        try:
            n, numel = _TRAFFIC[part]
            runs[part] = minipar.launch(_traffic, n, args=(numel, part), timeout=TIMEOUT)
        except (RankError, LaunchTimeout) as e:
            runs[part] = e
    if isinstance(runs[part], Exception):
        raise runs[part]
    return runs[part]


_TRAFFIC = {"ring": (4, 4096), "chain": (4, 4096), "tree": (8, 64)}  # ranks, elements: 8 ranks separate
# a tree of depth ⌈log2 n⌉ from one whose root sends ⌈log2 n⌉ messages and the rest form a chain
_RING = {"reduce_scatter": "ring_reduce_scatter", "all_gather": "ring_all_gather", "all_reduce": "ring_all_reduce"}


@observes("ex01.*.ring")
def test_ring_neighbours(impl):
    """Every message of the ring collectives goes to the next rank of the ring, and comes from the one before (4 ranks)."""
    results, n = _traffic_run(impl, "ring"), 4
    for key, fn in _RING.items():
        for rank, out in enumerate(results):
            peers = {kind: sorted({p for k, p, _ in out[key] if k == kind}) for kind in ("send", "recv")}
            expect_equal(peers, {"send": [(rank + 1) % n], "recv": [(rank - 1) % n]},
                         f"{fn} on {n} ranks, rank {rank}: the ranks it sent to and received from")


@observes("ex01.*.step")
def test_one_chunk_per_step(impl):
    """How many messages each rank sends in each ring collective, and how large they are (4 ranks, 4096 floats)."""
    results, n, numel = _traffic_run(impl, "ring"), 4, 4096
    steps = {"reduce_scatter": n - 1, "all_gather": n - 1, "all_reduce": 2 * (n - 1)}
    for key, fn in _RING.items():
        sent = [[k for kind, _, k in out[key] if kind == "send"] for out in results]
        expect_equal([len(s) for s in sent], [steps[key]] * n, f"{fn} on {n} ranks: messages sent by each rank",
                     keys="rank")
        expect_equal([max(s, default=0) for s in sent], [numel // n] * n,
                     f"{fn} on {n} ranks, {numel} elements: elements in each rank's largest message", keys="rank")


@observes("ex01.*.tree")
def test_broadcast_tree(impl):
    """broadcast(algorithm="tree") from src 1 on 8 ranks: the messages each rank sends and receives, and how far each rank is from src."""
    (n, numel), src = _TRAFFIC["tree"], 1
    results = _traffic_run(impl, "tree")
    rounds = math.ceil(math.log2(n))
    parent = {}
    for rank, out in enumerate(results):
        got, log, _ = out
        expect_close(got, torch.arange(float(numel)) + 1000 * src, "broadcast tree from src 1: the tensor",
                     where=f"rank {rank}")
        recvs = [(p, k) for kind, p, k in log if kind == "recv"]
        if rank == src:
            expect_equal(recvs, [], f"broadcast tree on {n} ranks: messages src (rank {src}) received")
            sends = [p for kind, p, _ in log if kind == "send"]
            expect_equal(len(sends), rounds, f"broadcast tree on {n} ranks: messages src (rank {src}) sent "
                         f"(⌈log2 {n}⌉ = {rounds}; sent to ranks {sends})")
        else:
            expect_equal([k for _, k in recvs], [numel], f"broadcast tree on {n} ranks, rank {rank}: elements of "
                         f"each message it received (from ranks {[p for p, _ in recvs]})")
            parent[rank] = recvs[0][0]

    def hops(q):
        d = 0
        while q != src and d <= n:
            q, d = parent.get(q, q), d + 1
        return d

    far = max(hops(q) for q in range(n))
    expect(far <= rounds, f"broadcast tree on {n} ranks: a rank is {far} messages away from src (rank {src}) "
                          f"along the messages that brought it the tensor (each rank's sender: {parent}); "
                          f"at most ⌈log2 {n}⌉ = {rounds}")


@observes("ex01.*.chain")
def test_broadcast_chain(impl):
    """broadcast(algorithm="ring", pieces=4) from src 1 on 4 ranks: the messages each rank sends and receives, and whether it forwards before the last piece arrived."""
    results, n, src, numel, pieces = _traffic_run(impl, "chain"), 4, 1, 4096, 4
    for rank, out in enumerate(results):
        got, log, events = out
        expect_close(got, torch.arange(float(numel)) + 1000 * src, "broadcast ring from src 1: the tensor",
                     where=f"rank {rank}")
        recvs = [(p, k) for kind, p, k in log if kind == "recv"]
        sends = [(p, k) for kind, p, k in log if kind == "send"]
        want_recv = [] if rank == src else [((rank - 1) % n, numel // pieces)] * pieces
        want_send = [] if rank == (src - 1) % n else [((rank + 1) % n, numel // pieces)] * pieces
        expect_equal(recvs, want_recv, f"broadcast ring from src {src}, {pieces} pieces of {numel} elements, rank "
                     f"{rank}: messages received, as (from rank, elements)")
        expect_equal(sends, want_send, f"broadcast ring from src {src}, {pieces} pieces of {numel} elements, rank "
                     f"{rank}: messages sent, as (to rank, elements)")
        if recvs and sends:
            first_send = min(s for s, _, sent, _ in events if sent)
            last_recv = max(e for _, e, _, got in events if got)
            expect(first_send < last_recv, f"broadcast ring, rank {rank}: its first piece was sent on only after "
                   f"its last piece had arrived (a chain forwards while it receives: pipelined)")


def _pieces():
    """On 4 ranks: the reduce-scatter, the uneven all-gather and the broadcasts on the world; a
    chain of fewer elements than pieces; an unknown algorithm on a group of one rank."""
    r, n = dist.get_rank(), dist.get_world_size()
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
    alone = [dist.new_group([i]) for i in range(n)][r]   # every rank makes every group
    try:
        comm.broadcast(torch.zeros(3), group=alone, algorithm="star")
        out["bad_algorithm alone"] = "returned"
    except ValueError:
        out["bad_algorithm alone"] = "ValueError"
    except Exception as e:  # noqa: BLE001 - reported as seen
        out["bad_algorithm alone"] = f"{type(e).__name__}: {e}"
    out["few"] = attempt(lambda: _watched(comm.broadcast, torch.arange(3.0) + 100 * r, src=0, algorithm="ring",
                                          pieces=4)[:2])
    for algorithm in ("tree", "ring"):
        t = torch.arange(6.0) + 100 * r
        out[f"broadcast {algorithm}, src 2, 4 ranks"] = (comm.broadcast(t, src=2, algorithm=algorithm),
                                                         torch.arange(6.0) + 200)
    return out


@observes("ex01.*.avg", "ex01.*.input_kept", "ex01.*.sizes", "ex01.*.size_check", "ex01.*.src", "ex01.*.algorithm",
          "ex01.*.chain")
def test_pieces_on_the_world(impl):
    """ring_reduce_scatter, an uneven ring_all_gather, both broadcasts and a chain of 3 elements in 4 pieces on 4 ranks, and an unknown algorithm on a group of one rank."""
    n = 4
    for rank, out in enumerate(minipar.launch(_pieces, n, timeout=TIMEOUT)):
        got, want, unchanged = out["reduce_scatter"]
        with breaks("ex01.*.avg"):
            expect_close(got, want, "ring_reduce_scatter(x, op='avg'): chunk r of the average (10 elements)",
                         where=f"rank {rank}", rtol=1e-5, atol=1e-5)
        with breaks("ex01.*.input_kept"):
            expect(unchanged, f"rank {rank}: ring_reduce_scatter changed its input x (the input tensor is left "
                              "unchanged)")
        got, want = out["all_gather"]
        with breaks("ex01.*.sizes"):
            expect_close(got, want, "ring_all_gather of chunks of different sizes (sizes=[1, 2, 3, 4], rank r's "
                         "chunk all r)", where=f"rank {rank}")
        with breaks("ex01.*.size_check"):
            expect_equal(out["bad_sizes"], "ValueError", f"rank {rank}: ring_all_gather(2 elements, "
                         "sizes=[3, 3, 3, 3]) (sizes that do not match this rank's chunk are a ValueError)")
        with breaks("ex01.*.algorithm"):
            expect_equal(out["bad_algorithm"], "ValueError", f"rank {rank}: broadcast(..., algorithm='star') "
                         "(any other algorithm is a ValueError)")
            expect_equal(out["bad_algorithm alone"], "ValueError", f"rank {rank}: broadcast(..., algorithm='star') "
                         "on a group of one rank (any other algorithm is a ValueError, on any group)")
        with breaks("ex01.*.chain"):
            expect(not isinstance(out["few"], str), f"rank {rank}: broadcast(3 elements, algorithm='ring', "
                   f"pieces=4) {out['few']}")
            got, log = out["few"]
            expect_close(got, torch.arange(3.0), "broadcast ring of 3 elements in pieces=4 from src 0",
                         where=f"rank {rank}")
            want_recv = [] if rank == 0 else [((rank - 1) % n, 1)] * 3
            expect_equal([(p, k) for kind, p, k in log if kind == "recv"], want_recv,
                         f"broadcast ring from src 0, pieces=4 of 3 elements (as many pieces as it has elements, "
                         f"if fewer), rank {rank}: messages received, as (from rank, elements)")
        with breaks("ex01.*.src"):
            for key in [k for k in out if k.startswith("broadcast")]:
                got, want = out[key]
                expect_close(got, want, f"{key}: the root's tensor, in place (from any src)", where=f"rank {rank}")


def _on_a_group():
    """On the group of world ranks 1, 2, 3 (group ranks 0, 1, 2; rank 0 waits): every function,
    rank g of the group contributing 2^g, each with the world ranks it sent to."""
    sub = dist.new_group([1, 2, 3])
    if dist.get_rank() == 0:
        return None
    g, out = dist.get_rank(sub), {}
    x = torch.full((7,), 2.0 ** g) + 2.0 ** 3 * torch.arange(7.0)
    out["ring_all_reduce"] = _watched(comm.ring_all_reduce, x.clone(), sub)[:2]
    out["ring_reduce_scatter"] = _watched(comm.ring_reduce_scatter, x.clone(), sub)[:2]
    out["ring_all_gather"] = _watched(comm.ring_all_gather, torch.full((g + 1,), float(g)), sub, sizes=[1, 2, 3])[:2]
    y = torch.randn(7, generator=torch.Generator().manual_seed(50 + g))
    want = y.clone()
    dist.all_reduce(want, group=sub)
    out["avg"] = (comm.ring_all_reduce(y, sub, op="avg"), want / 3)
    for algorithm in ("tree", "ring"):
        out[f"broadcast {algorithm}"] = _watched(comm.broadcast, torch.arange(5.0) + 100 * g, src=1, group=sub,
                                                 algorithm=algorithm)[:2]
    return out


@observes("ex01.*.group", "ex01.*.avg")
def test_group_ranks(impl):
    """Every function on the group of world ranks 1, 2, 3 of 4, where group rank g is world rank g+1."""
    where = "on the group of world ranks 1, 2, 3 (its group ranks 0, 1, 2)"
    with breaks("ex01.*.group"):   # the avg check inside names its own clause
        try:
            results = minipar.launch(_on_a_group, 4, timeout=TIMEOUT)[1:]
        except (RankError, LaunchTimeout) as e:
            expect(False, f"{where}: {str(e).splitlines()[0]}")
        sizes = _chunk_ranges(7, 3)
        for g, out in enumerate(results):
            at = f"world rank {g + 1} (group rank {g})"
            for fn in ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "broadcast tree", "broadcast ring"):
                peers = sorted({p for _, p, _ in out[fn][1]})
                expect(set(peers) <= {1, 2, 3}, f"{where}: {fn} on {at} sent to or received from world ranks {peers}")
            expect_contributions(out["ring_all_reduce"][0], 3, range(3), f"{where}: ring_all_reduce, {at}",
                                 positions=torch.arange(7))
            lo, hi = sizes[g]
            expect_contributions(out["ring_reduce_scatter"][0], 3, range(3),
                                 f"{where}: ring_reduce_scatter, {at}: its chunk {g} (elements {lo}..{hi - 1})",
                                 positions=torch.arange(lo, hi))
            expect_close(out["ring_all_gather"][0], torch.tensor([0.0, 1, 1, 2, 2, 2]),
                         f"{where}: ring_all_gather, sizes=[1, 2, 3], group rank g's chunk all g", where=at)
            for algorithm in ("tree", "ring"):
                expect_close(out[f"broadcast {algorithm}"][0], torch.arange(5.0) + 100,
                             f"{where}: broadcast {algorithm} from src=1 (group rank 1, world rank 2)", where=at)
            got, want = out["avg"]
            with breaks("ex01.*.avg"):
                expect_close(got, want, f"{where}: ring_all_reduce(y, group, op='avg') (op=\"avg\" divides by n = 3, "
                             "the group's size)", where=at, rtol=1e-5, atol=1e-5)
