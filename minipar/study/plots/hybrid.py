"""Pictures for hybrid parallelism: the mesh with every rank's coordinates and groups,
and the comparison table of strategies."""
from __future__ import annotations

import plotly.graph_objects as go

from ...runtime import viz
from ...mesh import ProcessMesh

GROUP_STYLE = {"tp": dict(color=viz.color(0), dash="solid", width=5),
               "cp": dict(color=viz.color(3), dash="dashdot", width=3),
               "dp": dict(color=viz.color(1), dash="dash", width=3),
               "pp": dict(color=viz.color(2), dash="dot", width=2),
               "ep": dict(color=viz.color(4), dash="solid", width=2),
               "expert_dp": dict(color=viz.color(5), dash="longdash", width=2)}
OFFSET = {"tp": (0, 0), "cp": (0, -0.16), "dp": (0.2, 0), "ep": (0, 0.16), "expert_dp": (-0.2, 0)}


def _xy(c: dict, mesh: ProcessMesh) -> tuple[float, float]:
    """Stage p is a panel; inside it cp blocks of tp ranks run left to right, dp top to bottom."""
    return c["pp"] * (mesh.cp * mesh.tp + 0.8) + c.get("cp", 0) * mesh.tp + c["tp"], -c["dp"]


def _path(dim: str, points: list[tuple[float, float]], t: int) -> tuple[list, list]:
    """The line through a group's ranks: straight for tp, beside the labels for the others
    (each dimension on its own side), arcs over the panels for pp (higher for larger t, so
    that they do not overlap)."""
    if dim != "pp":
        dx, dy = OFFSET[dim]
        return [x + dx for x, _ in points], [y + dy for _, y in points]
    arcs = [(x0 + (x1 - x0) * u, y0 + (y1 - y0) * u + (0.25 + 0.12 * t) * 4 * u * (1 - u))
            for (x0, y0), (x1, y1) in zip(points[:-1], points[1:]) for u in (k / 20 for k in range(21))]
    return [x for x, _ in arcs], [y for _, y in arcs]


def mesh_figure(mesh: ProcessMesh, highlight: int | None = None, title: str | None = None) -> go.Figure:
    """Every rank as a dot labelled ``rank (p, d, t)`` (``(p, d, c, t)`` with cp); lines join
    the members of each tp group (solid), cp group (dash-dot), dp group (dashed), pp group
    (dotted) and, with ep, each ep group and expert-dp group (the experts' groups, carved out of
    dp·cp). With ``highlight`` only that rank's groups are drawn."""
    fig = go.Figure()
    ranks = range(mesh.size)
    coords = {r: mesh.coordinates(r) for r in ranks}
    dims = ("pp", "dp") + (("cp",) if mesh.cp > 1 else ()) + ("tp",) + (("ep", "expert_dp") if mesh.ep > 1 else ())
    for dim in dims:
        groups = mesh.all_groups(dim) if highlight is None else [mesh.members(highlight, dim)]
        for i, g in enumerate(group for group in groups if len(group) > 1):
            xs, ys = _path(dim, [_xy(coords[r], mesh) for r in g], coords[g[0]]["tp"])
            fig.add_scatter(x=xs, y=ys, mode="lines", line=GROUP_STYLE[dim], name=f"{dim} group",
                            legendgroup=dim, showlegend=i == 0, hoverinfo="skip")
    xs, ys = zip(*(_xy(coords[r], mesh) for r in ranks))
    keys = ("pp", "dp", "cp", "tp") if mesh.cp > 1 else ("pp", "dp", "tp")
    text = [f"<b>{r}</b><br>(" + ",".join(str(coords[r][k]) for k in keys) + ")" for r in ranks]
    fig.add_scatter(x=xs, y=ys, mode="markers+text", text=text, textposition="bottom center",
                    marker=dict(size=26, color=["#d62728" if r == highlight else "#444" for r in ranks]),
                    name="rank (" + ", ".join(k[0] for k in keys) + ")", hoverinfo="text")
    width = mesh.cp * mesh.tp
    for p in range(mesh.pp):
        fig.add_annotation(x=p * (width + 0.8) + (width - 1) / 2, y=0.6, text=f"stage p={p}",
                           showarrow=False)
    five = mesh.cp > 1 or mesh.ep > 1
    fig.update_layout(title=title or (
                      f"dp={mesh.dp} × cp={mesh.cp} × pp={mesh.pp} × tp={mesh.tp}, ep={mesh.ep} of dp·cp: "
                      "every rank, its (p, d, c, t) and its groups" if five else
                      f"dp={mesh.dp} × pp={mesh.pp} × tp={mesh.tp}: every rank, its (p, d, t) and its groups"),
                      height=180 + 90 * mesh.dp, showlegend=True, width=max(700, 110 * mesh.pp * width),
                      xaxis=dict(visible=False), yaxis=dict(visible=False, range=[-mesh.dp + 0.3, 0.9]),
                      margin=dict(t=80 if five else 60, b=10, l=10, r=10))
    return fig


