"""Token dispatch: which rows go to which rank, and how to put them back.

Every (token, expert) assignment moves to the rank that holds the expert, in one
``all_to_all_single`` whose split sizes say how many rows go to each rank (Lepikhin et al.
2020 §3; the "dispatch" of DeepSpeed-MoE and Megatron's token dispatcher). The local pieces:
the counts per expert, the split sizes every rank agrees on, and the permutation that puts
the rows in the order the exchange sends them (and back).
"""
from __future__ import annotations

import torch


# Contract:
# ex09.A.count: ``count_tokens(expert_of, n_experts)`` returns the assignments per expert of the
#     flat assignments ``expert_of``: an int64 tensor of length ``n_experts`` on the input's
#     device, where experts nobody chose count 0.
def count_tokens(expert_of: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``c[i]`` = entries of ``expert_of`` (flat assignments) equal to i < n_experts (int64, same device)."""
    # >>> ex09 A
    return torch.bincount(expert_of, minlength=n_experts)
    # <<< ex09 A


# Contract:
# Given: ``counts`` is the (ep × E) matrix of every rank's (kept) counts, row r what rank r routes
#     to each expert; rank j of the ep group holds the j-th block of E/ep experts.
# ex09.B.pairs: ``(send, recv)``: the rows this rank sends to and receives from each rank, where
#     rank a's ``send[b]`` equals rank b's ``recv[a]``.
# ex09.B.ints: ``send`` and ``recv`` are two lists of ep Python ints.
def split_sizes(counts: torch.Tensor, rank: int, ep: int) -> tuple[list[int], list[int]]:
    """``(send, recv)`` row counts per rank (Python ints) for ``all_to_all_single``, from the (ep × E)
    matrix ``counts`` (row r: what rank r routes to each expert); rank j holds the j-th E/ep experts."""
    # >>> ex09 B
    per_rank = counts.reshape(ep, ep, -1).sum(-1)            # [source, destination]
    return per_rank[rank].tolist(), per_rank[:, rank].tolist()
    # <<< ex09 B


# Contract:
# ex09.B.stable: ``(perm, inverse)``: ``keys[perm]`` is sorted, rows of equal keys kept in their
#     original order.
# ex09.B.inverse: ``x[perm][inverse] == x`` for every ``x`` of as many rows.
def permutation(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inverse)``: ``keys[perm]`` is sorted, rows of equal keys in their original
    order, and ``x[perm][inverse] == x`` for every ``x`` of as many rows."""
    # >>> ex09 B
    perm = torch.argsort(keys, stable=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return perm, inverse
    # <<< ex09 B


# Contract:
# ex09.A.capacity: ``kept_counts(M, cap)`` is the (ep × E) count matrix ``M`` after a capacity of
#     ``cap`` assignments per expert (``None``: no limit), by position: expert i keeps the first
#     ``cap`` of its assignments in rank order (all of rank 0's, then rank 1's, ...).
def kept_counts(counts: torch.Tensor, cap: int | None) -> torch.Tensor:
    """The (ep × E) count matrix after capacity ``cap``, by position: expert i keeps the first ``cap`` of
    its assignments in rank order (all of rank 0's, then rank 1's, ...); ``None``: no limit."""
    # >>> ex09 A
    if cap is None:
        return counts
    cum = counts.cumsum(0)
    return cum.clamp(max=cap) - (cum - counts).clamp(max=cap)
    # <<< ex09 A
