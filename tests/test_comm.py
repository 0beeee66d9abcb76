"""Collectives from scratch against torch.distributed, and their recorded bytes against
the cost model. One launch per world size checks every operation and size, on the ranks'
device (CUDA tensors under ``course.py test --gpu``: NCCL, or staging through host memory)."""
import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import comm

from minipar import cost
from minipar.runtime import trace
SIZES = [1, 7, 64, 1001, 4096]  # smaller than, not divisible by, and divisible by n


def _check_all(sizes):
    r, n, dev = dist.get_rank(), dist.get_world_size(), minipar.device()
    out = {"ok": {}, "bytes": {}}  # minipar's calls on this rank's device, torch's reference on the CPU

    def bytes_of(fn):
        trace.start(r)
        fn()
        return sum(e["bytes_sent"] for e in trace.events())

    for N in sizes:
        x_cpu = torch.randn(N, generator=torch.Generator().manual_seed(1000 * r + N))
        total = x_cpu.clone()
        dist.all_reduce(total)
        x, total = x_cpu.to(dev), total.to(dev)
        y = x.clone()
        out["bytes"][("ring_all_reduce", N)] = bytes_of(lambda: comm.ring_all_reduce(y))
        out["ok"][("ring_all_reduce", N)] = torch.allclose(y, total, atol=1e-5)
        ya = x.clone()
        comm.ring_all_reduce(ya, op="avg")
        out["ok"][("ring_all_reduce avg", N)] = torch.allclose(ya, total / n, atol=1e-5)
        box = {}
        out["bytes"][("ring_reduce_scatter", N)] = bytes_of(
            lambda: box.setdefault("rs", comm.ring_reduce_scatter(x)))
        out["ok"][("ring_reduce_scatter", N)] = torch.allclose(box["rs"], total.tensor_split(n)[r], atol=1e-5)
        mine = total.tensor_split(n)[r]
        sizes_n = [c.numel() for c in total.tensor_split(n)]
        out["bytes"][("ring_all_gather", N)] = bytes_of(
            lambda: box.setdefault("ag", comm.ring_all_gather(mine, sizes=sizes_n)))
        out["ok"][("ring_all_gather", N)] = torch.equal(box["ag"], total)
        for algo in ("tree", "ring"):
            for src in {0, n - 1}:
                b = x.clone()
                out["bytes"][(f"broadcast {algo} src={src}", N)] = bytes_of(
                    lambda: comm.broadcast(b, src=src, algorithm=algo))
                ref = x_cpu.clone()
                dist.broadcast(ref, src)
                ref = ref.to(dev)
                out["ok"][(f"broadcast {algo} src={src}", N)] = torch.equal(b, ref)
        if n & (n - 1) == 0:
            h = x.clone()
            out["bytes"][("halving_doubling_all_reduce", N)] = bytes_of(lambda: comm.halving_doubling_all_reduce(h))
            out["ok"][("halving_doubling_all_reduce", N)] = torch.allclose(h, total, atol=1e-5)
        # the backend's collectives, recorded with the bytes their tensors move
        z = x.clone()
        out["bytes"][("all_reduce", N)] = bytes_of(lambda: comm.all_reduce(z, op="avg"))
        out["ok"][("all_reduce", N)] = torch.allclose(z, total / n, atol=1e-5)
    k = 6
    full = torch.arange(n * k, dtype=torch.float32, device=dev) * (r + 1)
    part = torch.empty(k, device=dev)
    out["bytes"][("reduce_scatter", n * k)] = bytes_of(lambda: comm.reduce_scatter(part, full))
    out["ok"][("reduce_scatter", k)] = torch.equal(part.cpu(), torch.arange(n * k, dtype=torch.float32)[r * k:(r + 1) * k] * n * (n + 1) / 2)
    gathered = torch.empty(n * k, device=dev)
    out["bytes"][("all_gather", n * k)] = bytes_of(
        lambda: comm.all_gather(gathered, torch.full((k,), float(r), device=dev), async_op=True).wait())
    out["ok"][("all_gather async", k)] = torch.equal(gathered.cpu(), torch.arange(n).repeat_interleave(k).float())
    out["device"] = dev.type
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_match_torch_and_bytes_match_the_model(n):
    results = minipar.launch(_check_all, n, args=(SIZES,), timeout=120)
    for rank, res in enumerate(results):
        bad = [k for k, ok in res["ok"].items() if not ok]
        assert not bad, f"rank {rank}: wrong result for {bad}"
        assert res["device"] == results.placement.device  # on a GPU the tensors were CUDA tensors
    for N in SIZES:
        nbytes = 4 * N
        # summed over ranks the ring sends exactly n·formula; per rank exactly when n divides N
        for op, model_op in [("ring_all_reduce", "all_reduce"), ("ring_reduce_scatter", "reduce_scatter"),
                             ("ring_all_gather", "all_gather"), ("halving_doubling_all_reduce", "all_reduce")]:
            if (op, N) not in results[0]["bytes"]:
                continue
            sent = [res["bytes"][(op, N)] for res in results]
            assert sum(sent) == pytest.approx(n * cost.collective_bytes(model_op, nbytes, n)), (op, N, sent)
            if N % n == 0:
                assert sent == [cost.collective_bytes(model_op, nbytes, n)] * n, (op, N, sent)
        for algo in ("tree", "ring"):
            sent = [res["bytes"][(f"broadcast {algo} src=0", N)] for res in results]
            assert sum(sent) == (n - 1) * nbytes  # every rank but the root receives N once
        _formula_agrees(results, "all_reduce", N, cost.collective_bytes)
    for op in ("reduce_scatter", "all_gather"):
        _formula_agrees(results, op, 6 * n, cost.collective_bytes)


