"""What one rank holds, as pieces of the single-device model: parameters and optimizer state.

:func:`parameter_layout` gives every parameter a rank holds its single-device name, full
shape and boxes (:mod:`.boxes`):

* a plain model (one process, a data-parallel replica, or a pipeline stage whose
  parameters are named as in the full model): each parameter is the whole tensor;
* :class:`~minipar.tensor_parallel.TensorParallelGPT`: the boxes of the Megatron-LM split;
* :class:`~minipar.hybrid.HybridModel`: this rank's pipeline stages' parameters, named as
  in the single-device GPT, each a tensor-parallel shard of its tp group;
* any object with a method ``checkpoint_layout()`` returning that list itself.

:func:`local_pieces` adds the optimizer state under the same names: a torch optimizer's
state shaped like each parameter (AdamW's ``exp_avg``, ``exp_avg_sq``) and scalars
(``step``); a ZeRO optimizer's (:class:`minipar.zero.ZeroOptimizer`) state of a flat range
of each unit becomes flat-range pieces of the parameters it spans. A ZeRO-3 mesh
(:class:`~minipar.hybrid.HybridModel` with ``zero=3``, flat or per-parameter, HSDP too) holds
only shards of its parameters: each shard's ``shard_spans`` (which elements of which parameter
it holds) makes flat-range pieces of the parameters and of the optimizer state stepping it.
"""
from __future__ import annotations

import torch

from ..hybrid import HybridModel
from ..tensor_parallel.gpt import TensorParallelGPT, weight_layout
from ..tensor_parallel.ops import size_and_rank
from ..zero import FullyShardedDataParallel
from .boxes import Piece, pieces_of, tensor_parallel_boxes, whole

PARAM = "param"


def parameter_layout(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, tuple, list]]:
    """``[(full name, parameter, full shape, boxes)]`` for the parameters this rank holds."""
    if hasattr(model, "checkpoint_layout"):
        return list(model.checkpoint_layout())
    if isinstance(model, FullyShardedDataParallel):  # its parameters are flat shards
        raise NotImplementedError("checkpointing a ZeRO-3 (FullyShardedDataParallel) model is not "
                                  "supported; checkpoint the wrapped model after gathering it")
    if isinstance(model, HybridModel):  # its stages' parameters, by single-device name
        return tensor_parallel_layout(model.params.items(), model.mesh.tp, model.coords["tp"], weight_layout)
    if isinstance(model, TensorParallelGPT):
        t, r = size_and_rank(model.group)
        return tensor_parallel_layout(model.named_parameters(), t, r, weight_layout)
    return [(n, p, tuple(p.shape), whole(p.shape)) for n, p in model.named_parameters()]


def tensor_parallel_layout(named_parameters, t: int, r: int, layout) -> list:
    """The layout of tensor-parallel parameters: ``layout(name)`` is the split kind."""
    out = []
    for n, p in named_parameters:
        kind, full = layout(n), list(p.shape)
        if kind in ("rows", "qkv", "cols"):  # the split dimension grows t times
            full[1 if kind == "cols" else 0] *= t
        out.append((n, p, tuple(full), tensor_parallel_boxes(kind, full, t, r)))
    return out


def _is_zero(optimizer) -> bool:
    return hasattr(optimizer, "shard_states")   # ZeroOptimizer, Zero2Optimizer


def _state_pieces(name, full_shape, boxes, param, key, value, lo=0, hi=None, flat=None):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"optimizer state {key!r} of {name} is a {type(value).__name__}; "
                        "only tensor state can be checkpointed")
    if value.dim() == 0:  # a scalar shared by the tensor (AdamW's step): replicated
        return pieces_of(name, key, (), whole(()), value.detach().reshape(1))
    return pieces_of(name, key, full_shape, boxes, param, lo, hi,
                     value.detach().reshape(-1) if flat is None else flat)


