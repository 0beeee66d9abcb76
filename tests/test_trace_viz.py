"""Trace bookkeeping (compute, comm, overlap, idle) and the figures built from it."""
import plotly.graph_objects as go

from minipar.runtime import viz
from minipar.runtime.trace import Trace


def _ev(rank, kind, name, s, e, sent=0, **labels):
    return {"rank": rank, "kind": kind, "name": name, "start": s, "end": e, "bytes_sent": sent,
            "bytes_recv": sent, "labels": labels}


TRACE = Trace([
    [_ev(0, "compute", "forward", 0.0, 1.0, microbatch=0), _ev(0, "compute", "backward", 1.0, 3.0),
     _ev(0, "comm", "all_reduce", 2.0, 4.0, sent=100)],
    [_ev(1, "compute", "forward", 1.0, 2.0, microbatch=0), _ev(1, "comm", "recv", 0.0, 1.0, sent=8)],
])


def test_summary_counts_overlap_and_idle():
    s0, s1 = TRACE.summary()
    assert s0["span"] == 4.0 and s0["compute"] == 3.0 and s0["comm"] == 2.0
    assert s0["overlap"] == 1.0 and s0["idle"] == 0.0 and s0["bytes_sent"] == 100
    assert s1["compute"] == 1.0 and s1["comm"] == 1.0 and s1["idle"] == 2.0


def test_event_queries():
    assert TRACE.bytes_sent(0) == 100 and TRACE.bytes_sent(0, "recv") == 0
    assert [e["name"] for e in TRACE.events(kind="compute")] == ["forward", "backward", "forward"]


def test_figures_have_the_expected_traces():
    fig = viz.timeline(TRACE)
    assert isinstance(fig, go.Figure)
    names = {t.name for t in fig.data}
    assert {"idle", "compute", "comm"} <= names
    comp = next(t for t in fig.data if t.name == "compute")
    assert list(comp.y) == ["rank 0", "rank 0", "rank 1"] and list(comp.base) == [0.0, 1000.0, 1000.0]
    by_mb = viz.timeline(TRACE, color_by="microbatch")
    assert {"0", "backward", "all_reduce", "recv"} <= {t.name for t in by_mb.data}
    assert len(viz.summary_bars(TRACE).data) == 3
    mem = viz.memory([{"params": 2**20, "grads": 2**20}, {"params": 2**20}], theory=[2**21, 2**20])
    assert [t.name for t in mem.data] == ["params", "grads", "theory"]
    bw = viz.bandwidth([1, 10], {"a": [1, 2]}, model={"m": [1, 1]})
    assert len(bw.data) == 2
    assert len(viz.loss_curves({"a": [3, 2], "b": [3, 1]}).data) == 2


def test_explore_draws_the_defaults_statically_or_builds_controls(monkeypatch):
    calls = []

    def draw(op="all_reduce", n=4):
        calls.append((op, n))
        return viz.collective_diagram(op, n)

    monkeypatch.setenv("MINIPAR_STATIC_WIDGETS", "1")
    fig = viz.explore(draw, op=["all_reduce", "all_gather"], n=(2, 8))
    assert isinstance(fig, go.Figure) and calls == [("all_reduce", 4)]
    monkeypatch.delenv("MINIPAR_STATIC_WIDGETS")
    w = viz.explore(draw, op=["all_gather", "all_reduce"], n=(2, 8))
    assert [c.description for c in w.children[:2]] == ["op", "n"]
    assert calls[-1] == ("all_gather", 5)  # ipywidgets drew the first menu item, the range's middle


def test_bubble_is_idle_over_the_union_of_compute():
    """Trace.bubble: (T - c)/c per rank, T the span of all compute, c the union of the rank's
    compute (a region nested in another counts once), communication not counted as work."""
    t = Trace([[_ev(0, "compute", "step", 0.0, 4.0), _ev(0, "compute", "forward", 1.0, 2.0)],
               [_ev(1, "compute", "forward", 1.0, 3.0), _ev(1, "comm", "recv", 0.0, 1.0)]])
    assert t.bubble() == [0.0, 1.0]


