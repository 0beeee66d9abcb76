"""Pictures of pipeline schedules: measured beside simulated, bubble and memory vs theory."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...runtime import viz
from ...runtime.trace import Trace


def side_by_side(top: Trace, bottom: Trace, titles=("measured", "simulated"), title: str = "",
                 color_by: str = "microbatch") -> go.Figure:
    """Two timelines stacked, coloured by micro-batch (same colours in both)."""
    n = max(top.world_size, bottom.world_size)
    fig = make_subplots(rows=2, cols=1, subplot_titles=titles, vertical_spacing=0.28)
    for row, t in enumerate((top, bottom), 1):
        for tr in viz.timeline(t, color_by=color_by).data:
            tr.legendgroup, tr.showlegend = tr.name, row == 1
            fig.add_trace(tr, row=row, col=1)
    fig.update_layout(barmode="overlay", title=title, height=260 + 80 * n, bargap=0.3,
                      legend_title=color_by, margin=dict(t=70, b=40))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="time (ms)", row=1, col=1)
    fig.update_xaxes(title_text="time (ms, or units of one forward)", row=2, col=1)
    return fig


def theory_vs_points(x, curves: dict[str, list[float]], points: dict[str, list[float]] | None = None,
                     title: str = "", xlabel: str = "", ylabel: str = "", log_x: bool = False) -> go.Figure:
    """Theory as lines, measurements/simulations as markers (same colour per name)."""
    fig = go.Figure()
    for k, (name, ys) in enumerate(curves.items()):
        fig.add_scatter(x=x, y=ys, mode="lines", name=f"{name} (theory)", line_color=viz.color(k))
        if points and name in points:
            fig.add_scatter(x=x, y=points[name], mode="markers", name=f"{name} (measured)",
                            marker=dict(color=viz.color(k), size=9, symbol="circle-open", line_width=2))
    fig.update_layout(title=title, xaxis_title=xlabel, yaxis_title=ylabel,
                      xaxis_type="log" if log_x else None)
    return fig
