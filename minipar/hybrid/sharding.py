"""ZeRO on the mesh: which stage shards what, over which group (Rajbhandari et al. 2020, §5).

The data-parallel group of the mesh (``dp_cp``: the ranks that differ only in d and c) holds
replicas of the same parameters (each a tensor-parallel shard of its tp group), so ZeRO
shards those replicas' model states over it, exactly as over plain data parallelism:

========  ================================================  =============================
stage     what each rank keeps (Ψ_r: its stages' tp shard)   where
========  ================================================  =============================
1         params and grads Ψ_r, optimizer state Ψ_r / N       every layout (pp, cp, ep too)
2         + gradients reduce-scattered: Ψ_r / N               every layout
3         + parameters sharded, gathered per layer            every layout,
          (``sharding="flat"``: FSDP's flat units;             ``FullyShardedDataParallel``
          ``"per-parameter"``: FSDP2's ``fully_shard``)        or ``fully_shard``
========  ================================================  =============================

N is the size of ``dp_cp`` (torchtitan's ``dp_shard_cp``): context-parallel ranks hold other
tokens of the same sequences, so their gradients are averaged together with dp's.

Under a pipeline each step runs m micro-batches through this rank's stages. Stage 2
reduce-scatters each micro-batch's gradients as its backward completes them and
**accumulates into the sharded gradient** (m reduce-scatters per step, Ψ_r/N of gradients
kept). Stage 3 follows ``reshard_after_forward`` (:func:`reshard_policy`): ``"auto"`` keeps a
stage's units gathered across its micro-batches under a pipeline and reduce-scatters their
accumulated gradients once, after the last micro-batch (:meth:`minipar.zero.stage3.UnitSchedule.finish_step`;
one all-gather per unit per step instead of 2m), and reshards after every use without one.

Expert parameters (a mixture-of-experts GPT, ``ep``) are replicated only over their
expert-data-parallel group, so under every stage their states are sharded over that group
(``expert_dp``, dp·cp/ep ranks), the dense states over dp·cp (under stage 3 two states over the
same layers, each ignoring the other's parameters). An expert's gradient holds the tokens its
ep group routed to it, so the mean over expert-dp is × 1/ep to make it the sum ÷ dp·cp
(:func:`scale_expert_shards`; ZeRO-1: :func:`~minipar.hybrid.experts.scale_expert_gradients`).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..data_parallel import Reducer
from ..zero import shard_module, stage_optimizer
from . import experts


RESHARD_POLICIES = ("auto", "always", "never")


def reshard_policy(policy: str, pp: int) -> bool:
    """Stage 3's ``reshard_after_forward``: ``"always"`` True, ``"never"`` False, ``"auto"``
    True without a pipeline (one forward per step: nothing to keep) and False with one."""
    if policy not in RESHARD_POLICIES:
        raise ValueError(f"reshard_after_forward={policy!r} must be one of {RESHARD_POLICIES}")
    return policy == "always" or (policy == "auto" and pp == 1)


class ShardedStates:
    """Stage 3 of this rank's layers as one state: ``parts`` (the dense parameters' over dp·cp,
    then, with experts, the experts' over expert-dp; each a :class:`~minipar.zero.stage3.UnitSchedule`
    or its wrapper), their parameters' names given back as the single-device GPT's (``names``),
    ``expert_shards`` the experts' shards (what :func:`scale_expert_shards` scales)."""

    def __init__(self, parts, names: dict[str, str], expert_shards=(), where=None, modules=None):
        self.parts, self.names, self.expert_shards = list(parts), names, list(expert_shards)
        self.where, self.modules = where or {}, modules or {}   # id(parameter), id(module) -> GPT name

    def shard_spans(self) -> list[tuple[str, torch.Tensor, int, int, int]]:
        """``(single-device name, shard, a, b, s)``: elements [a, b) of the (tp-local) parameter's
        flattening are elements [s, s + b - a) of ``shard``, over every part (checkpoints)."""
        out = []
        for part in self.parts:
            for key, shard, a, b, s in part.shard_spans():
                name = (self.where[id(key)] if not isinstance(key, tuple)
                        else f"{self.modules[id(key[0])]}.{key[1]}".lstrip("."))
                out.append((name, shard, a, b, s))
        return out

    def start_forward(self) -> None:
        for p in self.parts:
            p.start_forward()

    def finish_step(self) -> None:
        for p in self.parts:
            p.finish_step()

    def gather_full_params(self) -> dict:
        return {self.names[k]: v for p in self.parts for k, v in p.gather_full_params().items()}

    def memory_tensors(self, optimizer=None) -> dict:
        out = self.parts[0].memory_tensors(optimizer)      # the one optimizer's state, counted once
        for p in self.parts[1:]:
            more = p.memory_tensors()
            out = {k: out[k] + more.get(k, []) for k in out}
        return out

    def unit_sizes(self) -> list[int]:
        return [n for p in self.parts for n in p.unit_sizes()]

    peak_gathered_bytes = property(lambda self: sum(p.peak_gathered_bytes for p in self.parts))
    peak_held_grad_bytes = property(lambda self: sum(p.peak_held_grad_bytes for p in self.parts))
    peak_state_bytes = property(lambda self: sum(p.peak_state_bytes for p in self.parts))