def reductions(mesh: ProcessMesh, rank: int = 0) -> list[dict]:
    """What ``rank`` reduces over which of its groups in one step of the mesh (a mixture-of-experts
    GPT when ``mesh.ep > 1``): ``[{"what", "group", "ranks", "how"}]``."""
    rows = []
    if mesh.tp > 1:
        rows.append(dict(what="activations and their gradients (inside each tensor-parallel block)",
                         group="tp", ranks=mesh.members(rank, "tp"), how="all-reduce (sum)"))
    if mesh.cp > 1:
        rows.append(dict(what="K, V and their gradients (attention over the whole sequence)",
                         group="cp", ranks=mesh.members(rank, "cp"), how="ring (send/recv)"))
    if mesh.pp > 1:
        rows.append(dict(what="activation gradients between stages", group="pp", ranks=mesh.members(rank, "pp"),
                         how="send to the previous stage"))
    if mesh.ep > 1:
        rows.append(dict(what="tokens to their experts and back (forward and backward)", group="ep",
                         ranks=mesh.members(rank, "ep"), how="all-to-all"))
    if mesh.dp * mesh.cp > 1:
        rows.append(dict(what="gradients of dense parameters (attention, embeddings, router, norms)",
                         group="dp_cp" if mesh.cp > 1 else "dp", ranks=mesh.members(rank, "dp_cp"),
                         how="all-reduce (mean), or ZeRO's reduce-scatter"))
    if mesh.ep > 1:
        rows.append(dict(what="gradients of this rank's experts (MoE layers)", group="expert_dp",
                         ranks=mesh.members(rank, "expert_dp"), how="all-reduce (sum) ÷ dp·cp"))
    return rows


def reductions_table(mesh: ProcessMesh, rank: int = 0) -> go.Figure:
    """:func:`reductions` as a table."""
    rows = reductions(mesh, rank)
    cols = [[r["what"] for r in rows], [r["group"] for r in rows], [str(r["ranks"]) for r in rows],
            [r["how"] for r in rows]]
    fig = go.Figure(go.Table(columnwidth=[4, 1, 1.3, 2], header=dict(values=["what", "group", "ranks", "how"],
                                                                        align="left"),
                             cells=dict(values=cols, align="left")))
    return fig.update_layout(title=f"Rank {rank} {tuple(mesh.coordinates(rank).values())}: what it reduces, "
                             "over which group", height=110 + 34 * len(rows), margin=dict(t=40, b=10, l=10, r=10))


COLUMNS = [("memory", "memory_formula", "model states / rank (KiB)", 1 / 1024),
           ("sent", "sent_formula", "sent / rank / step (KiB)", 1 / 1024),
           ("bubble", "bubble_formula", "bubble (idle / compute)", 1.0),
           ("step_ms", None, "step time (ms)", 1.0)]


def comparison_table(rows: list[dict], title: str = "Strategies side by side (measured, formula)") -> go.Figure:
    """The comparison table: one row per strategy, measured values with the formula's in
    brackets where :mod:`minipar.cost` has one."""
    def cell(r, key, ref, scale):
        if r[key] is None:
            return "—"
        spec = ".2f" if key == "bubble" else ",.1f"
        return f"{r[key] * scale:{spec}}" + (f" ({r[ref] * scale:{spec}})" if ref is not None else "")
    header = ["strategy", "dp × pp × tp, m"] + [c[2] for c in COLUMNS] + ["max |Δ loss|"]
    cols = [[r["strategy"] for r in rows], [f"{r['dp']}×{r['pp']}×{r['tp']}, m={r['m']}" for r in rows]]
    cols += [[cell(r, k, ref, s) for r in rows] for k, ref, _, s in COLUMNS]
    cols.append([f"{r['loss_error']:.0e}" for r in rows])
    fig = go.Figure(go.Table(header=dict(values=header, align="left"), cells=dict(values=cols, align="left")))
    fig.update_layout(title=title, height=120 + 32 * len(rows), margin=dict(t=50, b=10, l=10, r=10))
    return fig


def comparison_bars(rows: list[dict]) -> go.Figure:
    """Memory and bytes sent per rank, measured (bars) and formula (markers), per strategy."""
    from plotly.subplots import make_subplots  # deferred: plotly, heavy, only when drawing
    fig = make_subplots(rows=1, cols=2, subplot_titles=("model states per rank (KiB)",
                                                        "bytes sent per rank per step (KiB)"))
    names = [r["strategy"] for r in rows]
    for col, (key, ref) in enumerate((("memory", "memory_formula"), ("sent", "sent_formula")), 1):
        fig.add_bar(x=names, y=[r[key] / 1024 for r in rows], name="measured", marker_color=viz.color(0),
                    showlegend=col == 1, row=1, col=col)
        fig.add_scatter(x=names, y=[r[ref] / 1024 for r in rows], mode="markers", name="formula",
                        marker=dict(color="black", symbol="line-ew-open", size=18, line_width=2),
                        showlegend=col == 1, row=1, col=col)
    fig.update_layout(height=380, margin=dict(t=50, b=10))
    return fig


__all__ = ["mesh_figure", "reductions", "reductions_table", "comparison_table", "comparison_bars"]
