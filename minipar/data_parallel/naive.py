"""Naive data parallelism: one all-reduce per parameter, after the backward pass.

Every rank holds a full replica and computes the gradient of the mean loss over its shard of
the global batch. With n equal shards the gradient of the global mean loss is the average of
the ranks' gradients (Dean et al. 2012; Goyal et al. 2017, eq. 1):

    g = 1/B Σ_{i<B} ∇ℓ(x_i) = 1/n Σ_r ( n/B Σ_{i in shard r} ∇ℓ(x_i) ) = 1/n Σ_r g_r

so every replica takes the single process's step. A parameter of Ψ_p values costs one
all-reduce sending 2(n-1)/n·Ψ_p values per rank (:func:`minipar.cost.collective_bytes`) plus
a latency α per ring step: many small parameters mean many latencies.
"""
from __future__ import annotations

import torch

from .. import comm


def trainable(params) -> list[torch.nn.Parameter]:
    """The parameters that get gradients: ``requires_grad`` ones, each once, in first-seen
    order (tied weights are one Parameter object appearing in two places)."""
    return list({id(p): p for p in params if p.requires_grad}.values())


def allreduce_gradients(params, group=None, all_reduce_fn=None) -> None:
    """Average ``p.grad`` over ``group``, in place, with one all-reduce per trainable parameter
    of ``params`` (e.g. ``model.parameters()``), in order. ``all_reduce_fn(tensor, group)``, if
    given, must sum ``tensor`` in place (e.g. your ``ring_all_reduce`` from exercise 01); the
    default is the backend's recorded all-reduce. A parameter with no gradient on this rank takes
    part with zeros (every rank must call the same all-reduces, in the same order)."""
    # >>> ex02 A
    n = comm.group_size(group)
    for p in trainable(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if all_reduce_fn is None:
            comm.all_reduce(p.grad, op="avg", group=group, name="grad_all_reduce")
        else:
            all_reduce_fn(p.grad, group)
            p.grad.div_(n)
    # <<< ex02 A


def flatten(tensors) -> torch.Tensor:
    """The tensors' values, concatenated into one flat (detached) tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def unflatten_into(tensors, flat: torch.Tensor) -> None:
    """Copy ``flat`` (as :func:`flatten` laid it out) back into ``tensors``."""
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0, group=None) -> None:
    """Copy every parameter and buffer of ``module`` from group rank ``src`` to all ranks, as one
    flat buffer per dtype with the recorded tree broadcast (⌈log2 n⌉ rounds): replicas start
    bit-identical."""
    if comm.group_size(group) == 1:
        return
    tensors = list(dict.fromkeys([*module.parameters(), *module.buffers()]))  # once each
    for dtype in sorted({t.dtype for t in tensors}, key=str):  # same order on every rank
        ts = [t for t in tensors if t.dtype == dtype]
        flat = flatten(ts)
        comm.broadcast(flat, src=src, group=group)
        unflatten_into(ts, flat)