def scale_expert_shards(hm, factor: float) -> None:
    """Under ZeRO-2/3 (which average the experts' gradients over expert-dp): the experts' reduced
    gradient shards × ``factor`` (1/ep: the mean over dp·cp/ep replicas becomes the sum ÷ dp·cp)."""
    if hm.sharded is not None:
        shards = [p.grad for p in hm.sharded.expert_shards]
    else:
        shards = hm.optimizer.parts[1].grad_shards if isinstance(hm.optimizer, experts.Optimizers) else []
    for g in shards:
        if g is not None:
            g.mul_(factor)


def build_optimizer(hm, make, zero: int, sharding: str = "flat", bucket_cap_mb: float = 25.0,
                    reshard_after_forward: str = "auto"):
    """``(optimizer, reducer, sharded)`` for the :class:`~minipar.hybrid.HybridModel` ``hm``:
    the optimizer over this rank's states, the :class:`Reducer` of the dense gradients (``None``
    when ZeRO reduces them itself, or nothing needs reducing) and, under stage 3, the state that
    gathers the parameters (whose :meth:`gather_full_params` gives them back whole)."""
    g, mesh = hm.groups, hm.mesh
    dense = [q for n, q in hm.params.items() if not experts.is_expert(n)]
    expert = [q for n, q in hm.params.items() if experts.is_expert(n)]
    layers = [layer for s in sorted(hm.stages) for layer in hm.stages[s]]
    mine = {id(d) for d in dense}
    units = [u for u in ([q for q in layer.parameters() if id(q) in mine] for layer in layers) if u]
    if zero == 0:
        reducer = Reducer(dense, g["dp_cp"], bucket_cap_mb, overlap=False) if mesh.dp * mesh.cp > 1 else None
        return make(list(hm.params.values())), reducer, None
    if zero in (1, 2):   # dense state over dp·cp, the experts' over their expert-dp group, as one unit
        # (stage 2: gradients reduce-scattered layer by layer, each micro-batch's into the shard;
        # the experts' scaled by scale_expert_shards: ÷ ep); ZeRO-1 with expert_dp = 1 shards nothing
        parts = [stage_optimizer(zero, units, make, g["dp_cp"])]
        if expert:
            parts.append(stage_optimizer(zero, [expert], make, g["expert_dp"]) if zero == 2 or mesh.expert_dp > 1
                         else make(expert))
        return (parts[0] if len(parts) == 1 else experts.Optimizers(parts)), None, None
    reshard = reshard_policy(reshard_after_forward, mesh.pp)
    # a pipeline rank holds some layers only: shard a container of them, named back to the GPT
    module = hm.model if mesh.pp == 1 else nn.ModuleList(layers)
    where = {id(q): n for n, q in hm.model.named_parameters()}
    names = {n: where[id(q)] for n, q in module.named_parameters()}
    parts, params, expert_shards = [], [], []
    dense_group = g.get("dp_shard", g["dp_cp"])     # HSDP: within the block (:mod:`.hsdp`)
    for j, group in enumerate([dense_group] + ([g["expert_dp"]] if expert else [])):   # dense, experts
        # each state ignores the other's parameters (per-parameter: the dense ones are shards by now)
        ignored = [q for n, q in module.named_parameters() if experts.is_expert(names[n]) != (j == 1)]
        parts.append(shard_module(module, group, sharding, units=layers, reshard_after_forward=reshard,
                                  ignored_params=ignored))
        if sharding == "per-parameter":     # the module's own parameters are the shards now
            mine = [q for n, q in module.named_parameters() if experts.is_expert(names[n]) == (j == 1)]
        else:
            mine = list(parts[-1].parameters())
        params += mine
        expert_shards += mine if j == 1 else []
    state = ShardedStates(parts, names, expert_shards, where,
                          {id(m): n for n, m in hm.model.named_modules()})
    # the pipeline calls the layers one by one, never the model: start each forward's unit order
    layers[0].register_forward_pre_hook(lambda m, a: state.start_forward(), prepend=True)
    return make(params), None, state


def apply_dp(parts, make, plan):
    """The composition's last step (:func:`minipar.hybrid.parallelize`): ``(optimizer, reducer,
    sharded)`` of :func:`build_optimizer` for ``plan``'s ZeRO stage, sharding and policy."""
    return build_optimizer(parts, make, plan.zero, plan.sharding, plan.bucket_cap_mb, plan.reshard_after_forward)
