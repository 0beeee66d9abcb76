"""Memory anatomy: the bytes one rank holds in each component of training.

Four components (Rajbhandari et al. 2020, §3): **parameters**, **gradients**, **optimizer
state** and **activations** (tensors autograd saves for the backward pass), counted so:

* a component's bytes are the sizes of the distinct *storages* behind its tensors
  (``untyped_storage().nbytes()``): views into one flat buffer count once, padding
  included; a freed buffer (storage resized to 0) counts 0;
* optimizer state = the *per-element* state tensors (Adam's ``exp_avg`` and ``exp_avg_sq``,
  SGD's ``momentum_buffer``), plus the fp32 master weights under mixed precision; Adam's
  scalar ``step`` (4 bytes per tensor) is not per-parameter memory. Hence K = 8 for fp32 Adam;
* activations, parameters excluded, as every chapter counts them
  (:class:`minipar.activations.SavedActivations`).

These are tensor bytes this process owns, not its resident memory (RSS), which also holds
the Python interpreter, torch's libraries and allocator slack.
"""
from __future__ import annotations

import torch

from .activations import SavedActivations  # noqa: F401 - re-exported: one counter for every chapter


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` entries skipped)."""
    storages = [t.untyped_storage() for t in tensors if t is not None]
    return sum(nbytes for _, nbytes in {(s.data_ptr(), s.nbytes()) for s in storages})


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-element state: tensors as large as their parameter (the
    scalar ``step`` counters are left out)."""
    return [v for p, st in optimizer.state.items() for v in st.values()
            if torch.is_tensor(v) and v.numel() == p.numel() and v.dim() > 0]


def held_state_bytes(strategy, model: torch.nn.Module | None = None,
                     optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "total"}`` bytes this rank holds, counted from its tensors
    (the planner's formula for the same is :func:`minipar.plan.model_state_bytes`).

    ``strategy``: anything with ``memory_tensors()`` (the ZeRO optimizers, or
    ``FullyShardedDataParallel`` with its ``optimizer`` passed), or a plain model with
    its plain ``optimizer`` (single process or replicated data parallelism)."""
    if hasattr(strategy, "memory_tensors"):
        parts = strategy.memory_tensors(optimizer) if optimizer is not None else strategy.memory_tensors()
    else:
        params = list(strategy.parameters())
        parts = {"params": params, "grads": [p.grad for p in params],
                 "optimizer": state_tensors(optimizer) if optimizer is not None else []}
    out = {k: storage_bytes(v) for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out
