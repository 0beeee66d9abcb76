"""Measuring activation memory: the bytes autograd saves for the backward.

Every tensor a forward saves passes through ``torch.autograd.graph.saved_tensors_hooks``;
:func:`saved_activation_bytes` sums their distinct storages, leaving out the parameters (model
states, not activations): what :func:`minipar.cost.cp_activation_bytes` predicts.
"""
from __future__ import annotations

import torch


def saved_activation_bytes(fn, exclude=()) -> tuple[int, object]:
    """``(bytes, fn())``: the distinct storages saved for the backward while ``fn()`` runs,
    not counting those of the tensors in ``exclude`` (e.g. ``model.parameters()``)."""
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
