"""Activation memory: the bytes autograd keeps for the backward pass, measured one way.

Every chapter counts activations with :class:`SavedActivations` (model parallelism's stages,
tensor parallelism's blocks, ZeRO's runs). Rather than read a GPU allocator's peak, it hooks
autograd's saved tensors (``torch.autograd.graph.saved_tensors_hooks``: every tensor an
operation stores for its backward passes through ``pack``), so it works on any device and shows
which tensors count: what Korthikanti et al. (2022, §4.1) call activation memory, the tensors
held between forward and backward, counted at the end of the forward, where they peak (the
backward frees them as it goes). The rules:

* a tensor counts ``numel · element_size`` bytes, once, however many operations save it
  (softmax's output, read again by ``att @ v``): it is keyed by (storage, offset, size, dtype);
* the parameters to ``exclude`` (a module, or tensors) and their views are not activations:
  they are matched by storage when saved, so a parameter whose storage is gathered anew
  (ZeRO-3) is still recognised."""
from __future__ import annotations

import torch


class SavedActivations:
    """``with SavedActivations(model) as saved: loss = model(x, y)``, then ``saved.bytes``
    (in total) and ``saved.tensors`` (``(shape, dtype, bytes)`` in the order saved).
    ``exclude``: a module (its parameters) or an iterable of tensors not to count."""

    def __init__(self, exclude=()):
        self._exclude = exclude if isinstance(exclude, torch.nn.Module) else list(exclude)
        self.bytes, self.tensors, self._seen = 0, [], set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _excluded(self) -> set[int]:
        ps = self._exclude.parameters() if isinstance(self._exclude, torch.nn.Module) else self._exclude
        return {p.untyped_storage().data_ptr() for p in ps}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key not in self._seen and key[0] not in self._excluded():
            self._seen.add(key)
            n = t.numel() * t.element_size()
            self.bytes += n
            self.tensors.append((tuple(t.shape), t.dtype, n))
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._hooks.__exit__(*exc)
        return False


def saved_activation_bytes(fn, exclude=()) -> tuple[int, object]:
    """``(bytes, fn())``: the distinct storages saved for the backward while ``fn()`` runs,
    not counting those of the tensors in ``exclude`` (e.g. ``model.parameters()``).

    The storage-level count, beside :class:`SavedActivations`'s view-level one: a storage
    counts whole, once, however many views of it are saved (context parallelism's K/V blocks
    are views of one received buffer, and the buffer is what stays alive); what
    :func:`minipar.cost.cp_activation_bytes` predicts."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out
