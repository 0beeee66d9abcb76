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
(:meth:`ShardedOptimizer.finish`, :meth:`FullyShardedState.finish`; ZeRO-1:
:func:`~minipar.hybrid.experts.scale_expert_gradients`). :func:`build_optimizer` is the one place the
ZeRO stage is dispatched on: each stage is one object with the work after backward (``finish``,
registered by :func:`apply_dp` in the composition's order), its memory and what it reports.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..data_parallel import Reducer
from ..memory import state_tensors, storage_bytes
from ..zero import held_state_bytes, shard_module, stage_optimizer
from . import experts
from .hsdp import hsdp_groups, reduce_replicas


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
    ``expert_shards`` the experts' shards (what :meth:`FullyShardedState.finish` scales)."""

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


class Replicated:
    """ZeRO-0 on the mesh: every rank holds its parameters whole and one ``optimizer`` over them; after
    backward the dense gradients are averaged over dp·cp (``reducer``, ``None`` when dp·cp = 1) and the
    experts' summed over expert-dp ÷ dp·cp (:func:`~minipar.hybrid.experts.reduce_expert_gradients`)."""

    sharded, whole = None, True

    def __init__(self, optimizer, reducer, model, params: dict, groups: dict, mesh):
        self.optimizer, self.reducer, self.model, self.params = optimizer, reducer, model, params
        self.experts = any(experts.is_expert(n) for n in params)
        self.expert_group, self.n_token_ranks = groups["expert_dp"], mesh.dp * mesh.cp

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()                           # mean gradient over dp·cp
        if self.experts:
            experts.reduce_expert_gradients(self.model, self.params, self.expert_group, self.n_token_ranks)

    def gather_params(self) -> dict:
        return {k: v.detach() for k, v in self.params.items()}

    def memory(self) -> dict[str, int]:
        ps = list(self.params.values())
        out = {"params": storage_bytes(ps), "grads": storage_bytes([p.grad for p in ps]),
               "optimizer": storage_bytes(state_tensors(self.optimizer))}
        out["total"] = sum(out.values())
        return out

    def measured(self, memory: dict) -> dict:
        return {}


class ShardedOptimizer(Replicated):
    """ZeRO-1/2 on the mesh: the ``optimizer`` (the dense part over dp·cp, then, with experts, the
    experts' part over expert-dp: ``expert_part``) reduces the gradients itself (stage 1 in its step,
    stage 2 during backward); after backward the experts' gradients (stage 1) or gradient shards
    (stage 2) are × 1/ep: their mean over dp·cp/ep replicas becomes the sum ÷ dp·cp."""

    def __init__(self, stage: int, parts: list, model, params: dict, mesh):
        self.stage, self.parts, self.model, self.params = stage, parts, model, params
        self.optimizer = parts[0] if len(parts) == 1 else experts.Optimizers(parts)
        self.reducer, self.expert_part, self.factor = None, parts[1] if len(parts) > 1 else None, 1.0 / mesh.ep

    def finish(self) -> None:
        if self.expert_part is None:
            return
        if self.stage == 1:
            experts.scale_expert_gradients(self.model, self.params, self.factor)
        else:
            scale(self.expert_part.grad_shards, self.factor)

    def memory(self) -> dict[str, int]:
        sizes = [held_state_bytes(o) if hasattr(o, "units") else None for o in self.parts]
        return {k: sum(s[k] for s in sizes if s) for k in sizes[0]}

    def measured(self, memory: dict) -> dict:
        return {"unit_sizes": self.optimizer.unit_sizes()}


def scale(grads, factor: float) -> None:
    """Each gradient (shard) of ``grads`` × ``factor``, in place (``None`` entries skipped)."""
    for g in grads:
        if g is not None:
            g.mul_(factor)


class FullyShardedState:
    """ZeRO-3 on the mesh: ``sharded`` (:class:`ShardedStates`) gathers the parameters layer by layer
    and reduce-scatters their gradients; after backward it reduce-scatters what a pipeline kept
    gathered (``finish_step``), HSDP averages the blocks' shards over ``dp_replicate``
    (:func:`~minipar.hybrid.hsdp.reduce_replicas`), and the experts' shards are × 1/ep."""

    reducer, whole = None, False

    def __init__(self, optimizer, sharded: ShardedStates, groups: dict, mesh, hsdp: bool):
        self.optimizer, self.sharded, self.factor = optimizer, sharded, 1.0 / mesh.ep
        self.replicas = groups["dp_replicate"] if hsdp else None

    def finish(self) -> None:
        self.sharded.finish_step()                          # ZeRO-3 kept gathered: reduce-scatter once
        if self.replicas is not None:                       # HSDP: the blocks' shards averaged
            reduce_replicas([p for group in self.optimizer.param_groups for p in group["params"]], self.replicas)
        scale([p.grad for p in self.sharded.expert_shards], self.factor)

    def gather_params(self) -> dict:
        return self.sharded.gather_full_params()             # gathered over dp·cp

    def memory(self) -> dict[str, int]:
        return held_state_bytes(self.sharded, optimizer=self.optimizer)

    def measured(self, memory: dict) -> dict:
        s = self.sharded   # the most bytes of gathered units alive at once; of model states held at once
        return {"peak_gathered_bytes": s.peak_gathered_bytes, "peak_held_grad_bytes": s.peak_held_grad_bytes,
                "peak_state_bytes": s.peak_state_bytes + memory["optimizer"], "unit_sizes": s.unit_sizes()}


def build_optimizer(model, params: dict, layers: list, groups: dict, mesh, make, plan):
    """This rank's data parallelism for ``plan``'s ZeRO stage, the one place the stage is dispatched
    on: :class:`Replicated` (0), :class:`ShardedOptimizer` (1, 2) or :class:`FullyShardedState` (3),
    each with the ``optimizer`` (made by the factory ``make``) over this rank's states (``params``,
    by single-device name, of ``model``'s ``layers`` this rank runs), what runs after backward
    (``finish``), ``memory()``, what the run reports (``measured``) and the parameters whole
    (``gather_params``)."""
    g, zero = groups, plan.zero
    dense = [q for n, q in params.items() if not experts.is_expert(n)]
    expert = [q for n, q in params.items() if experts.is_expert(n)]
    mine = {id(d) for d in dense}
    units = [u for u in ([q for q in layer.parameters() if id(q) in mine] for layer in layers) if u]
    if zero == 0:
        reducer = Reducer(dense, g["dp_cp"], plan.bucket_cap_mb, overlap=False) if mesh.dp * mesh.cp > 1 else None
        return Replicated(make(list(params.values())), reducer, model, params, g, mesh)
    if zero in (1, 2):   # dense state over dp·cp, the experts' over their expert-dp group, as one unit
        # (stage 2: gradients reduce-scattered layer by layer, each micro-batch's into the shard;
        # the experts' then scaled ÷ ep); ZeRO-1 with expert_dp = 1 shards nothing
        parts = [stage_optimizer(zero, units, make, g["dp_cp"])]
        if expert:
            parts.append(stage_optimizer(zero, [expert], make, g["expert_dp"]) if zero == 2 or mesh.expert_dp > 1
                         else make(expert))
        return ShardedOptimizer(zero, parts, model, params, mesh)
    hsdp = plan.dp_shard is not None and plan.dp_shard < mesh.dp   # ZeRO-3 within dp_shard
    if hsdp:
        g.update(hsdp_groups(mesh, plan.dp_shard))
    reshard = reshard_policy(plan.reshard_after_forward, mesh.pp)
    # a pipeline rank holds some layers only: shard a container of them, named back to the GPT
    module = model if mesh.pp == 1 else nn.ModuleList(layers)
    where = {id(q): n for n, q in model.named_parameters()}
    names = {n: where[id(q)] for n, q in module.named_parameters()}
    parts, shards, expert_shards = [], [], []
    dense_group = g.get("dp_shard", g["dp_cp"])     # HSDP: within the block (:mod:`.hsdp`)
    for j, group in enumerate([dense_group] + ([g["expert_dp"]] if expert else [])):   # dense, experts
        # each state ignores the other's parameters (per-parameter: the dense ones are shards by now)
        ignored = [q for n, q in module.named_parameters() if experts.is_expert(names[n]) != (j == 1)]
        parts.append(shard_module(module, group, plan.sharding, units=layers, reshard_after_forward=reshard,
                                  ignored_params=ignored))
        if plan.sharding == "per-parameter":     # the module's own parameters are the shards now
            held = [q for n, q in module.named_parameters() if experts.is_expert(names[n]) == (j == 1)]
        else:
            held = list(parts[-1].parameters())
        shards += held
        expert_shards += held if j == 1 else []
    state = ShardedStates(parts, names, expert_shards, where, {id(m): n for n, m in model.named_modules()})
    # the pipeline calls the layers one by one, never the model: start each forward's unit order
    layers[0].register_forward_pre_hook(lambda m, a: state.start_forward(), prepend=True)
    return FullyShardedState(make(shards), state, g, mesh, hsdp)


def apply_dp(parts, make, plan):
    """The composition's last step (:func:`minipar.hybrid.parallelize`): data parallelism over what the
    earlier steps made (``parts``: the model, this rank's parameters and stages, the groups and the
    mesh) for ``plan``'s ZeRO stage, sharding and policy (:func:`build_optimizer`); its ``finish`` is
    registered as the step's work after backward."""
    layers = [layer for s in sorted(parts.stages) for layer in parts.stages[s]]
    dp = build_optimizer(parts.model, parts.params, layers, parts.groups, parts.mesh, make, plan)
    parts.register(finish=dp.finish)
    return dp