def local_pieces(model, optimizer=None, saved_keys: dict | None = None) -> list[Piece]:
    """Every piece this rank holds: parameters (key ``"param"``) then optimizer state.

    Each piece's ``data`` is a view of the live tensor. ``saved_keys`` (loading):
    ``{name: {key: scalar?}}`` of a checkpoint, to create optimizer state that does not
    exist yet (a fresh optimizer has none until its first step). An object with a method
    ``held_pieces()`` lists its pieces itself (a rank's holdings between two process groups)."""
    if hasattr(model, "held_pieces"):   # a stand-in that lists its pieces itself (adapt.membership)
        return list(model.held_pieces())
    layout = parameter_layout(model)
    if getattr(model, "sharded", None) is not None:   # ZeRO-3 on the mesh: shards only
        return _sharded_pieces(model.sharded.shard_spans(), layout, optimizer, saved_keys)
    out = [q for name, p, full, boxes in layout for q in pieces_of(name, PARAM, full, boxes, p.detach())]
    if optimizer is None:
        return out
    where = {id(p): (name, full, boxes, p) for name, p, full, boxes in layout}
    for part in getattr(optimizer, "parts", [optimizer]):   # several stepped as one: each part's
        out += _optimizer_pieces(part, where, saved_keys)
    return out


def _optimizer_pieces(optimizer, where: dict, saved_keys) -> list[Piece]:
    if _is_zero(optimizer):
        return _zero_pieces(optimizer, where, saved_keys)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in where:
                raise ValueError("the optimizer holds a parameter the model does not name")
            name, full, boxes, _ = where[id(p)]
            state = optimizer.state[p]
            if saved_keys is not None:
                _create_state(state, saved_keys.get(name, {}), p)
            for key, value in state.items():
                if value is not None:  # e.g. SGD's momentum buffer before the first step
                    out += _state_pieces(name, full, boxes, p.detach(), key, value)
    return out


def _zero_pieces(opt, where: dict, saved_keys) -> list[Piece]:
    """Flat-range pieces of each unit's shard of optimizer state (ZeRO stage 1 or 2)."""
    out = []
    for unit, shard, state in opt.shard_states():
        spans = unit.shard_spans()   # (parameter, its elements [a, b), from shard element s)
        if saved_keys is not None:   # the keys of every parameter the shard spans
            keys = {k: v for p, *_ in spans for k, v in saved_keys.get(where[id(p)][0], {}).items()}
            _create_state(state, keys, shard)
        for p, a, b, s in spans:
            name, full, boxes, _ = where[id(p)]
            for key, value in state.items():
                if value is not None:
                    flat = value.detach().reshape(-1)[s:s + b - a] if value.dim() else None
                    out += _state_pieces(name, full, boxes, p.detach(), key, value, a, b, flat)
    return out


def _sharded_pieces(spans, layout, optimizer, saved_keys) -> list[Piece]:
    """ZeRO-3: ``spans`` ``(name, shard, a, b, s)`` (elements [a, b) of the local parameter
    ``name`` are the shard's [s, s + b - a)) as flat-range pieces of the parameters, then of the
    optimizer's state of each shard (created first when loading)."""
    info = {name: (full, boxes, p) for name, p, full, boxes in layout}
    out, by_shard = [], {}
    for name, shard, a, b, s in spans:
        full, boxes, p = info[name]
        out += pieces_of(name, PARAM, full, boxes, p, a, b, shard.detach().reshape(-1)[s:s + b - a])
        by_shard.setdefault(id(shard), (shard, []))[1].append((name, a, b, s))
    if optimizer is None:
        return out
    for shard, covered in by_shard.values():
        state = optimizer.state[shard]
        if saved_keys is not None:
            _create_state(state, {k: v for name, *_ in covered for k, v in saved_keys.get(name, {}).items()},
                          shard)
        for name, a, b, s in covered:
            full, boxes, p = info[name]
            for key, value in state.items():
                if value is not None:
                    flat = value.detach().reshape(-1)[s:s + b - a] if value.dim() else None
                    out += _state_pieces(name, full, boxes, p, key, value, a, b, flat)
    return out


def _create_state(state: dict, keys: dict, like: torch.Tensor) -> None:
    """Make the optimizer state a checkpoint has (zeros of the right shape) if missing."""
    for key, (scalar, dtype) in keys.items():
        # a scalar (Adam's step) lives on the CPU, as torch.optim keeps it; the rest beside the parameter
        if key != PARAM and key not in state:
            state[key] = (torch.zeros((), dtype=dtype, device="cpu") if scalar
                          else torch.zeros_like(like, dtype=dtype))
