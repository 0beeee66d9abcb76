"""Plotly figures the chapters share: rank timelines, bandwidth, memory, loss curves.

Every function returns a ``plotly.graph_objects.Figure`` (plain figures render in JupyterLab,
Colab and headless runs alike; no widget needed)."""
from __future__ import annotations

import inspect
import os

import plotly.graph_objects as go

from .trace import Trace

COLORS = {"compute": "#4C78A8", "comm": "#F58518", "staging": "#B279A2", "idle": "#E6E6E6"}
_PALETTE = ["#4C78A8", "#72B7B2", "#54A24B", "#EECA3B", "#B279A2", "#FF9DA6", "#9D755D",
            "#BAB0AC", "#E45756", "#F58518", "#2E91E5", "#1CA71C", "#FB0D0D", "#DA16FF",
            "#222A2A", "#B68100", "#750D86", "#EB663B", "#511CFB", "#00A08B", "#FB00D1",
            "#FC0080", "#B2828D", "#6C7C32", "#778AAE", "#862A16"]  # 26 distinct colours


def color(k: int) -> str:
    """The k-th colour of the palette the timelines use (cycling): one per series."""
    return _PALETTE[k % len(_PALETTE)]


def _label(e: dict) -> str:
    lab = ", ".join(f"{k}={v}" for k, v in e["labels"].items())
    b = f"<br>sent {e['bytes_sent']:,} B, received {e['bytes_recv']:,} B" if e["kind"] == "comm" else ""
    return f"{e['name']} ({e['kind']})<br>{lab}<br>{1e3 * (e['end'] - e['start']):.2f} ms{b}"


def timeline(trace: Trace, title: str = "What each rank did", color_by: str = "kind",
             unit: str = "ms", height: int | None = None, text: str | None = None) -> go.Figure:
    """One row per rank; bars for compute and communication, grey gaps for idle time.

    Communication is drawn as thin bars on top of compute, so a transfer in flight while the rank
    computes (overlap) stays visible. Nested regions stay visible too: the compute groups are drawn
    longest event first, so what a region contains is drawn over it (a ``region("forward")`` around
    a layer does not hide the layer's own events). ``color_by="kind"`` colours compute blue and communication orange;
    ``color_by="name"`` (or a label such as ``"microbatch"``) gives each value its own colour.
    Hover a bar for its labels, duration and bytes; ``text``: a label written inside each compute
    bar (``"action"``: ``F0``, ``B1`` ...)."""
    scale = {"ms": 1e3, "s": 1.0}[unit]
    fig = go.Figure()
    rows = [f"rank {r}" for r in range(trace.world_size)]
    t0 = min((e["start"] for e in trace.events()), default=0.0)
    t1 = max((e["end"] for e in trace.events()), default=0.0)
    fig.add_bar(y=rows, x=[(t1 - t0) * scale] * len(rows), base=[0] * len(rows), orientation="h",
                marker_color=COLORS["idle"], name="idle", hoverinfo="skip", width=0.7, legendrank=5000,
                customdata=[s["idle"] for s in trace.summary()])
    groups: dict[str, list[dict]] = {}
    for e in trace.events():
        key = e["kind"] if color_by == "kind" else str(e["labels"].get(color_by, e["name"])
                                                        if color_by != "name" else e["name"])
        groups.setdefault(key, []).append(e)
    keys = sorted(groups)
    colours = {k: COLORS.get(k) if color_by == "kind" else color(i) for i, k in enumerate(keys)}
    shown = set()
    longest = {k: max(e["end"] - e["start"] for e in groups[k]) for k in keys}
    for is_comm, width in ((False, 0.7), (True, 0.3)):  # compute, outer regions first; then comm, thin, on top
        for key in (sorted(keys, key=lambda k: -longest[k]) if not is_comm else keys):
            evs = [e for e in groups[key] if (e["kind"] != "compute") == is_comm]  # comm, staging: thin
            if not evs:
                continue
            fig.add_bar(y=[f"rank {e['rank']}" for e in evs],
                        x=[(e["end"] - e["start"]) * scale for e in evs],
                        base=[(e["start"] - t0) * scale for e in evs], orientation="h", width=width,
                        marker_color=colours[key], marker_line_width=0.5, marker_line_color="white",
                        name=key, legendgroup=key, showlegend=key not in shown,
                        legendrank=1000 + keys.index(key) if is_comm else 10 + keys.index(key),
                        hovertext=[_label(e) for e in evs], hoverinfo="text",
                        text=[str(e["labels"].get(text, "")) for e in evs] if text and not is_comm else None,
                        textposition="inside", insidetextanchor="middle")
            shown.add(key)
    fig.update_layout(barmode="overlay", title=title, xaxis_title=f"time ({unit})",
                      yaxis=dict(autorange="reversed"), bargap=0.3,
                      height=height or max(170 + 45 * trace.world_size, 190 + 30 * (len(keys) + 1)),
                      legend_title=color_by)
    return fig


