"""The backward split in two, as zero-bubble schedules need it: B (input gradients) now,
W (weight gradients) later.

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", §2, Figure 1): the backward of a
linear layer ``Y = X Wᵀ + b`` is two independent matrix multiplies,

    B:   ∂L/∂X = ∂L/∂Y · W                                 (the previous stage waits for it)
    W:   ∂L/∂W = (∂L/∂Y)ᵀ · X,    ∂L/∂b = Σ_rows ∂L/∂Y      (only the optimizer needs it)

Inside ``with deferred(dw):`` every linear layer of a forward (``nn.Linear``, and every
``F.linear``, such as the tensor-parallel layers' own) runs as :class:`DeferredLinear`.
Its autograd backward (part of B) returns only ∂L/∂X and appends ``(X, ∂L/∂Y)`` to the
:class:`WeightGrads` list ``dw``; ``dw.apply()`` (W) then computes the weight gradients
from them: no second walk over the graph, no recomputation and no communication (with
tensor parallelism, Megatron's f all-reduces ∂L/∂X once, in B). B + W does the work of
one fused backward. The parameters of the other layers (layer norms, embeddings: a
small share of the FLOPs) get their gradients in B, as in a plain backward.

A linear that is its own autograd function (sequence parallelism's ``gather_linear``)
is not split: its weight gradient stays in B.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class WeightGrads(list):
    """``(X, ∂L/∂Y, weight, bias)`` of one micro-batch's linear layers, kept by B for W."""

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
        return F.linear(x, weight, bias)    # under autocast: in the autocast dtype

    @staticmethod
    def backward(ctx, dy):
        (x,), (weight, bias) = ctx.saved_tensors, ctx.params
        ctx.dw.append((x, dy, weight, bias))
        dx = dy @ weight.to(dy.dtype) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


class deferred(TorchFunctionMode):
    """``with deferred(dw): out = stage(x)``: the linear layers of this forward leave their
    weight gradients to ``dw.apply()``."""

    def __init__(self, dw: WeightGrads):
        super().__init__()
        self.dw = dw

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            a = dict(zip(("input", "weight", "bias"), args), **kwargs)
            if a["weight"].requires_grad:
                return DeferredLinear.apply(a["input"], a["weight"], a.get("bias"), self.dw)
        return func(*args, **kwargs)
