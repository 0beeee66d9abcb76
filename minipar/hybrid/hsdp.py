"""Hybrid sharded data parallelism (HSDP; Zhao et al. 2023, "PyTorch FSDP", §3.2.3): ZeRO-3
within a group, plain data parallelism across groups.

The data-parallel ranks (the ``dp_cp`` group, in (d, c) order) are cut into consecutive blocks
of ``S·cp`` ranks (``dp_shard``: S = dp_shard, one node, say) and the ranks at the same place
of every block form a ``dp_replicate`` group (R = dp / S ranks, across nodes), the same carving
as the ep and expert-dp groups (:mod:`minipar.mesh`). Stage 3 shards the parameters within
``dp_shard`` only; after its reduce-scatter (the mean over the block) one all-reduce averages
the R blocks' gradient shards:

    ḡ_r = (1/R) Σ_blocks (1/S) Σ_{j in block} g_j[shard r]   = the mean over all dp ranks

Per rank: (4 + 4 + K)Ψ/S of model states (fp32) instead of /dp; bytes 3(S-1)/S·Ψ within the
block (two all-gathers, one reduce-scatter) and 2(R-1)/R·Ψ/S across blocks
(:func:`minipar.cost.hsdp_comm_bytes`). It beats ZeRO-3 over all dp ranks when the link
between blocks is the slow one: only Ψ/S per rank crosses it, once per step, while every
gather and reduce-scatter stays inside the block's fast links.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


def check_hsdp(dp: int, dp_shard: int | None, zero: int, ep: int = 1) -> None:
    """The rules of HSDP on the mesh: ``dp_shard`` divides ``dp``, stage 3, a dense GPT."""
    if dp_shard is None or dp_shard == dp:
        return
    if not isinstance(dp_shard, int) or isinstance(dp_shard, bool) or dp_shard < 1 or dp % dp_shard:
        raise ValueError(f"dp_shard={dp_shard!r} must be a positive divisor of dp={dp} "
                         "(dp = dp_replicate · dp_shard)")
    if zero != 3:
        raise ValueError(f"dp_shard={dp_shard} < dp={dp} (HSDP) shards parameters: it needs zero=3, got zero={zero}")
    if ep > 1:
        raise ValueError(f"dp_shard={dp_shard} < dp={dp} with ep={ep}: HSDP shards dense GPTs only here")


def hsdp_groups(mesh, dp_shard: int) -> dict:
    """Inside every rank (all in the same order): this rank's ``{"dp_shard", "dp_replicate"}``
    groups of ``mesh`` (built), named for the trace."""
    size, me, out = dp_shard * mesh.cp, dist.get_rank(), {}
    for dc in mesh.all_groups("dp_cp"):
        blocks = [dc[i:i + size] for i in range(0, len(dc), size)]
        for dim, groups in (("dp_shard", blocks), ("dp_replicate", [dc[j::size] for j in range(size)])):
            for ranks in groups:
                g = dist.new_group(ranks)
                if me in ranks:
                    comm.name_group(g, dim)
                    out[dim] = g
    return out


@torch.no_grad()
def reduce_replicas(params, group) -> None:
    """The gradient shards of ``params`` averaged over the ``dp_replicate`` ``group``: one
    all-reduce of them end to end (zeros where a shard has no gradient)."""
    ps = list(params)
    if not ps:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
    comm.all_reduce(flat, op="avg", group=group, name="hsdp_replicas")
    for p, g in zip(ps, flat.split([p.numel() for p in ps])):
        p.grad = g.view_as(p).clone()
