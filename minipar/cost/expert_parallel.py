"""Expert parallelism: all-to-all traffic, parameters and memory per rank, FLOPs per token.

**All-to-all bytes** (GShard, Lepikhin et al. 2020 §3; DeepSpeed-MoE, Rajbhandari et al. 2022
§5). A rank with S tokens sends k·S rows of h elements in the dispatch, and as many come back
in the combine. With routing spread evenly over the ep ranks the share that stays on the
rank is 1/ep, so per layer, direction and rank

    bytes = k · S · h · (ep - 1)/ep · bytes_per_element          (forward; the backward repeats both)

Given the routing, the figure is exact: the rows this rank's count matrix row sends to
experts on other ranks (:func:`ep_bytes_routed`).

**Parameters.** An MoE MLP with E experts of hidden size f has E·(2hf + f + h) expert
parameters plus the router's hE; a token uses only k experts:

    total  = hE + E·(2hf + f + h)     active = hE + k·(2hf + f + h)     per rank = hE + (E/ep)·(2hf + f + h)

**FLOPs per token** (forward, 2 per multiply-add): router 2hE, each of the k experts
2·2hf: ``2hE + 4khf``, against ``4Ehf`` if every expert ran (the dense model of the same size).
"""
from __future__ import annotations


def ep_all_to_all_bytes(tokens: int, hidden: int, top_k: int, ep: int, bytes_per_element: int = 4) -> float:
    """Expected bytes one rank sends per all-to-all (one layer, one direction):
    k·S·h·(ep-1)/ep elements of ``bytes_per_element`` bytes each (4, fp32, by default)."""
    return top_k * tokens * hidden * (ep - 1) / ep * bytes_per_element


def ep_bytes_routed(counts, rank: int, hidden: int, bytes_per_element: int = 4) -> int:
    """Exact bytes ``rank`` sends in the dispatch (and receives back in the combine), given the
    (ep × E) matrix of assignments kept per rank and expert: the rows bound for other ranks."""
    rows = [list(map(int, r)) for r in (counts.tolist() if hasattr(counts, "tolist") else counts)]
    per = len(rows[0]) // len(rows)  # experts per rank, E/ep
    mine = sum(rows[rank][rank * per:(rank + 1) * per])
    return (sum(rows[rank]) - mine) * hidden * bytes_per_element


def ep_bytes_received(counts, rank: int, hidden: int, bytes_per_element: int = 4) -> int:
    """Exact bytes ``rank`` receives in the dispatch: rows of other ranks for its experts."""
    rows = [list(map(int, r)) for r in (counts.tolist() if hasattr(counts, "tolist") else counts)]
    per = len(rows[0]) // len(rows)  # experts per rank, E/ep
    return sum(sum(r[rank * per:(rank + 1) * per]) for q, r in enumerate(rows) if q != rank) \
        * hidden * bytes_per_element


def moe_params(hidden: int, n_experts: int, top_k: int, expert_hidden: int | None = None,
               ep: int = 1) -> dict[str, int]:
    """Parameters of one MoE MLP: ``total``, ``active`` per token and ``per_rank`` with the
    experts sharded over ``ep``; ``expert`` is one expert's count."""
    h, f, E = hidden, expert_hidden or 4 * hidden, n_experts
    expert = 2 * h * f + f + h
    return {"expert": expert, "router": h * E, "total": h * E + E * expert,
            "active": h * E + top_k * expert, "per_rank": h * E + (E // ep) * expert}


def moe_flops_per_token(hidden: int, n_experts: int, top_k: int, expert_hidden: int | None = None) -> dict[str, int]:
    """Forward FLOPs per token of one MoE MLP (``active``: router + k experts) and of running
    all E experts (``all_experts``, what the parameter count alone would suggest)."""
    h, f, E = hidden, expert_hidden or 4 * hidden, n_experts
    return {"active": 2 * h * E + 4 * top_k * h * f, "all_experts": 4 * E * h * f}


def ep_memory_per_rank(dense_params: int, expert_params: int, ep: int, bytes_per_param: int = 16) -> float:
    """Model-state bytes per rank (fp32 weights, gradients and Adam's two moments: 16 bytes
    per parameter) when the ``expert_params`` are sharded over ``ep`` ranks and the dense
    ones replicated: ``(dense + experts/ep) · bytes_per_param``."""
    return (dense_params + expert_params / ep) * bytes_per_param
