"""Figures of chapter 09: dense against sparse, routing, capacity, imbalance, the ep groups."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ... import cost
from ...runtime.viz import color
from ...expert_parallel.groups import ep_layout
from ...expert_parallel.imbalance import load_imbalance


def dense_vs_sparse(hidden: int, experts: list[int], top_k: int) -> go.Figure:
    """Parameters and forward FLOPs per token of one MLP as the number of experts grows
    (k fixed), relative to the dense MLP (one expert, k = 1)."""
    dense = cost.moe_params(hidden, 1, 1)["total"] - hidden     # no router for a dense MLP
    dflops = cost.moe_flops_per_token(hidden, 1, 1)["all_experts"]
    p = [cost.moe_params(hidden, E, min(top_k, E))["total"] / dense for E in experts]
    f = [cost.moe_flops_per_token(hidden, E, min(top_k, E))["active"] / dflops for E in experts]
    fig = go.Figure().add_scatter(x=experts, y=p, mode="lines+markers", name="parameters",
                                  line_color=color(0))
    fig.add_scatter(x=experts, y=f, mode="lines+markers", name=f"FLOPs per token (top-{top_k})",
                    line_color=color(9))
    return fig.update_layout(title=f"One MLP (h={hidden}) as E experts: parameters grow, compute per token "
                             "does not", xaxis_title="experts E", yaxis_title="× the dense MLP",
                             xaxis_type="log", yaxis_type="log", height=380)


def routing(chars: list[str], experts: list[int], n_experts: int, width: int = 48,
            title: str = "Each character coloured by its first-choice expert") -> go.Figure:
    """The text as a grid of characters, each cell coloured by the expert it was routed to."""
    rows = (len(chars) + width - 1) // width
    z = [[None] * width for _ in range(rows)]
    text = [[""] * width for _ in range(rows)]
    for i, (c, e) in enumerate(zip(chars, experts)):
        z[i // width][i % width] = e
        text[i // width][i % width] = {"\n": "⏎", " ": "·"}.get(c, c)
    scale = [[(e + j) / n_experts, color(e)] for e in range(n_experts) for j in (0, 1)]
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", zmin=-0.5, zmax=n_experts - 0.5,
                               colorscale=scale, xgap=1, ygap=1, hovertemplate="expert %{z}<extra></extra>",
                               colorbar=dict(title="expert", tickvals=list(range(n_experts)))))
    return fig.update_layout(title=title, height=60 + 24 * rows, width=900, xaxis_showticklabels=False,
                             yaxis=dict(autorange="reversed", showticklabels=False))


def capacity_bars(counts, capacity: int | None, title: str = "") -> go.Figure:
    """Assignments per expert: kept (up to the capacity) and dropped (above it)."""
    c = [int(v) for v in counts]
    kept = [min(v, capacity) if capacity is not None else v for v in c]
    names = [f"expert {i}" for i in range(len(c))]
    fig = go.Figure().add_bar(x=names, y=kept, name="kept", marker_color=color(0))
    fig.add_bar(x=names, y=[v - k for v, k in zip(c, kept)], name="dropped (the residual carries them)",
                marker_color=color(8))
    if capacity is not None:
        fig.add_hline(y=capacity, line_dash="dash", annotation_text=f"capacity C = {capacity}")
    return fig.update_layout(barmode="stack", title=title, yaxis_title="assignments", height=360)


def imbalance_curves(runs: dict[str, list[list[list[int]]]], title: str =
                     "Busiest expert ÷ mean, per step (averaged over the MoE layers)") -> go.Figure:
    """``runs[name][step][layer]`` = tokens per expert; one curve of max/mean per run."""
    fig = go.Figure()
    for i, (name, steps) in enumerate(runs.items()):
        ys = [sum(load_imbalance(layer) for layer in step) / len(step) for step in steps]
        fig.add_scatter(y=ys, mode="lines", name=name, line_color=color(i))
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="perfectly even")
    return fig.update_layout(title=title, xaxis_title="step", yaxis_title="max / mean tokens per expert",
                             height=360)


def tokens_heatmap(steps: list[list[list[int]]], layer: int = 0, title: str = "") -> go.Figure:
    """Tokens per expert (columns) at every step (rows) of one MoE layer."""
    z = [step[layer] for step in steps]
    fig = go.Figure(go.Heatmap(z=z, colorscale="Blues", colorbar=dict(title="tokens"),
                               x=[f"e{i}" for i in range(len(z[0]))]))
    return fig.update_layout(title=title, xaxis_title="expert", yaxis_title="step", height=320, width=460)


def ep_groups_figure(dp: int, ep: int, n_experts: int) -> go.Figure:
    """Every rank: its ep group, the experts it holds and the groups its gradients reduce over."""
    lay = ep_layout(dp, ep)
    per = n_experts // ep
    g_of = {r: i for i, g in enumerate(lay["ep"]) for r in g}
    d_of = {r: i for i, g in enumerate(lay["expert_dp"]) for r in g}
    ranks = list(range(dp))
    cols = [[f"rank {r}" for r in ranks],
            [f"ep group {g_of[r]}: {lay['ep'][g_of[r]]}" for r in ranks],
            [f"experts {per * (r % ep)}..{per * (r % ep) + per - 1}" for r in ranks],
            [f"all {dp} ranks {list(range(dp))}" for r in ranks],
            [f"expert-dp {lay['expert_dp'][d_of[r]]}" for r in ranks]]
    ep_fill, dp_fill = [color(g_of[r]) + "33" for r in ranks], [color(4 + d_of[r]) + "55" for r in ranks]
    fill = [ep_fill, ep_fill, dp_fill, ["#EEEEEE"] * dp, dp_fill]
    fig = go.Figure(go.Table(header=dict(values=["rank", "dispatch/combine over", "holds",
                                                 "dense gradients: mean over", "expert gradients: sum over (÷ dp)"]),
                             cells=dict(values=cols, fill_color=fill, height=26)))
    return fig.update_layout(title=f"DP × EP: dp = {dp}, ep = {ep}, {n_experts} experts",
                             height=120 + 28 * dp, width=900, margin=dict(t=50, b=10))


def rank_expert_time(seconds: list[float], rows: list[int], title: str = "") -> go.Figure:
    """Per rank: time in its experts (bars) and rows computed (markers, right axis)."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    ranks = [f"rank {r}" for r in range(len(seconds))]
    fig.add_bar(x=ranks, y=[1e3 * s for s in seconds], name="expert time (ms)", marker_color=color(0))
    fig.add_scatter(x=ranks, y=rows, name="rows computed", mode="markers", marker=dict(size=12, color=color(8)),
                    secondary_y=True)
    fig.add_hline(y=1e3 * (sum(seconds) / len(seconds)), line_dash="dash", annotation_text="mean")
    return fig.update_layout(title=title, height=340, yaxis_title_text="ms",
                             yaxis2=dict(title_text="rows", rangemode="tozero"))