def summary_bars(trace: Trace, title: str = "Where the time went") -> go.Figure:
    """Stacked bars per rank: compute, communication not hidden by compute, idle."""
    s = trace.summary()
    ranks = [f"rank {r['rank']}" for r in s]
    fig = go.Figure()
    fig.add_bar(x=ranks, y=[r["compute"] * 1e3 for r in s], name="compute", marker_color=COLORS["compute"])
    fig.add_bar(x=ranks, y=[(r["comm"] - r["overlap"]) * 1e3 for r in s], name="comm (exposed)",
                marker_color=COLORS["comm"])
    fig.add_bar(x=ranks, y=[r["idle"] * 1e3 for r in s], name="idle", marker_color="#BBBBBB")
    fig.update_layout(barmode="stack", title=title, yaxis_title="ms")
    return fig


def bandwidth(sizes: list[float], series: dict[str, list[float]], title: str = "Bandwidth",
              model: dict[str, list[float]] | None = None, ylabel: str = "time (ms)") -> go.Figure:
    """Measured curves (markers) and model curves (dashed) against message size, log-log;
    the i-th model curve takes the colour of the i-th measured one."""
    fig = go.Figure()
    for curves, mode, dash in ((series, "lines+markers", None), (model or {}, "lines", "dash")):
        for i, (name, ys) in enumerate(curves.items()):
            fig.add_scatter(x=sizes, y=ys, mode=mode, line_dash=dash, name=name, line_color=color(i))
    fig.update_layout(title=title, xaxis_title="message size (bytes)", yaxis_title=ylabel,
                      xaxis_type="log", yaxis_type="log")
    return fig


def memory(per_rank: list[dict[str, float]], title: str = "Memory per rank",
           theory: list[float] | None = None, unit: str = "MiB") -> go.Figure:
    """Stacked bars per rank, one colour per component (``{"params": bytes, ...}``);
    ``theory`` (bytes per rank) is drawn as a marker to compare with."""
    div = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    ranks = [f"rank {r}" for r in range(len(per_rank))]
    fig = go.Figure()
    for key in dict.fromkeys(k for d in per_rank for k in d):  # components in order of appearance
        fig.add_bar(x=ranks, y=[d.get(key, 0) / div for d in per_rank], name=key)
    if theory is not None:
        fig.add_scatter(x=ranks, y=[t / div for t in theory], mode="markers", name="theory",
                        marker=dict(symbol="line-ew-open", size=40, color="black", line_width=3))
    fig.update_layout(barmode="stack", title=title, yaxis_title=unit)
    return fig


