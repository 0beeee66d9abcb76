"""The MoE layer with its experts spread over an ``ep`` group (GShard, Lepikhin et al. 2020).

Every rank routes its own tokens with the (replicated) router; rank j holds experts
``j·E/ep .. (j+1)·E/ep - 1``. One forward, on every rank:

1. route, count the assignments per expert, **exchange the counts** (an all-gather of E
   integers per rank: everyone has the (ep × E) matrix M);
2. **capacity** C = ceil(k·S/E · factor), S the whole group's tokens (Σ M / k), by the single
   device's policy (by position, ranks in order): rank r's assignments to expert i start at
   Σ_{r' < r} M[r', i], and those past C are dropped before sending;
3. sort the kept assignments by expert (a stable permutation), **all-to-all #1** with the
   split sizes from M: each rank receives the rows for its experts;
4. group the arrived rows by local expert (source rank, then token order: the single
   device's order), run each expert on its rows, undo that grouping;
5. **all-to-all #2** (the reverse splits) brings the results home; undo the sort, combine
   y = Σ_j w_j · E_{e_j}(x).

So the outputs, the dropped tokens and (with the router's gradient summed over the ranks)
every gradient equal the single-device layer on all ranks' tokens concatenated. The
load-balancing loss uses the group's f_i (from M, or summed over ``token_group`` when the
single-device batch spans more ranks, as under DP × EP) and this rank's P_i; its mean over
the ranks is the single-device aux.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm
from ..runtime import trace
from ..models.moe import MoE, capacity, keep_within_capacity, route
from .all_to_all import all_to_all
from .dispatch import count_tokens, kept_counts, permutation, split_sizes


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """The (ep × E) matrix of every rank's counts (a recorded all-gather, ``ep_counts``)."""
    # >>> ex09 A
    ep = comm.group_size(group)
    out = counts.new_empty(ep * counts.numel())
    comm.all_gather(out, counts.contiguous(), group=group, name="ep_counts", dim="ep")
    return out.view(ep, -1)
    # <<< ex09 A


class ExpertParallelMoE(MoE):
    """``moe``'s router and this rank's share of its experts (same parameter names)."""

    def __init__(self, moe: MoE, group=None, token_group=None):
        nn.Module.__init__(self)
        self.n_experts, self.top_k, self.capacity_factor = moe.n_experts, moe.top_k, moe.capacity_factor
        self.aux_coef, self.z_coef = moe.aux_coef, moe.z_coef
        self.group, self.token_group = group, token_group
        # >>> ex09 D
        self.ep, self.rank = comm.group_size(group), comm.group_rank(group)
        if self.n_experts % self.ep:
            raise ValueError(f"{self.n_experts} experts cannot be split over ep={self.ep} ranks")
        n = self.n_experts // self.ep
        self.local = list(range(self.rank * n, (self.rank + 1) * n))
        self.router = moe.router
        self.experts = nn.ModuleDict({str(i): moe.experts[i] for i in self.local})
        # <<< ex09 D
        self.loss, self.stats = None, {}
        self.aux_scale, self.aux_total, self.routed = moe.aux_scale, 0.0, None

    def forward(self, x):
        shape, E, k = x.shape, self.n_experts, self.top_k
        x = x.reshape(-1, shape[-1])
        N, h = x.shape
        logits = self.router(x)
        probs, weights, experts = route(logits, k)
        expert_of = experts.reshape(-1)
        token_of = torch.arange(N, device=x.device).repeat_interleave(k)

        # >>> ex09 D
        counts = count_tokens(expert_of, E)                            # 1. counts, exchanged
        M = exchange_counts(counts, self.group)
        cap = capacity(int(M.sum()) // k, E, k, self.capacity_factor)  # 2. capacity, by position
        kept = kept_counts(M, cap)
        keep = keep_within_capacity(expert_of, E, cap, before=M[:self.rank].sum(0))

        send, recv = split_sizes(kept, self.rank, self.ep)            # 3. sort, all-to-all #1
        perm, inverse = permutation(torch.where(keep, expert_of, E))   # dropped ones sort last
        n_kept = sum(send)
        arrived = all_to_all(x[token_of[perm[:n_kept]]], recv, send, self.group,
                             name="ep_dispatch", dim="ep")

        mine = kept[:, self.local]                                     # 4. experts run
        local_of = torch.arange(len(self.local), device=x.device).repeat(self.ep)
        by_expert, back = permutation(local_of.repeat_interleave(mine.reshape(-1)))
        rows = mine.sum(0).tolist()                                   # rows per local expert
        with trace.region("experts", experts=len(self.local), rows=sum(rows)):
            chunks = arrived[by_expert].split(rows)
            out = torch.cat([e(c) for e, c in zip(self.experts.values(), chunks)])[back]

        home = all_to_all(out, send, recv, self.group, name="ep_combine", dim="ep")  # 5. back, combine
        result = torch.cat([home, home.new_zeros(N * k - n_kept, h)])[inverse]
        y = torch.zeros_like(x).index_add(0, token_of, result * weights.reshape(-1, 1).to(x.dtype))
        totals = M.sum(0)                                              # the load-balancing loss
        if self.token_group is not None:
            totals = counts.clone()
            comm.all_reduce(totals, group=self.token_group, name="ep_token_counts", dim="dp")
        aux, z = self.aux_losses(logits, probs, expert_of, totals)
        # <<< ex09 D
        # for plots and tests, left on the device: a copy to the host here would wait for the GPU
        # at every forward; whoever reads them (.tolist(), .cpu()) pays that once
        self.stats = {"counts": totals.detach(), "matrix": M, "kept": kept, "dropped": ~keep,
                      "experts": experts.detach(), "capacity": cap, "aux": aux.detach(), "z": z.detach()}
        return self.with_aux_loss(y.reshape(shape))


def shard_experts(model: nn.Module, group=None, token_group=None) -> nn.Module:
    """Replace every :class:`~minipar.models.moe.MoE` in ``model`` (in place) by its expert-parallel
    version over ``group``; parameter names are unchanged."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is MoE:
                setattr(module, child_name, ExpertParallelMoE(child, group, token_group))
    return model
