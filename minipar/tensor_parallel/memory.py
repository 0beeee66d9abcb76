"""Measuring activation memory: the bytes autograd keeps for the backward pass.

On a GPU one would read the allocator's peak. On CPU (and to see exactly which tensors
count) we hook autograd's saved tensors (``torch.autograd.graph.saved_tensors_hooks``):
every tensor an operation stores for its backward passes through ``pack``, once per
operation. This is the quantity Korthikanti et al. (2022, Section 4.1) count as
"activation memory": the tensors held between forward and backward.

Parameters are not activations and are left out (matched by storage), and a tensor saved
by several operations (softmax's output, read again by ``att @ v``) counts once.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class SavedBytes:
    """What :func:`saved_activations` counted: ``bytes`` in total and ``tensors`` as
    ``(shape, dtype, bytes)`` tuples, in the order they were saved."""

    bytes: int = 0
    tensors: list = field(default_factory=list)


def _key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)


@contextmanager
def saved_activations(exclude=()):
    """Count the bytes autograd saves for backward inside the ``with`` block.

    ``exclude``: tensors (usually ``model.parameters()``) not to count, nor their views::

        with saved_activations(model.parameters()) as saved:
            loss = model(x, y)
        saved.bytes
    """
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen, out = set(), SavedBytes()

    def pack(t):
        key = _key(t)
        if key[0] not in skip and key not in seen:
            seen.add(key)
            n = t.numel() * t.element_size()
            out.bytes += n
            out.tensors.append((tuple(t.shape), t.dtype, n))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out
