"""The backward split in two, as zero-bubble schedules need it: B (input gradients) now,
W (weight gradients) later.

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", §2, Figure 1): the backward of a
linear layer ``Y = X Wᵀ + b`` is two independent matrix multiplies,

    B:   ∂L/∂X = ∂L/∂Y · W                                 (the previous stage waits for it)
    W:   ∂L/∂W = (∂L/∂Y)ᵀ · X,    ∂L/∂b = Σ_rows ∂L/∂Y      (only the optimizer needs it)

Inside ``with deferred(dw):`` ``torch.nn.functional.linear`` (which ``nn.Linear`` and the
tensor-parallel layers call) is :func:`linear`; nothing else of the forward changes. Each
linear layer runs with its weight and bias detached, so autograd's own backward (part of
B) computes only ∂L/∂X, and a hook on its output appends ``(X, ∂L/∂Y)`` to the
:class:`WeightGrads` list ``dw``. ``dw.apply()`` (W) then computes the weight gradients
from them: no second walk over the graph, no recomputation and no communication (with
tensor parallelism, Megatron's f all-reduces ∂L/∂X once, in B). B + W does the work of
one fused backward. The parameters of the other layers (layer norms, embeddings: a
small share of the FLOPs) get their gradients in B, as in a plain backward.

Under activation recomputation (:mod:`minipar.models.recompute`) X must be saved the way
autograd saves tensors, so that recomputation can drop it: there (and for an X that needs
no gradient, whose output would get no hook) the layer is :class:`DeferredLinear`, an
autograd function with the same B and W.

A linear that is its own autograd function (sequence parallelism's ``gather_linear``)
is not split: its weight gradient stays in B.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F


class WeightGrads(list):
    """``(X, ∂L/∂Y, weight, bias)`` of one micro-batch's linear layers, kept by B for W."""

    @torch.no_grad()
    def apply(self) -> None:
        """W: ``weight.grad += (∂L/∂Y)ᵀ X`` and ``bias.grad += Σ ∂L/∂Y`` for every entry
        (in the compute dtype of the forward, accumulated in the parameter's dtype); last
        kept first, while its ∂L/∂Y is still in the cache."""
        for x, dy, weight, bias in reversed(self):
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype)
            if weight.grad is not None and weight.grad.dtype == dy2.dtype:
                weight.grad.addmm_(dy2.t(), x2)          # += in the same pass over memory
            else:
                _accumulate(weight, dy2.t() @ x2)
            if bias is not None:
                _accumulate(bias, dy2.sum(0))
        self.clear()


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


class DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward computes ∂L/∂X only and queues ``(X, ∂L/∂Y)`` for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, dw: WeightGrads):
        ctx.dw = dw
        ctx.params = (weight, bias)         # the parameters themselves (activation checkpointing
        ctx.save_for_backward(x)            # would hand back detached copies of saved ones)
        return _plain_linear(x, weight, bias)    # under autocast: in the autocast dtype

    @staticmethod
    def backward(ctx, dy):
        (x,), (weight, bias) = ctx.saved_tensors, ctx.params
        ctx.dw.append((x, dy, weight, bias))
        dx = dy @ weight.to(dy.dtype) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


_plain_linear = F.linear
_active: list[tuple[WeightGrads, bool]] = []     # the open deferred() blocks, innermost last


def linear(input, weight, bias=None):
    """``F.linear`` inside :func:`deferred`: B's half of the layer when a graph is being
    built through the weight, the plain layer otherwise."""
    if not (_active and weight.requires_grad and torch.is_grad_enabled()):
        return _plain_linear(input, weight, bias)
    dw, saved = _active[-1]
    if saved or not input.requires_grad:
        return DeferredLinear.apply(input, weight, bias, dw)
    out = _plain_linear(input, weight.detach(), None if bias is None else bias.detach())
    x = input.detach()
    out.register_hook(lambda dy: dw.append((x, dy, weight, bias)))
    return out


def current() -> WeightGrads | None:
    """The ``dw`` of the innermost open :func:`deferred` block."""
    return _active[-1][0] if _active else None


@contextmanager
def deferred(dw: WeightGrads, saved: bool = False):
    """``with deferred(dw): out = stage(x)``: the linear layers of this forward leave their
    weight gradients to ``dw.apply()``; ``saved=True`` keeps X among autograd's saved
    tensors (activation recomputation)."""
    _active.append((dw, saved))
    F.linear = linear
    try:
        yield dw
    finally:
        _active.pop()
        if not _active:
            F.linear = _plain_linear
