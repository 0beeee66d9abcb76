"""Pictures of context parallelism: the ring's schedule and the attention matrix it covers."""
from __future__ import annotations

import plotly.graph_objects as go

from ...context_parallel.ring import schedule
from ...context_parallel.sharding import chunk_ids

PART_TEXT = {"full": "full", "causal": "diagonal", "skip": "skipped", "kv_front": "½: front keys",
             "q_back": "½: back queries"}
PART_WORK = {"full": 1.0, "causal": 1.0, "skip": 0.0, "kv_front": 0.5, "q_back": 0.5}


def ring_schedule_figure(cp: int = 4, causal: bool = True, layout: str = "contiguous") -> go.Figure:
    """Rank × step: whose keys and values each rank holds at each step of the ring, and what
    its queries compute with them (colour: the share of a full block)."""
    sch = schedule(cp, causal, layout)
    z = [[PART_WORK[part] for _, part in row] for row in sch]
    text = [[f"K,V of {src}<br>{PART_TEXT[part]}" for src, part in row] for row in sch]
    fig = go.Figure(go.Heatmap(z=z, x=[f"step {s}" for s in range(cp)], y=[f"rank {r}" for r in range(cp)],
                               text=text, texttemplate="%{text}", zmin=0, zmax=1, colorscale="Blues",
                               colorbar=dict(title="work")))
    total = [sum(r) for r in z]
    return fig.update_layout(title=f"Ring attention, cp={cp}, {layout}{', causal' if causal else ''}: "
                             f"work per rank {', '.join(f'{t:g}' for t in total)} blocks",
                             yaxis=dict(autorange="reversed"), height=120 + 60 * cp)


def attention_matrix_figure(cp: int = 4, layout: str = "contiguous") -> go.Figure:
    """The causal attention matrix (queries × keys, in chunks of the sequence), each visible
    chunk pair coloured by the rank whose queries compute it; masked pairs blank."""
    n = 2 * cp if layout == "zigzag" else cp
    owner = {c: r for r in range(cp) for c in chunk_ids(r, cp, layout)}
    z = [[owner[qc] if kc <= qc else None for kc in range(n)] for qc in range(n)]
    text = [[f"rank {owner[qc]}" if kc <= qc else "" for kc in range(n)] for qc in range(n)]
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", colorscale="Viridis",
                               showscale=False, x=[f"k{c}" for c in range(n)], y=[f"q{c}" for c in range(n)]))
    return fig.update_layout(title=f"Causal attention in {n} chunks, {layout}: who computes what",
                             yaxis=dict(autorange="reversed", title="query chunk"), xaxis_title="key chunk",
                             height=200 + 30 * n, width=260 + 30 * n)