def test_marks_and_bytes_by_dimension():
    """trace.since(mark) returns only what was recorded after the mark; bytes add up by the
    events' dim label."""
    from minipar.runtime import trace
    trace.start(0, barrier=False)
    trace.record("comm", "a", 0.0, 1.0, 10, labels={"dim": "tp"})
    m = trace.mark()
    trace.record("comm", "b", 1.0, 2.0, 7, labels={"dim": "dp"})
    trace.record("comm", "c", 2.0, 3.0, 5, labels={"dim": "tp"})
    trace.record("compute", "forward", 2.0, 3.0)
    evs = trace.since(m)
    assert [e["name"] for e in evs] == ["b", "c", "forward"] and trace.since(trace.mark()) == []
    assert trace.bytes_by_dim(evs) == {"dp": 7, "tp": 5, "total": 12}
    assert TRACE.bytes_by_dim(0) == {None: 100, "total": 100}


def _comm_events():
    import time

    import torch
    import torch.distributed as dist

    from minipar import comm

    from minipar.runtime import trace
    g = dist.new_group([0, 1])
    comm.name_group(g, "tp")
    t = torch.ones(1000)
    m = trace.mark()
    h = comm.all_reduce(t, group=g, async_op=True, name="late_wait")
    deadline = time.monotonic() + 30
    while not h._ends and time.monotonic() < deadline:   # until the backend said it completed
        time.sleep(0.001)
    seen = trace.now()                     # the all-reduce finished before this moment; we wait after
    h.wait()
    comm.all_reduce(t, name="on_world")
    return trace.since(m), seen


def test_comm_events_end_when_done_and_carry_their_dimension():
    """An async collective's event ends when it completed, not when it was waited for; every
    communication event is labelled with its group's dimension (the world: "world")."""
    import minipar
    for (late, world), seen in minipar.launch(_comm_events, 2, timeout=60):
        assert late["labels"]["dim"] == "tp" and world["labels"]["dim"] == "world"
        assert late["start"] <= late["end"] <= seen <= world["start"] <= world["end"], (late, seen, world)


def _visible(fig, name):
    """Bars of trace ``name`` not wholly covered by a bar at least as wide drawn after them."""
    bars = [(i, t) for i, t in enumerate(fig.data) if t.type == "bar" and t.name != "idle"]
    out = 0
    for i, t in bars:
        if t.name != name:
            continue
        for y, x, b in zip(t.y, t.x, t.base):
            covered = any(y2 == y and b2 <= b and b2 + x2 >= b + x and (u.width or 0) >= (t.width or 0)
                          for j, u in bars if j > i for y2, x2, b2 in zip(u.y, u.x, u.base))
            out += not covered
    return out


def test_timeline_keeps_what_a_region_contains_visible():
    """Notebook 09's figure: an outer region around the MoE layer must not hide its two
    all-to-alls (nor the counts exchange, nor the experts' compute)."""
    rank = [_ev(0, "compute", "router+experts forward", 0.0, 10.0),
            _ev(0, "comm", "ep_counts", 1.0, 1.5, sent=64, dim="ep"),
            _ev(0, "comm", "ep_dispatch", 2.0, 3.0, sent=800, dim="ep"),
            _ev(0, "compute", "experts", 3.0, 7.0),
            _ev(0, "comm", "ep_combine", 7.0, 8.0, sent=800, dim="ep"),
            _ev(0, "compute", "backward", 10.0, 20.0),
            _ev(0, "comm", "ep_combine_backward", 11.0, 12.0, sent=800, dim="ep"),
            _ev(0, "comm", "ep_dispatch_backward", 15.0, 16.0, sent=800, dim="ep")]
    fig = viz.timeline(Trace([rank]), color_by="name")
    for name in ("ep_counts", "ep_dispatch", "ep_combine", "experts", "ep_combine_backward", "ep_dispatch_backward"):
        assert _visible(fig, name) == 1, name
    assert _visible(fig, "router+experts forward") == 1 and _visible(fig, "backward") == 1
