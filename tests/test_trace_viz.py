"""Trace bookkeeping (compute, comm, overlap, idle) and the figures built from it."""
import plotly.graph_objects as go

from minipar import viz
from minipar.trace import Trace


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
