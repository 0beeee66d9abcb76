"""EP × TP: tensor-parallel attention and dense MLPs, experts spread over the dp ranks.

The mesh is dp × tp (Megatron's layout, :class:`~minipar.mesh.ProcessMesh`), the blocks the
tensor-parallel ones of :mod:`minipar.tensor_parallel` (heads and MLP columns split over tp);
an MoE block's MLP is the expert-parallel layer, over an ep group carved out of the rank's dp
group (the ranks with the same tp coordinate). A tp group's ranks hold the same tokens and run
the same MoE layer on them (same router, local experts, all-to-alls on their own ep groups):
no tp communication there, and its input gradient is whole on every tp rank. Gradients are
reduced as in DP × EP, over the dp group (dense and tensor-parallel shards) and expert-dp.
"""
from __future__ import annotations

import torch.distributed as dist

from ..mesh import ProcessMesh
from ..tensor_parallel.gpt import from_gpt
from .groups import build_ep_groups
from .layer import shard_experts


def build_mesh(tp: int, ep: int) -> tuple[ProcessMesh, dict]:
    """Inside a rank: the dp × tp mesh and its groups, plus this rank's ep and expert-dp groups."""
    dp = dist.get_world_size() // tp
    mesh = ProcessMesh(dp=dp, tp=tp).build()
    groups = build_ep_groups(ep, mesh.all_groups("dp"))
    groups.update(dp=mesh.group("dp"), tp=mesh.group("tp"))
    return mesh, groups


def tensor_parallel_moe_gpt(model, groups, token_group=None):
    """This rank's model: ``model``'s dense part split over the tp group, its MoE layers
    expert-parallel over the ep group (same parameter names as ``model``)."""
    return shard_experts(from_gpt(model, groups["tp"]), groups["ep"], token_group)
