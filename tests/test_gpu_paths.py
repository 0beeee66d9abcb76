"""The GPU paths, checked on the CPU: NCCL's rules and CUDA's clocks played by fakes.

* NCCL builds a pair's communicator at the pair's first operation and blocks until both
  peers join; a ring whose ranks all post their send to the right first forms a cycle of
  waits (3 ranks and more). :func:`nccl_stuck` plays that rule on the posts minipar makes.
* NCCL work completes its future once *queued*: its duration must come from CUDA events.
"""
import types

import pytest
import torch

from minipar.runtime import backend, flight

from minipar.runtime import trace
from minipar.comm import p2p
from minipar.runtime import staging, transport

NCCL = backend.place(4, "cuda", gpus=4)  # a GPU per rank: the placement rank code asks


def nccl_stuck(programs):
    """The ranks left stuck when each rank ``r`` posts ``programs[r]`` in order under NCCL's
    lazy initialisation: ``("p2p", peer)`` (a lone isend/irecv) waits, the first time its pair
    is used, until the peer's next post is on the same pair; ``("batch", peers)`` (one
    ``batch_isend_irecv``) waits, the first time the group batches, until every rank's next
    post is a batch (the group's communicator is built collectively), and never after."""
    n, pc, pairs, group_ready = len(programs), [0] * len(programs), set(), False

    def at(q):
        return programs[q][pc[q]] if pc[q] < len(programs[q]) else None

    moved = True
    while moved:
        moved = False
        for r in range(n):
            post = at(r)
            if post is None:
                continue
            kind, peer = post
            if kind == "batch" and not group_ready:
                if not all(at(q) is not None and at(q)[0] == "batch" for q in range(n)):
                    continue
                group_ready = True
            if kind == "p2p" and frozenset((r, peer)) not in pairs:
                if at(peer) != ("p2p", r):
                    continue
                pairs.add(frozenset((r, peer)))
            pc[r], moved = pc[r] + 1, True
    return [r for r in range(n) if at(r) is not None]


class FakeWork:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("wait")

    def get_future(self):  # NCCL's future: completes at once, when the work is queued
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def fake_dist(log):
    """The part of ``torch.distributed`` that ``comm.exchange`` uses, recording each post."""
    d = types.SimpleNamespace()
    d.isend = lambda t, dst, group=None, tag=0: (log.append(("p2p", dst)), FakeWork(log))[1]
    d.irecv = lambda t, src, group=None, tag=0: (log.append(("p2p", src)), FakeWork(log))[1]
    d.P2POp = lambda op, t, peer, group=None, tag=0: (op, peer)
    d.batch_isend_irecv = lambda ops: (log.append(("batch", tuple(p for _, p in ops))),
                                       [FakeWork(log) for _ in ops])[1]
    d.get_global_rank = lambda group, r: r
    d.is_initialized = lambda: False          # no process group: events record no group
    d.group = types.SimpleNamespace(WORLD=object())
    return d


class FakeCudaTensor:
    """What ``comm.exchange`` reads of a CUDA tensor (no GPU needed)."""

    is_cuda, device, shape, dtype = True, torch.device("cuda", 0), (4,), torch.float32

    def numel(self):
        return 4

    def element_size(self):
        return 4

    def contiguous(self):
        return self


class FakeEvent:
    """A CUDA event whose ``elapsed_time`` is given: the device's clock, played."""
    ms = 5.0
    done = True

    def __init__(self, enable_timing=False):
        self.recorded = 0

    def record(self, stream=None):
        self.recorded += 1

    def query(self):
        return FakeEvent.done

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return FakeEvent.ms


