"""The ep groups, carved out of the data-parallel ranks (DeepSpeed-MoE; DeepSeek-V3).

With dp data-parallel ranks and expert-parallel size ep (ep divides dp), consecutive blocks of
ep ranks form the **ep groups**, each holding all E experts once, E/ep per rank. The ranks at
the same place in their ep groups hold the same experts: the **expert-data-parallel group**
(dp/ep ranks), the only ranks an expert's gradient is reduced over. Dense parameters
(attention, embeddings, the router) are replicated on all dp ranks, as in data parallelism:

    dp = 4, ep = 2:   ep groups [0, 1] [2, 3]      expert-dp groups [0, 2] [1, 3]
"""
from __future__ import annotations

import torch.distributed as dist

from ..mesh import ProcessMesh


def ep_layout(dp: int, ep: int) -> dict[str, list[list[int]]]:
    """``{"ep": [...], "expert_dp": [...]}``: the groups as lists of dp ranks, as the mesh carves
    them (:meth:`minipar.mesh.ProcessMesh.members`, the one place the layout is written)."""
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide the {dp} data-parallel ranks")
    mesh = ProcessMesh(dp, 1, 1, ep=ep)
    return {dim: mesh.all_groups(dim) for dim in ("ep", "expert_dp")}


def build_ep_groups(ep: int, dp_groups: list[list[int]] | None = None) -> dict:
    """Inside a rank (every rank calls it, same order): this rank's ``"ep"`` and ``"expert_dp"``
    process groups, carved out of each data-parallel group of ``dp_groups`` (global ranks in dp
    order; default: the world is one dp group, also returned as ``"dp"``). With tensor
    parallelism every tp coordinate has its own dp group, so its own ep groups."""
    me = dist.get_rank()
    groups = {} if dp_groups else {"dp": dist.group.WORLD}
    for members in dp_groups or [list(range(dist.get_world_size()))]:
        for dim, layout in ep_layout(len(members), ep).items():
            for ranks in layout:
                ranks = [members[i] for i in ranks]
                g = dist.new_group(ranks)
                if me in ranks:
                    groups[dim] = g
    return groups
