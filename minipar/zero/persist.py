"""ZeRO-3's persistent parameters: small parameters kept whole on every rank.

DeepSpeed's ``stage3_param_persistence_threshold`` (its ZeRO stage-3 configuration):
gathering a 64-element norm weight costs a collective and its latency for almost no bytes,
so parameters below a size stay unsharded.
Here, with Ψ_p such elements, each rank holds them whole and

    ḡ_p = (1/N) Σ_j g_p^(j)                 one all-reduce (mean) per backward, after every
                                            unit's reduce-scatter, the same on every rank

so every rank applies the same update to the same replica. Memory per rank
(4 + 4 + K)Ψ_p (fp32) on top of stage 3's (4 + 4 + K)(Ψ - Ψ_p)/N; communication
2(N-1)/N·Ψ_p instead of 3(N-1)/N·Ψ_p, and a unit left with nothing to shard needs no
gather at all (:func:`minipar.cost.zero_bytes_per_rank`, ``persistent=``).

Under mixed precision (``param_dtype=``, FSDP2's ``MixedPrecisionPolicy``) only the sharded
parameters are cast: the persistent ones stay fp32, their modules compute in fp32
(:func:`compute_in_fp32` casts the inputs up and the outputs back to ``param_dtype``), and
their gradients, fp32 like them, are averaged in fp32 whatever the sharded ones'
``reduce_dtype``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import all_reduce_gradients


def persistent_parameters(module: nn.Module, persist_below: int | None = None, persist=None,
                          param_dtype=None) -> list[nn.Parameter]:
    """The parameters stage 3 keeps whole (DeepSpeed's ``stage3_param_persistence_threshold``):
    those with fewer than ``persist_below`` elements, and those of the modules for which
    ``persist(module)`` is true, in ``module``'s order (they are not cast by ``param_dtype``:
    :func:`compute_in_fp32`). They are replicated on every rank and
    never gathered; their gradients are all-reduced (averaged) in one call after every unit's
    reduce-scatter, so each costs 4 + 4 + K bytes per element on every rank instead of
    (4 + 4 + K)/N, and a unit left with none to shard costs no collective at all."""
    if persist_below is None and persist is None:
        return []
    if persist_below is not None and (not isinstance(persist_below, int) or persist_below < 0):
        raise ValueError(f"persist_below must be a number of elements (an int >= 0), got {persist_below!r}")
    out = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if p.requires_grad and (
                    (persist_below is not None and p.numel() < persist_below) or (persist is not None and persist(m))):
                out[id(p)] = p
    return list(out.values())


@torch.no_grad()
def reduce_persistent(params, group=None, dtype=None) -> None:
    """ḡ_p = (1/N) Σ_j g_p^(j): the persistent parameters' gradients (zeros where this rank has
    none) averaged over ``group`` in one all-reduce (in ``dtype``, default theirs), so every
    rank then holds the same full gradient. Stage 3 calls it after every unit's reduce-scatter."""
    all_reduce_gradients(params, op="avg", group=group, dtype=dtype, name="all_reduce", persistent=True)


def _cast(x, dtype):
    if torch.is_tensor(x) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(t, dtype) for t in x)
    return x


def compute_in_fp32(module: nn.Module, persistent, param_dtype) -> None:
    """Under ``param_dtype`` (fp16, bf16): every module that owns a persistent parameter computes
    in fp32, its floating inputs cast to fp32 before its forward and its floating outputs back
    to ``param_dtype`` after it, so the sharded layers around it see ``param_dtype`` activations.
    Nothing to do in fp32."""
    if param_dtype in (None, torch.float32) or not persistent:
        return
    kept = {id(p) for p in persistent}
    for m in module.modules():
        if any(id(p) in kept for p in m.parameters(recurse=False)):
            m.register_forward_pre_hook(lambda m, args: _cast(args, torch.float32))
            m.register_forward_hook(lambda m, args, out: _cast(out, param_dtype))