@pytest.fixture
def nccl(monkeypatch):
    """A world whose backend is ``cpu:gloo,cuda:nccl``, posts recorded, CUDA events faked."""
    log = []
    monkeypatch.setattr(p2p, "dist", fake_dist(log))
    monkeypatch.setattr(backend, "_current", NCCL)
    monkeypatch.setattr(transport, "group_backend", lambda group: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return log


def _ring_posts(n, make_tensor, log):
    """The posts each rank of a ring of ``n`` makes for one ``exchange`` to the right."""
    programs = []
    for r in range(n):
        log.clear()
        p2p.exchange(make_tensor(), (r + 1) % n, make_tensor(), (r - 1) % n, name="ring")
        programs.append([post for post in log if post != "wait"])
    return programs


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_simulated_nccl_rule_hangs_separate_posts_from_3_ranks_and_not_batched_ones(n, nccl):
    """Under NCCL's lazy pair initialisation a ring of separate isend/irecv posts (what
    ``exchange`` posts on Gloo) hangs every rank from 3 ranks on; the batch it posts for CUDA
    tensors under NCCL never hangs."""
    separate = _ring_posts(n, lambda: torch.zeros(4), nccl)  # CPU tensors: the Gloo half
    assert all(p == [("p2p", (r + 1) % n), ("p2p", (r - 1) % n)] for r, p in enumerate(separate))
    assert nccl_stuck(separate) == ([] if n == 2 else list(range(n)))
    batched = _ring_posts(n, FakeCudaTensor, nccl)
    assert batched == [[("batch", ((r + 1) % n, (r - 1) % n))] for r in range(n)]
    assert nccl_stuck(batched) == []
    assert nccl_stuck(batched * 3) == []  # several steps: batches only


def test_context_parallel_ring_posts_one_exchange(monkeypatch):
    """Ring attention's K/V step goes through ``comm.start_exchange`` (one batch under NCCL)."""
    from minipar.context_parallel import ring
    calls = []

    def start_exchange(send, dst, recv, src, group=None, name="", tag=0, **labels):
        calls.append((dst, src, name, tag, labels["dim"]))
        recv.fill_(7.0)
        return types.SimpleNamespace(wait=lambda: None)
    monkeypatch.setattr(ring.comm, "start_exchange", start_exchange)
    got = ring._start_exchange(torch.zeros(2, 3), 2, 1, None, "ring_kv", 0)()
    assert calls == [(1, 2, "ring_kv", 0, "cp")] and torch.equal(got, torch.full((2, 3), 7.0))


def test_nccl_ranks_bind_their_gpu_at_init():
    """``init_process_group`` gets ``device_id`` under NCCL (eager init), nothing otherwise."""
    from minipar.runtime.backend import init_options
    assert init_options("cpu:gloo,cuda:nccl", "cuda:1") == {"device_id": torch.device("cuda", 1)}
    assert init_options("gloo", "cuda:0") == {} and init_options("gloo", "cpu") == {}


def test_nccl_durations_come_from_cuda_events_not_the_queued_future(nccl):
    """A transfer that NCCL queued at once but the device ran for 5 ms lasts 5 ms."""
    FakeEvent.ms, FakeEvent.done = 5.0, True
    trace.start(0, barrier=False)
    p2p.exchange(FakeCudaTensor(), 1, FakeCudaTensor(), 1, name="ring")
    (e,) = trace.events()
    assert e["end"] - e["start"] == pytest.approx(5e-3)
    assert e["bytes_sent"] == e["bytes_recv"] == 16


def test_the_flight_recorder_keeps_nccl_work_waiting_until_the_device_finished(nccl):
    """With recording off the host does not wait for the device: the flight recorder asks
    the end event, and says "waiting" until it has passed."""
    flight.reset()
    FakeEvent.done = False
    with trace.recording(False):
        p2p.exchange(FakeCudaTensor(), 1, FakeCudaTensor(), 1, name="ring")
    (entry,) = flight.entries()
    assert "waiting inside it" in flight.describe(entry)
    FakeEvent.done = True
    assert "finished" in flight.describe(entry)
    flight.reset()


def test_gloo_work_is_still_timed_by_the_host(monkeypatch):
    """Off NCCL no CUDA event is made (the Gloo path is as it was): the placement's clock is the host's."""
    for p in (backend.place(2, "cpu"), backend.place(2, "cpu", transport="gloo-staged"), backend.place(4, "cuda", gpus=1)):
        monkeypatch.setattr(backend, "_current", p)
        assert p.clock == "host" and p2p.device_clock(torch.zeros(2), None) is None
    assert NCCL.clock == "device"


def test_the_parameter_server_receives_from_any_worker_on_the_cpu_through_gloo(monkeypatch):
    """NCCL has no any-source receive: the server's ``irecv(src=None)`` gets a CPU tensor on a
    group with Gloo (``cpu:gloo,cuda:nccl`` hands it to Gloo); a device tensor or a group
    without Gloo is a plain error."""
    import importlib
    ps = importlib.import_module("minipar.data_parallel.parameter_server")  # the module
    got = []

    class Work(FakeWork):
        def _source_rank(self):
            return 2

        def get_future(self):
            raise RuntimeError("no future")

    def irecv(t, src=None, group=None, tag=0):
        got.append((t.device.type, src))
        t.fill_(1.0)
        return Work([])
    monkeypatch.setattr(ps.dist, "irecv", irecv)
    monkeypatch.setattr(transport, "group_backend", lambda group: "cpu:gloo,cuda:nccl")
    buf = torch.zeros(5)  # placement-free: the group's backend is faked
    assert ps._recv_any(buf, None) == 2 and got == [("cpu", None)] and buf.eq(1).all()
    with pytest.raises(ValueError, match="needs a CPU tensor on a group with Gloo"):
        ps._recv_any(torch.zeros(2, device="meta"), None)
    monkeypatch.setattr(transport, "group_backend", lambda group: "nccl")
    with pytest.raises(ValueError, match="on a nccl group"):
        ps._recv_any(buf, None)


def test_recording_off_means_no_synchronization(monkeypatch):
    """A region waits for the GPU at both ends only while recording: 10 regions and a
    backward cost 22 waits recording, none with recording off (``python -m minipar.train``,
    the benchmarks), and record nothing."""
    waits = []
    monkeypatch.setattr(trace, "_sync", lambda: waits.append(1))
    w = torch.ones(3, requires_grad=True)

    def step():
        for i in range(10):
            with trace.region("forward", layer=i):
                loss = (w * 2).sum()
        trace.backward(loss)
    trace.start(0, barrier=False)
    step()
    assert len(waits) == 22 and len(trace.events()) == 11
    waits.clear()
    trace.start(0, barrier=False)
    with trace.recording(False):
        step()
    assert waits == [] and trace.events() == [] and w.grad is not None


def _ep_forward_host_copies():
    """In a rank: how many ``.cpu()``/``.item()`` an EP layer's forward makes, recording off."""
    from minipar import expert_parallel
    from minipar.models.moe import MoE
    torch.manual_seed(0)
    layer = expert_parallel.ExpertParallelMoE(MoE(8, 4, 2, 1.0, hidden=16))
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    calls = []
    real = {name: getattr(torch.Tensor, name) for name in ("cpu", "item")}
    for name, fn in real.items():
        setattr(torch.Tensor, name, lambda self, *a, _f=fn, _n=name, **k: (calls.append(_n), _f(self, *a, **k))[1])
    try:
        with trace.recording(False):
            layer(x)
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
    return calls, sorted(layer.stats), layer.stats["kept"].tolist()


def test_the_ep_layer_copies_nothing_to_the_host_for_its_statistics():
    """The six routing statistics stay on the device until read: with recording off a
    forward makes no ``.cpu()`` or ``.item()`` (the split sizes the all-to-all needs are its
    only host reads); the statistics are still all there."""
    import minipar
    res = minipar.launch(_ep_forward_host_copies, 2, device="cpu", timeout=60)
    for calls, keys, kept in res:
        assert calls == [], calls
        assert keys == ["aux", "capacity", "counts", "dropped", "experts", "kept", "matrix", "z"]
        assert len(kept) == 2 and len(kept[0]) == 4


def test_staging_waits_for_queued_kernels_before_its_event_starts(monkeypatch):
    """``to_host``'s device-to-host copy would first drain the queue (a backward, say): when
    recording, the stream is synchronized before the start is stamped; not when off."""
    log = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(synchronize=lambda: log.append("sync")))
    monkeypatch.setattr(staging.trace, "now", lambda: log.append("clock") or 0.0)

    class Host:
        def copy_(self, src):
            log.append("copy")
            return self
    monkeypatch.setattr(staging, "host_like", lambda t: Host())
    staging.to_host(FakeCudaTensor(), "all_reduce", {"dim": "dp"})
    assert log == ["sync", "clock", "copy", "clock"]
    log.clear()
    with trace.recording(False):
        staging.to_host(FakeCudaTensor(), "all_reduce", {"dim": "dp"})
    assert log == ["clock", "copy", "clock"]


