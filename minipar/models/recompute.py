"""Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022, §5) for the GPT blocks.

A block's forward keeps tensors for its backward (Korthikanti et al.'s ``sbh(34 + 5as/h)``
per layer, :mod:`minipar.cost.recompute`). Recomputation keeps less and runs part of the
forward again during backward:

* ``"none"``: keep everything.
* ``"selective"``: the attention core ``softmax(QKᵀ/√d + mask)·V`` (with its dropout) keeps
  only Q, K and V and is recomputed in backward; those are the ``5as/h`` terms, which grow
  with s², for a few percent of the FLOPs. With fused attention (``GPTConfig.attention="sdpa"``)
  this is what the kernel does by itself (FlashAttention's backward recomputes P = exp(S - lse)
  from Q, K, V, O and lse; the scores are never stored), so "selective" then adds nothing:
  the core is not checkpointed a second time (it would keep 0.2% fewer bytes for one more
  attention forward; measured in ``python -m minipar.bench recompute``).
* ``"full"``: a block keeps only its input (2sbh in 16-bit; (B, T/t, h) with sequence
  parallelism) and its whole forward runs again in backward, about one third more FLOPs.

Both are :func:`torch.utils.checkpoint.checkpoint` (non-reentrant: gradients flow to
parameters and inputs alike, and the random state is replayed, so dropout masks match).
Blocks have a ``recompute`` attribute (from ``GPTConfig.recompute``); :func:`set_recompute`
changes it on every block of a model, single-device or tensor-parallel.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils.checkpoint import checkpoint

from ..autograd import split_backward

MODES = ("none", "selective", "full")


def check_mode(mode) -> str:
    """``mode`` (``None`` is ``"none"``), or a plain ``ValueError``."""
    mode = "none" if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")
    return mode


def run(fn, mode_is_on: bool, *args):
    """``fn(*args)``, recomputed in backward when ``mode_is_on`` and a graph is being built.

    Inside :func:`~minipar.autograd.split_backward.deferred` (the pipeline's split backward),
    the forward and its recomputation both defer the linear layers' weight gradients, keeping
    X among the saved tensors that recomputation drops and rebuilds."""
    if mode_is_on and torch.is_grad_enabled():
        dw = split_backward.current()
        ctx = (lambda: split_backward.deferred(dw, saved=True)) if dw is not None else nullcontext
        return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (ctx(), ctx()))
    return fn(*args)


def set_recompute(model: torch.nn.Module, mode) -> torch.nn.Module:
    """Set ``recompute = mode`` on every block and attention of ``model``; returns it."""
    mode = check_mode(mode)
    for m in model.modules():
        if hasattr(m, "recompute"):
            m.recompute = mode
    return model


def apply_recompute(model: torch.nn.Module, plan) -> torch.nn.Module:
    """The composition's fifth step: ``plan.recompute`` (``None``: the model's own) in every block
    of the model as the earlier steps left it (tensor-parallel blocks, context-parallel attention)."""
    if plan.recompute is not None:
        (model.set_recompute if hasattr(model, "set_recompute") else lambda m: set_recompute(model, m))(plan.recompute)
    return model
