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


# Contract:
# ex02.A.average: on return, every trainable parameter of ``params`` (each Parameter once) has
#     a ``.grad`` equal, on every rank of ``group``, to the mean over the group's ranks of their
#     gradients; a rank on which it has no gradient counts as zeros.
# ex02.A.frozen: a parameter with ``requires_grad=False`` keeps ``.grad`` None.
# ex02.A.dtype: each ``.grad`` has its parameter's dtype and shape.
# ex02.A.group: only ``group``'s ranks take part (None: the world); the mean divides by the
#     group's size, whatever the world's.
# ex02.A.bytes: the gradient bytes sent per call are ``cost.ddp_bytes_per_step`` of the
#     trainable parameters: every trainable gradient travels once per call, under
#     ``name="grad_all_reduce"``.
# ex02.A.fn: given ``all_reduce_fn(tensor, group)`` (it sums ``tensor`` over ``group`` in place),
#     every reduction goes through it and the result is the same mean.
# ex02.*.order: every rank of the group issues the same collectives, of the same sizes, in the
#     same order, even where backward reached a parameter on some ranks only.
# ex02.*.recorded: every collective goes through ``minipar.comm`` (or ``all_reduce_fn``), so the
#     trace records its bytes.
def allreduce_gradients(params, group=None, all_reduce_fn=None) -> None:
    """Average ``p.grad`` of every trainable parameter of ``params`` (e.g.
    ``model.parameters()``) over ``group``, after the backward. ``all_reduce_fn(tensor, group)``,
    if given, must sum ``tensor`` in place (e.g. your ``ring_all_reduce`` from exercise 01); the
    default is the backend's recorded all-reduce. A parameter with no gradient on this rank
    counts as zeros, and every rank calls the same collectives in the same order."""
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