def _host_reads(fn, names=("cpu", "item", "tolist", "nonzero", "__float__")):
    """The host reads (``Tensor.cpu``/``item``/``tolist``/``nonzero``/``float()``) ``fn`` makes,
    recording off, in call order."""
    calls, real = [], {name: getattr(torch.Tensor, name) for name in names}
    for name, f in real.items():
        setattr(torch.Tensor, name, lambda self, *a, _f=f, _n=name, **k: (calls.append(_n), _f(self, *a, **k))[1])
    try:
        with trace.recording(False):
            fn()
    finally:
        for name, f in real.items():
            setattr(torch.Tensor, name, f)
    return calls


def test_the_moe_layer_reads_the_host_once_per_forward_not_per_expert():
    """One host read per MoE forward (the kept assignments per expert, which cut the tokens into
    the experts' batches), whatever the number of experts; the statistics stay on the device;
    the layer's output is the one of routing expert by expert."""
    from minipar.models.moe import MoE
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(1))
    for n_experts in (4, 8):
        torch.manual_seed(0)
        layer = MoE(8, n_experts, 2, 1.0, hidden=16)
        assert _host_reads(lambda: layer(x)) == ["tolist"]
        y, kept = layer(x), layer.stats["kept"]
        want = torch.zeros(24, 8)
        flat, expert_of = x.reshape(24, 8), layer.stats["experts"].reshape(-1)
        weights = torch.softmax(layer.router(flat), -1).gather(1, layer.stats["experts"])
        weights = weights / weights.sum(-1, keepdim=True)
        keep = ~layer.stats["dropped"]
        for a in range(48):  # every assignment kept, expert by expert
            if keep[a]:
                want[a // 2] += layer.experts[int(expert_of[a])](flat[a // 2]) * weights.reshape(-1)[a]
        torch.testing.assert_close(y.reshape(24, 8), want, rtol=1e-5, atol=1e-6)
        assert int(kept.sum()) == int(keep.sum()) < 48 and kept.device == x.device


def test_the_pipeline_reads_the_loss_once_per_step_not_per_microbatch(monkeypatch):
    """The last stage adds its m micro-batch losses on the device and reads the sum once at the
    end of the step (``float``), not once per micro-batch; the value is the batch's mean loss."""
    import torch.nn as nn
    from minipar import pipeline as pp
    from minipar.pipeline import executor
    monkeypatch.setattr(executor, "group_rank", lambda g: 0)
    monkeypatch.setattr(executor, "group_size", lambda g: 1)
    torch.manual_seed(0)
    stage = nn.Linear(3, 3)
    x, y = torch.randn(8, 3), torch.zeros(8)
    loss_fn = lambda out, t: out.square().mean()  # noqa: E731
    for m in (2, 4, 8):
        pipe = executor.Pipeline({0: stage}, pp.make_schedule("1f1b", 1, m), (8 // m, 3), loss_fn=loss_fn)
        got = []
        assert _host_reads(lambda: got.append(pipe.step(x, y))) == ["__float__"]
        want = sum(loss_fn(stage(c), None).item() for c in x.chunk(m)) / m
        assert got[0] == pytest.approx(want, rel=1e-6)
