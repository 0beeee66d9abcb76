"""Token dispatch: which rows go to which rank, and how to put them back.

Every (token, expert) assignment moves to the rank that holds the expert, in one
``all_to_all_single`` whose split sizes say how many rows go to each rank (Lepikhin et al.
2020 §3; the "dispatch" of DeepSpeed-MoE and Megatron's token dispatcher). Three local pieces:

1. **counts**: ``c[i]`` = assignments this rank routes to expert i, a bincount;
2. **split sizes** from the (ep × E) matrix ``M`` of every rank's counts (after capacity):
   experts ``j·E/ep .. (j+1)·E/ep - 1`` live on rank j, so

       send[j] = Σ_{i on rank j} M[me, i]        recv[j] = Σ_{i on me} M[j, i]

3. **the permutation** sorting the rows by destination, a *stable* sort by expert (equal keys
   keep their token order), and its inverse: ``sorted = rows[perm]``, ``rows = sorted[inverse]``.
"""
from __future__ import annotations

import torch


def count_tokens(expert_of: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``c[i]`` = entries of ``expert_of`` (flat assignments) equal to i < n_experts (int64, same device)."""
    # >>> ex09 A
    return torch.bincount(expert_of, minlength=n_experts)
    # <<< ex09 A


def split_sizes(counts: torch.Tensor, rank: int, ep: int) -> tuple[list[int], list[int]]:
    """``(send, recv)`` row counts per rank (Python ints) for ``all_to_all_single``, from the (ep × E)
    matrix ``counts`` (row r: what rank r routes to each expert); rank j holds the j-th E/ep experts."""
    # >>> ex09 B
    per_rank = counts.reshape(ep, ep, -1).sum(-1)            # [source, destination]
    return per_rank[rank].tolist(), per_rank[:, rank].tolist()
    # <<< ex09 B


def permutation(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inverse)``: ``keys[perm]`` is sorted and rows with equal keys keep their
    order (a stable sort); ``inverse[perm[i]] = i``, so ``x[perm][inverse] == x``."""
    # >>> ex09 B
    perm = torch.argsort(keys, stable=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return perm, inverse
    # <<< ex09 B


def kept_counts(counts: torch.Tensor, cap: int | None) -> torch.Tensor:
    """The (ep × E) count matrix after capacity ``cap``, by position: expert i keeps the first ``cap`` of
    its assignments in rank order, so rank r keeps ``min(cum_r, cap) - min(cum_{r-1}, cap)`` (cum_r:
    the counts of ranks 0..r)."""
    # >>> ex09 A
    if cap is None:
        return counts
    cum = counts.cumsum(0)
    return cum.clamp(max=cap) - (cum - counts).clamp(max=cap)
    # <<< ex09 A
