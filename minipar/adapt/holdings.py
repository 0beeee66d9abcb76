"""What one rank holds of the job's state under its layout, as global flat indices.

For a :class:`~minipar.hybrid.HybridModel` (dense GPT, ZeRO 0 or 1) every rank keeps

* ``param/<name>``: its parameters, each the rank's tensor-parallel shard (the whole tensor when
  tp = 1) of the single-device parameter, for the layers of its pipeline stages;
* ``<slot>/<name>``: the optimizer's per-element state (``exp_avg``, ``momentum_buffer``, ...):
  of the same elements under ZeRO-0, of its 1/N slice of each flat unit under ZeRO-1 (Rajbhandari
  et al. 2020, §5.1: rank r owns flat[r·k : (r+1)·k], :mod:`minipar.zero.flat`).

The indices come from the library's own sharding functions applied to ``arange`` (the shard of
the index tensor is the index of the shard), so a holding can never disagree with the layout it
describes. :func:`holdings` returns ``(index, tensors, scalars)``: the global indices, the local
flat tensors (views: writing them writes the state) and the 0-d state every rank shares (Adam's
``step``). :func:`prime` gives a fresh optimizer the state slots the old one had, so that they
can be written before its first step."""
from __future__ import annotations

import torch

from ..tensor_parallel.gpt import shard


def _param_index(hm) -> dict[str, torch.Tensor]:
    t, r = hm.mesh.tp, hm.coords["tp"]
    out = {}
    for name in hm.params:
        full = torch.arange(hm.full_shapes[name].numel()).view(hm.full_shapes[name])
        out[name] = (shard(name, full, t, r) if t > 1 else full).reshape(-1)
    return out


def _optimizer_pieces(hm):
    """``(name, global index, {slot: flat local tensor})`` for every per-element state piece."""
    idx, names = _param_index(hm), {id(p): n for n, p in hm.params.items()}
    opt = hm.optimizer
    if hm.zero == 1:
        for unit, shard_, state in opt.shard_states():
            for p, a, b, s0 in unit.shard_spans():
                n = names[id(p)]
                yield n, idx[n][a:b], {k: v[s0:s0 + b - a] for k, v in state.items()
                                        if torch.is_tensor(v) and v.dim() > 0}
    else:
        for n, p in hm.params.items():
            yield n, idx[n], {k: v.reshape(-1) for k, v in opt.state.get(p, {}).items()
                              if torch.is_tensor(v) and v.dim() > 0}


def _states(hm) -> list[dict]:
    """The wrapped torch optimizer's state dicts of this rank (one per parameter or shard)."""
    if hm.zero == 1:
        return [state for _, _, state in hm.optimizer.shard_states()]
    return [hm.optimizer.state.get(p, {}) for p in hm.params.values()]


def holdings(hm) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(index, tensors, scalars)`` of this rank of the :class:`~minipar.hybrid.HybridModel` ``hm``."""
    if hm.moe or hm.sharded is not None or hm.zero not in (0, 1):
        raise NotImplementedError("a live switch moves dense GPTs under ZeRO 0 or 1")
    index, tensors = {}, {}
    for n, i in _param_index(hm).items():
        index[f"param/{n}"], tensors[f"param/{n}"] = i, hm.params[n].data.view(-1)
    for n, i, slots in _optimizer_pieces(hm):
        for slot, v in slots.items():
            index[f"{slot}/{n}"], tensors[f"{slot}/{n}"] = i, v
    scalars = {}
    for state in _states(hm):
        scalars |= {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() == 0}
    return index, tensors, scalars


def prime(hm, slots: list[str], scalars: dict[str, torch.Tensor]) -> None:
    """Give ``hm``'s optimizer the per-element ``slots`` (zeros, to be overwritten by the switch)
    and the shared ``scalars`` (copies), as if it had stepped as often as the old one."""
    if not slots and not scalars:
        return
    if hm.zero == 1:
        targets = [(shard_, hm.optimizer.optim.state) for _, shard_, _ in hm.optimizer.shard_states()]
    else:
        targets = [(p, hm.optimizer.state) for p in hm.params.values()]
    for p, state in targets:
        state[p] = {**{k: torch.zeros_like(p.data) for k in slots},
                    **{k: v.clone() for k, v in scalars.items()}}


def slot_names(index: dict[str, torch.Tensor]) -> list[str]:
    """The optimizer's per-element slots present in a holding's keys."""
    return sorted({k.split("/", 1)[0] for k in index} - {"param"})
