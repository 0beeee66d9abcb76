"""Memory anatomy: the bytes one rank holds in each component of training.

Four components (Rajbhandari et al. 2020, §3): **parameters**, **gradients**,
**optimizer state** and **activations** (tensors autograd saves for the backward pass).
What is counted, precisely:

* a component's bytes are the sizes of the distinct *storages* behind its tensors
  (``untyped_storage().nbytes()``), so views into one flat buffer count once, padding
  included, and a freed buffer (storage resized to 0) counts 0;
* optimizer state = the optimizer's *per-element* state tensors (Adam's ``exp_avg`` and
  ``exp_avg_sq``, SGD's ``momentum_buffer``: tensors the size of their parameter), plus
  the fp32 master weights under mixed precision. Adam's scalar ``step`` counter (4 bytes
  per tensor) is not counted: it is not per-parameter memory. Hence K = 8 for fp32 Adam;
* activations = storages autograd saved during the forward (:class:`SavedActivations`),
  parameters excluded.

These are tensor bytes this process owns, not the process's resident memory (RSS), which
also holds the Python interpreter, torch's libraries and allocator slack.
"""
from __future__ import annotations

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` entries skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() and key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-element state: tensors as large as their parameter (the
    scalar ``step`` counters are left out)."""
    out = []
    for p, st in optimizer.state.items():
        out += [v for v in st.values() if torch.is_tensor(v) and v.numel() == p.numel() and v.dim() > 0]
    return out


def model_state_bytes(strategy, model: torch.nn.Module | None = None,
                      optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "total"}`` bytes on this rank.

    ``strategy``: anything with ``memory_tensors()`` (the ZeRO optimizers, or
    ``FullyShardedDataParallel`` with its ``optimizer`` passed), or a plain model with
    its plain ``optimizer`` (single process or replicated data parallelism).
    """
    if hasattr(strategy, "memory_tensors"):
        parts = strategy.memory_tensors(optimizer) if optimizer is not None else strategy.memory_tensors()
    else:
        params = list(strategy.parameters())
        parts = {"params": params, "grads": [p.grad for p in params],
                 "optimizer": state_tensors(optimizer) if optimizer is not None else []}
    out = {k: storage_bytes(v) for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


class SavedActivations:
    """Count the bytes autograd saves for the backward pass inside a ``with`` block.

    ``with SavedActivations(model) as a: loss = model(x, y)`` then ``a.bytes``: the
    distinct storages saved during the forward, except those of ``model``'s parameters
    (a saved weight, or a transposed view of it, is parameter memory, not activation
    memory). This is the activation memory alive at the end of the forward, when it
    peaks; the backward frees it as it goes.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self.bytes, self._seen, self._model = 0, set(), model
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        s = t.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in self._model.parameters()} if self._model else set()
        if not (t.is_leaf and t.requires_grad) and s.nbytes() and s.data_ptr() not in params | self._seen:
            self._seen.add(s.data_ptr())
            self.bytes += s.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False
