"""ZeRO on the mesh: which stage shards what, over which group (Rajbhandari et al. 2020, §5).

The data-parallel group of the mesh (``dp_cp``: the ranks that differ only in d and c) holds
replicas of the same parameters (each a tensor-parallel shard of its tp group), so ZeRO
shards those replicas' model states over it, exactly as over plain data parallelism:

========  ================================================  =============================
stage     what each rank keeps (Ψ_r: its stages' tp shard)   where
========  ================================================  =============================
1         params and grads Ψ_r, optimizer state Ψ_r / N       every layout (pp, cp, ep too)
2         + gradients reduce-scattered: Ψ_r / N               dp × tp (pp = cp = 1)
3         + parameters sharded, gathered per layer            dp × tp (pp = cp = 1),
          (``sharding="flat"``: FSDP's flat units;             ``FullyShardedDataParallel``
          ``"per-parameter"``: FSDP2's ``fully_shard``)        or ``fully_shard``
========  ================================================  =============================

Expert parameters (a mixture-of-experts GPT, ``ep``) are replicated only over their
expert-data-parallel group, so under ZeRO-1 their optimizer state is sharded over that group
(``expert_dp``, dp·cp/ep ranks), the dense state over dp·cp. Why stages 2 and 3 are refused
with a pipeline: :func:`minipar.hybrid.config.check_zero`.
"""
from __future__ import annotations

from ..data_parallel import Reducer
from ..zero import FullyShardedDataParallel, ZeroOptimizer, fully_shard
from ..zero.per_parameter import sharded_state
from ..zero.stage2 import Zero2Optimizer
from . import experts


def build_optimizer(hm, make, zero: int, sharding: str = "flat", bucket_cap_mb: float = 25.0):
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
    if zero == 2:   # gradients reduce-scattered layer by layer as backward completes them
        return Zero2Optimizer(units, make, group=g["dp"]), None, None
    if sharding == "per-parameter":
        fully_shard(hm.model, group=g["dp"], units=layers)
        state = sharded_state(hm.model)
        params = list(hm.model.parameters())
    else:
        state = FullyShardedDataParallel(hm.model, group=g["dp"], units=layers)
        params = list(state.parameters())
    # the pipeline calls the layers one by one, never the model: start each forward's unit order
    layers[0].register_forward_pre_hook(lambda m, a: state.start_forward(), prepend=True)
    return make(params), None, state
