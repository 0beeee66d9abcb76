"""Load imbalance, measured: how unevenly the router spreads tokens, and what it costs.

An ep rank finishes when its busiest expert has: with capacity the overflow is dropped,
without it the busiest rank sets the pace. Two figures:

    token imbalance  = max_i c_i / mean_i c_i     (c_i assignments to expert i; 1 = perfectly even)
    time imbalance   = max_r t_r / mean_r t_r     (t_r the time rank r spent in its experts)

The auxiliary loss E·Σ f_i P_i (Switch Transformer eq. 4) pushes the first towards 1.
"""
from __future__ import annotations

from ..runtime.trace import Trace


def load_imbalance(counts) -> float:
    """max / mean of the tokens per expert (a list or tensor)."""
    c = [float(v) for v in (counts.tolist() if hasattr(counts, "tolist") else counts)]
    mean = sum(c) / len(c)
    return max(c) / mean if mean else 1.0


def expert_seconds(trace: Trace) -> list[float]:
    """Per rank: seconds spent in its experts (the ``experts`` regions of the MoE layers)."""
    return [sum(e["end"] - e["start"] for e in evs if e["name"] == "experts") for evs in trace.ranks]


def expert_rows(trace: Trace) -> list[int]:
    """Per rank: rows its experts computed (tokens that arrived, summed over layers and steps)."""
    return [sum(e["labels"].get("rows", 0) for e in evs if e["name"] == "experts") for evs in trace.ranks]


def time_imbalance(trace: Trace) -> float:
    """Busiest rank's expert time over the mean."""
    return load_imbalance(expert_seconds(trace))