def _formula_agrees(results, op, N, formula):
    """The backend's ``op`` on N float32s: the bytes each rank recorded (counted from the tensors
    it handed the backend) against ``formula``: summed over the ranks n·formula, and on each rank
    the formula when n divides N."""
    n, nbytes = len(results), 4 * N
    sent = [res["bytes"][(op, N)] for res in results]
    assert sum(sent) == pytest.approx(n * formula(op, nbytes, n)), (op, N, sent)
    if N % n == 0:
        assert sent == [formula(op, nbytes, n)] * n, (op, N, sent)


def _native_bytes_under(formula):
    """The bytes the backend's collectives record on this rank while the cost formula (everywhere
    it can be reached from) is ``formula``."""
    import minipar.cost as cost_pkg
    import minipar.cost.collectives as cost_mod
    from minipar.comm import native
    n, r, dev = dist.get_world_size(), dist.get_rank(), minipar.device()
    homes = [m for m in (cost_pkg, cost_mod, native) if hasattr(m, "collective_bytes")]
    saved = [m.collective_bytes for m in homes]
    for m in homes:
        m.collective_bytes = formula
    out = {}

    def sent(fn):  # a staged call (CUDA tensors over Gloo) adds host copies, events of kind staging
        trace.start(r)
        fn()
        return sum(e["bytes_sent"] for e in trace.events() if e["kind"] == "comm")   # the operations, not host copies
    try:   # on the rank's device: CUDA tensors under ``course.py test --gpu``
        for N in (12, 7):
            out[("all_reduce", N)] = sent(lambda: comm.all_reduce(torch.ones(N, device=dev)))
        out[("reduce_scatter", 4 * n)] = sent(
            lambda: comm.reduce_scatter(torch.empty(4, device=dev), torch.ones(4 * n, device=dev)))
        out[("all_gather", 4 * n)] = sent(
            lambda: comm.all_gather(torch.empty(4 * n, device=dev), torch.ones(4, device=dev)))
    finally:
        for m, f in zip(homes, saved):
            m.collective_bytes = f
    return {"bytes": out}


def _wrong_formula(op, nbytes, n):
    """A planted mistake: the all-reduce's factor 2 dropped."""
    return (n - 1) / n * nbytes


