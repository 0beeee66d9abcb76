"""DP × EP training of a mixture-of-experts GPT: ``check``, ``train``, ``run``.

Every rank trains on its shard of each global batch (contiguous rows, rank order), the MoE
layers sharded over its ep group (:func:`~minipar.expert_parallel.shard_experts`) and the
load-balancing counts summed over the dp group (f_i is the whole batch's). After backward:

    dense gradients   all-reduce (mean) over the dp group            (DDP's rule)
    expert gradients  all-reduce (sum) over the expert-dp group, ÷ dp

Why ÷ dp: rank r's loss is the mean over its S/dp tokens, so each token's contribution to an
expert's gradient arrives (through the combine all-to-all's backward) scaled by 1/(S/dp);
summing the dp/ep replicas gathers every token once, and ÷ dp makes it the single process's
1/S: the result equals one process training on the whole batch. An expert no token of the
batch chose gets a zero gradient, as in one process (which runs every expert, on no rows
too), so stateful optimizers (momentum, Adam) step it like the rest, in every layout.

Options: ``ep`` (divides the world size, which is dp), ``dtype`` (mixed precision),
``recompute`` (passed to the GPT's blocks; ``"full"`` runs the two all-to-alls again in
backward), ``tp`` (tensor parallelism of the dense part, :mod:`.tensor`: world = dp · tp).
:func:`check` sends pipeline parallelism to the mesh (:mod:`minipar.hybrid.experts`: EP × PP).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from .. import comm, strategy
from ..data import shard
from ..models.moe import MoE, moe_layers, moe_loss
from ..reference import sgd
from ..runtime import trace
from ..tensor_parallel.config import check_config
from ..tensor_parallel.gpt import full_state_dict
from .groups import build_ep_groups
from .layer import shard_experts
from .tensor import build_mesh, tensor_parallel_moe_gpt


def reduce_gradients(model, groups, dp: int) -> None:
    """Dense gradients: mean over dp. Expert gradients: sum over expert-dp, ÷ dp (zeros for an
    expert that no token of the whole batch chose, as in one process)."""
    for kind, group, op in (("dense", groups["dp"], "avg"), ("expert", groups["expert_dp"], "sum")):
        ps = [p for n, p in model.named_parameters() if (".experts." in n) == (kind == "expert")]
        comm.all_reduce_gradients(ps, op=op, group=group, divide_by=dp if kind == "expert" else 1,
                                  name=f"{kind}_grads", dim="dp", reduced_over="dp" if kind == "dense" else "expert_dp")


def train(model, batches, optimizer=None, ep: int = 1, tp: int = 1, dtype=None, recompute=None) -> dict:
    """On every rank of the world: DP × EP training (ep groups carved from the dp ranks); with
    ``tp > 1`` the dense part is tensor-parallel over a dp × tp mesh (:mod:`.tensor`).
    ``recompute``: the GPT's (``None``: the model's own). ``measured``: the last step's
    ``bytes_sent``, ``bytes_by_dim`` and ``seconds`` (:func:`minipar.strategy.loop`), the tokens
    each expert received in every step, the last step's kept matrix, this rank's experts and
    parameter count."""
    dtype = strategy.prepare(model, dtype, recompute)   # the options every strategy takes, decided once
    if tp > 1:
        mesh, groups = build_mesh(tp, ep)
        dp, me = mesh.dp, mesh.rank("dp")
        model = tensor_parallel_moe_gpt(model, groups, token_group=groups["dp"] if dp > ep else None)
    else:
        groups = build_ep_groups(ep)
        dp, me = dist.get_world_size(), dist.get_rank()
        shard_experts(model, groups["ep"], token_group=groups["dp"] if dp > ep else None)
    device = next(model.parameters()).device
    opt = (optimizer or sgd())(model.parameters())
    routed, layers = [], moe_layers(model)

    def step(i, batch):
        x, y = (shard(t, me, dp).to(device) for t in batch)
        opt.zero_grad(set_to_none=True)
        with strategy.forward(dtype, device, "forward", step=i):
            loss = model(x, y)
            if tp > 1:
                loss = loss + moe_loss(model)   # the tensor-parallel GPT returns the cross-entropy only
        trace.backward(loss, step=i)
        reduce_gradients(model, groups, dp)
        with trace.region("optimizer", step=i):
            opt.step()
        routed.append([m.stats["counts"].clone() for m in layers])   # read once, after the loop
        return loss

    losses, measured = strategy.loop(batches, step, mean_over=groups["dp"], dim="dp")
    measured.update({"tokens_per_expert": [[c.tolist() for c in step] for step in routed],  # [step][layer][expert]
                     "kept_matrix": [m.stats["kept"].tolist() for m in layers],  # last step, this ep group
                     "local_experts": [m.local for m in layers],
                     "parameters": sum(p.numel() for p in model.parameters())})  # this rank's (experts sharded)
    measured.memory = strategy.state_memory(model, opt)
    if tp > 1:
        full = full_state_dict(model)                     # a tp collective: every tp rank takes part
        params = strategy.full_params(full.items()) if dist.get_rank(groups["tp"]) == 0 else None
    else:
        params = strategy.full_params(model.named_parameters())
    return {"losses": losses, "params": params, "measured": measured}


@strategy.checks
def check(model, batches, world_size: int, ep: int = 1, tp: int = 1, dtype=None, recompute=None,
          pp: int = 1) -> None:
    """Plain errors before launch: a model without MoE layers, E not divisible by ep, top_k > E,
    ep not dividing dp, uneven batch shards, capacity with dp > ep, a GPT that tp cannot split, pp."""
    if pp != 1:
        raise ValueError(f"expert_parallel trains DP × EP and EP × TP; for pp={pp} use the mesh, "
                         "minipar.hybrid.run(..., pp=, ep=), which counts capacity and the load-balancing "
                         "loss per micro-batch and is checked against one process doing the same "
                         "(minipar.hybrid.experts)")
    if not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(f"tp={tp!r} must be a positive int dividing the {world_size} ranks")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("the model has no MoE layers: build it with GPTConfig(moe_every=..., n_experts=...)")
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive int, got {ep!r}")
    dp = world_size // tp
    if tp > 1:
        check_config(replace(model.config, moe_every=0), tp)
    for m in layers:
        if m.n_experts % ep:
            raise ValueError(f"{m.n_experts} experts cannot be split evenly over ep={ep} ranks")
        if m.top_k > m.n_experts:
            raise ValueError(f"top_k={m.top_k} exceeds the {m.n_experts} experts")
        if m.capacity_factor is not None and dp > ep:
            raise ValueError(
                f"capacity_factor={m.capacity_factor} with dp={dp} > ep={ep}: capacity would be "
                "counted per ep group, so other tokens would be dropped than in one process; use "
                "capacity_factor=None (dropless) or ep = dp")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide the {dp} data-parallel ranks")
    strategy.check_options(model, dtype, recompute)
    for step, (x, _) in enumerate(batches):
        if x.shape[0] % dp:
            raise ValueError(f"global batch {step} has {x.shape[0]} rows, not divisible by dp={dp}")


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` = dp · tp ranks."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
