"""The MoE layer with its experts spread over an ``ep`` group (GShard, Lepikhin et al. 2020).

Every rank routes its own tokens with the (replicated) router; rank j holds the j-th block
of E/ep experts. Each (token, expert) assignment travels to the rank of its expert, is
computed there and comes back (two all-to-alls, notebook 09): the outputs, the dropped
tokens and (with the router's gradient summed over the ranks) every gradient equal the
single-device layer on all ranks' tokens concatenated. The
load-balancing loss uses the group's f_i (from M, or summed over ``token_group`` when the
single-device batch spans more ranks, as under DP × EP) and this rank's P_i; its mean over
the ranks, weighted by their tokens, is the single-device aux.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm
from ..runtime import trace
from ..models.moe import MoE, capacity, keep_within_capacity, route
from .all_to_all import all_to_all
from .dispatch import count_tokens, kept_counts, permutation, split_sizes


# Contract:
# ex09.A.exchange: ``exchange_counts(counts, group)``: every rank of the group holds the same
#     (ep × E) matrix, row r the counts of group rank r.
# ex09.*.group: on a non-world group (two ep groups of 2 out of 4 ranks) each group is its own
#     layer: only its ranks take part and ranks count within it.
# ex09.*.recorded: every collective goes through ``minipar.comm`` (``all_gather``,
#     ``all_to_all_single``), so the trace records its bytes; the counts' all-gather is recorded
#     as "ep_counts" with the label ``dim="ep"`` (``ex09.D.recorded`` reads it so).
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

    # Contract:
    # ex09.D.experts: rank j of the group holds experts j·E/ep .. (j+1)·E/ep - 1 of ``moe``
    #     (``self.local``: their indices; ``self.experts``: a ``ModuleDict`` keyed by those
    #     indices as strings) and ``moe``'s router (``self.router``), the given modules' own
    #     parameters, not copies; ``self.ep``, ``self.rank``.
    # ex09.D.divide: E that ep does not divide is a ``ValueError``.
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

    # Contract:
    # Given: the code before your part has routed this rank's N tokens ``x`` (N, h; the ranks may hold
    #     different numbers of tokens): ``logits``,
    #     ``probs``, ``weights`` and ``experts`` (N, k), ``expert_of`` (N·k, flat) and ``token_of``
    #     (the token of each assignment). Yours to use: ``count_tokens``, ``exchange_counts``,
    #     ``kept_counts``, ``split_sizes``, ``permutation``, ``all_to_all``,
    #     ``capacity(tokens, E, k, factor)`` (``tokens``: the tokens of the whole ep group, the
    #     single device's batch) and ``keep_within_capacity(expert_of, E, cap,
    #     before=...)`` (``minipar.models.moe``: the single device's policy),
    #     ``self.aux_losses(logits, probs, expert_of, totals)``. The code after your part reads
    #     ``counts``, ``M``
    #     (the exchanged (ep × E) matrix), ``cap``, ``kept`` (the (ep × E) matrix: row r the
    #     assignments of group rank r each expert keeps), ``keep`` (per assignment, in token order),
    #     ``totals`` (the assignments per expert the load-balancing loss counts: over the tokens of
    #     the ep group, or of the ``token_group`` when there is one, before capacity drops any),
    #     ``aux``, ``z`` and ``y`` (N, h).
    # ex09.D.exact: outputs and dropped assignments equal the MoE layer on one device, on all
    #     ranks' tokens concatenated, also when the ranks hold different numbers of tokens.
    # ex09.D.grads: every gradient equals the single device's (the input's, each expert's, one
    #     that no assignment reached included, the router's summed over the ranks).
    # ex09.D.second: a second step (other tokens) is as exact as the first.
    # ex09.D.aux: the load-balancing loss, averaged over the ranks weighted by their tokens (a plain
    #     mean when they hold as many), is one device's.
    # ex09.D.token_group: with a ``token_group`` the loss's f_i count that group's tokens.
    # ex09.D.recorded: what the chapter reads from the trace. A forward records exactly three
    #     collectives on the ep group (each event's ``group``: the ep group's global ranks), in this
    #     order: the counts' all-gather "ep_counts", one all-to-all "ep_dispatch" (the tokens to
    #     their experts' ranks) and one "ep_combine" (back); its backward exactly two,
    #     "ep_combine_backward" then "ep_dispatch_backward". These five carry the label
    #     ``dim="ep"`` whatever the group's name (the ep group may be unnamed; the chapter sums
    #     their bytes by that label). Only with a ``token_group`` is there one more in the forward
    #     (anywhere in it), nothing else: an all-reduce "ep_token_counts" on the token group (its
    #     ``group``: the token group's global ranks), whose ``dim`` label is not "ep" (its bytes are
    #     not the ep group's).
    #     This rank's experts compute inside one trace region "experts" whose label ``rows`` is the
    #     number of assignments they computed; no collective runs inside it (the chapter reads its
    #     time as the experts' compute).
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
