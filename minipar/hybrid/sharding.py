"""ZeRO on the mesh: which stage shards what, over which group (Rajbhandari et al. 2020, §5).

The data-parallel group of the mesh (``dp_cp``: the ranks that differ only in d and c) holds
replicas of the same parameters (each a tensor-parallel shard of its tp group), so ZeRO
shards those replicas' model states over it, exactly as over plain data parallelism:

========  ================================================  =============================
stage     what each rank keeps (Ψ_r: its stages' tp shard)   where
========  ================================================  =============================
1         params and grads Ψ_r, optimizer state Ψ_r / N       every layout (pp, cp, ep too)
2         + gradients reduce-scattered: Ψ_r / N               dp × cp × tp × pp (dense)
3         + parameters sharded, gathered per layer            dp × cp × tp × pp (dense),
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
accumulated gradients once, after the last micro-batch (:meth:`minipar.zero.stage3.Schedule.finish_step`;
one all-gather per unit per step instead of 2m), and reshards after every use without one.

Expert parameters (a mixture-of-experts GPT, ``ep``) are replicated only over their
expert-data-parallel group, so under ZeRO-1 their optimizer state is sharded over that group
(``expert_dp``, dp·cp/ep ranks), the dense state over dp·cp.
"""
from __future__ import annotations

import torch.nn as nn

from ..data_parallel import Reducer
from ..zero import FullyShardedDataParallel, ZeroOptimizer, fully_shard
from ..zero.per_parameter import sharded_state
from ..zero.stage2 import Zero2Optimizer
from . import experts


RESHARD_POLICIES = ("auto", "always", "never")


def reshard_policy(policy: str, pp: int) -> bool:
    """Stage 3's ``reshard_after_forward``: ``"always"`` True, ``"never"`` False, ``"auto"``
    True without a pipeline (one forward per step: nothing to keep) and False with one."""
    if policy not in RESHARD_POLICIES:
        raise ValueError(f"reshard_after_forward={policy!r} must be one of {RESHARD_POLICIES}")
    return policy == "always" or (policy == "auto" and pp == 1)


class StageShards:
    """Stage 3 over this rank's pipeline stages: the :class:`~minipar.zero.stage3.Schedule`
    (or wrapper) ``state`` of a container of the stages' layers, its parameters' names given
    back as the single-device GPT's (``names``: container name -> model name)."""

    def __init__(self, state, names: dict[str, str]):
        self.state, self.names = state, names

    def __getattr__(self, name):
        return getattr(self.__dict__["state"], name)

    def gather_full_params(self) -> dict:
        return {self.names[k]: v for k, v in self.state.gather_full_params().items()}


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
    if zero == 1:   # dense state over dp·cp, the experts' over their expert-dp group
        parts = [ZeroOptimizer(units, make, group=g["dp_cp"])]
        if expert:
            parts.append(ZeroOptimizer([expert], make, group=g["expert_dp"]) if mesh.expert_dp > 1
                         else make(expert))
        return (parts[0] if len(parts) == 1 else experts.Optimizers(parts)), None, None
    if zero == 2:   # gradients reduce-scattered layer by layer, each micro-batch's into the shard
        return Zero2Optimizer(units, make, group=g["dp_cp"]), None, None
    reshard = reshard_policy(reshard_after_forward, mesh.pp)
    # a pipeline rank holds some layers only: shard a container of them, named back to the GPT
    module = hm.model if mesh.pp == 1 else nn.ModuleList(layers)
    where = {id(q): n for n, q in hm.model.named_parameters()}
    names = {n: where[id(q)] for n, q in module.named_parameters()}
    if sharding == "per-parameter":
        fully_shard(module, group=g["dp_cp"], units=layers, reshard_after_forward=reshard)
        state = sharded_state(module)
        params = list(module.parameters())
    else:
        state = FullyShardedDataParallel(module, group=g["dp_cp"], units=layers,
                                         reshard_after_forward=reshard)
        params = list(state.parameters())
    if module is not hm.model:
        state = StageShards(state, names)
    # the pipeline calls the layers one by one, never the model: start each forward's unit order
    layers[0].register_forward_pre_hook(lambda m, a: state.start_forward(), prepend=True)
    return make(params), None, state