def test_recorded_bytes_come_from_the_tensors_so_a_wrong_formula_fails():
    """Not circular: with the formula replaced by a wrong one inside the ranks, the recorded bytes
    do not change (they are counted from the tensors moved), so the check against the right
    formula passes and the check against the planted one fails (3 ranks: 12 elements divide
    evenly, 7 do not)."""
    results = minipar.launch(_native_bytes_under, 3, args=(_wrong_formula,), timeout=120)
    for op, N in results[0]["bytes"]:
        _formula_agrees(results, op, N, cost.collective_bytes)
    with pytest.raises(AssertionError):
        _formula_agrees(results, "all_reduce", 12, _wrong_formula)


def _halving_on_three():
    comm.halving_doubling_all_reduce(torch.ones(4))


def test_halving_doubling_needs_a_power_of_two():
    with pytest.raises(minipar.RankError, match="power-of-two"):
        minipar.launch(_halving_on_three, 3)


def _sized_for_a_pair(op):
    """Buffers sized for a group of 2, the collective run on the world of 4."""
    dev = minipar.device()
    if op == "reduce_scatter":
        comm.reduce_scatter(torch.empty(2, device=dev), torch.ones(4, device=dev))
    else:
        comm.all_gather(torch.empty(4, device=dev), torch.ones(2, device=dev))


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_buffers_sized_for_another_group_are_a_plain_error(op):
    """Before the backend sees them: on some torch versions Gloo aborts the process on them, which
    a learner would read as a rank that died without a result."""
    with pytest.raises(minipar.RankError, match=rf"ValueError: {op} over a group of 4 ranks needs "
                                                 rf"(input|output) = 4 × (output|input) elements; got 4 and 2"):
        minipar.launch(_sized_for_a_pair, 4, args=(op,))


def _in_subgroups():
    r, dev = dist.get_rank(), minipar.device()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    g = groups[r % 2]
    x = torch.tensor([float(r)] * 5, device=dev)
    comm.ring_all_reduce(x, group=g)
    y = torch.tensor([float(r)], device=dev)
    comm.broadcast(y, src=1, group=g)  # group rank 1 = global rank 2 or 3
    return x[0].item(), y.item()


def test_collectives_work_on_subgroups():
    assert list(minipar.launch(_in_subgroups, 4)) == [(2.0, 2.0), (4.0, 3.0), (2.0, 2.0), (4.0, 3.0)]


def _kinds_and_groups():
    r, dev = dist.get_rank(), minipar.device()
    pair = [dist.new_group([0, 2]), dist.new_group([1, 3])][r % 2]
    trace.start(r)
    comm.all_reduce(torch.ones(4, device=dev), group=pair, name="ar")
    comm.all_to_all_single(torch.empty(4, device=dev), torch.ones(4, device=dev), name="a2a")
    comm.all_gather(torch.empty(8, device=dev), torch.ones(4, device=dev), group=pair, name="ag")
    if r in (1, 3):                          # group rank 1 of [1, 3] is global rank 3
        buf = torch.ones(2, device=dev)
        (comm.send if r == 1 else comm.recv)(buf, 1 - dist.get_rank(pair), group=pair, name="p2p")
    return [(e["name"], e["op"], e["group"]) for e in trace.events() if e["kind"] == "comm"]


def test_every_comm_event_records_its_kind_and_the_group_it_ran_on():
    """Each event from :mod:`minipar.comm` names its operation and its group's global ranks (in
    group-rank order), so a check can ask "one all-to-all over the ep group" of the record itself."""
    got = minipar.launch(_kinds_and_groups, 4)
    for r, events in enumerate(got):
        pair = [0, 2] if r % 2 == 0 else [1, 3]
        want = [("ar", "all_reduce", pair), ("a2a", "all_to_all", [0, 1, 2, 3]), ("ag", "all_gather", pair)]
        want += {1: [("p2p", "send", [1, 3])], 3: [("p2p", "recv", [1, 3])]}.get(r, [])
        assert events == want, (r, events)