def loss_curves(curves: dict[str, list[float]], title: str = "Training loss",
                x: dict[str, list[float]] | None = None, xlabel: str = "step") -> go.Figure:
    """Loss against step (or against ``x[name]``, e.g. wall time) for each named run."""
    fig = go.Figure()
    for name, ys in curves.items():
        fig.add_scatter(x=(x or {}).get(name, list(range(len(ys)))), y=ys, mode="lines", name=name)
    fig.update_layout(title=title, xaxis_title=xlabel, yaxis_title="loss")
    return fig


def collective_diagram(op: str, n: int = 4) -> go.Figure:
    """Before/after picture of a collective on ``n`` ranks: rank rows, chunk columns. Each cell
    names what a rank holds in that chunk: ``a2`` is rank a's chunk 2, ``Σ2`` the sum of everyone's
    chunk 2; blank cells hold nothing that matters."""
    from plotly.subplots import make_subplots  # deferred: plotly, heavy, only when drawing
    letters = "abcdefgh"

    def grid(cell):  # cell(r, c): what rank r holds in chunk c
        return [[cell(r, c) for c in range(n)] for r in range(n)]
    own = grid(lambda r, c: f"{letters[r]}{c}")
    root = grid(lambda r, c: f"a{c}" if r == 0 else "")
    diagonal = grid(lambda r, c: f"{letters[r]}{c}" if c == r else "")
    cases = {"broadcast": (root, grid(lambda r, c: f"a{c}")),   # (before, after)
             "reduce": (own, grid(lambda r, c: f"Σ{c}" if r == 0 else "")),
             "all_reduce": (own, grid(lambda r, c: f"Σ{c}")),
             "reduce_scatter": (own, grid(lambda r, c: f"Σ{c}" if c == r else "")),
             "all_gather": (diagonal, grid(lambda r, c: f"{letters[c]}{c}")),
             "scatter": (root, grid(lambda r, c: f"a{c}" if c == r else "")),
             "gather": (diagonal, grid(lambda r, c: f"{letters[c]}{c}" if r == 0 else ""))}
    if op not in cases:
        raise ValueError(f"unknown collective {op!r}")
    before, after = cases[op]

    def shade(cells):
        return [[0 if not v else (2 if v.startswith("Σ") else 1 + 0.1 * letters.index(v[0]))
                 for v in row] for row in cells]
    fig = make_subplots(1, 2, subplot_titles=("before", "after"), horizontal_spacing=0.08)
    for i, cells in enumerate((before, after), start=1):
        fig.add_heatmap(z=shade(cells), text=cells, texttemplate="%{text}", showscale=False,
                        colorscale=[[0, "#F2F2F2"], [0.5, "#9ECAE9"], [1, "#F58518"]], zmin=0, zmax=2,
                        x=[f"chunk {c}" for c in range(n)], y=[f"rank {r}" for r in range(n)],
                        xgap=3, ygap=3, hoverinfo="skip", row=1, col=i)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=f"{op}: what each rank holds", height=110 + 45 * n, width=760)
    return fig


def explore(fn, **controls):
    """An interactive figure: ipywidgets controls that redraw ``fn(**values)``.

    ``controls`` are ``ipywidgets.interact`` abbreviations (a list is a menu, a widget is itself);
    ``fn`` returns a figure (or ``None``) and its keyword defaults are the first values shown. When
    ``MINIPAR_STATIC_WIDGETS`` is set (the headless notebook tests set it), ``fn`` is drawn once
    with its defaults instead of through widget messages, which headless executors handle least
    reliably; a read-only copy then shows that figure."""
    if os.environ.get("MINIPAR_STATIC_WIDGETS"):
        names = ", ".join(controls)
        print(f"An explorer, drawn at its first setting: run the notebook to explore ({names}).")
        return fn(**{k: p.default for k, p in inspect.signature(fn).parameters.items()
                     if p.default is not inspect.Parameter.empty})
    from ipywidgets import interactive  # deferred: optional (notebooks only)

    def draw(**values):
        fig = fn(**values)
        if fig is not None:
            fig.show()
    return interactive(draw, **controls)
