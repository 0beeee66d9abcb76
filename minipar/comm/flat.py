"""One all-reduce for many gradients: flatten, reduce, split back.

Every strategy that reduces a set of parameters' gradients outside a bucketed reducer (the
persistent parameters under ZeRO-3, the experts over their expert-dp group, context
parallelism's sum over cp) does the same three moves: lay the gradients end to end in one
buffer (a message of Σ numel elements instead of one per parameter: one α, not one per tensor),
all-reduce it, and give each parameter its slice back. They differ only in what the op is, what a
missing gradient means and where the result goes, which are the arguments here."""
from __future__ import annotations

import torch

from .native import all_reduce
from .p2p import group_size


@torch.no_grad()
def all_reduce_gradients(params, op: str = "sum", group=None, dtype=None, divide_by: float = 1,
                         missing: str = "zeros", in_place: bool = False, skip_alone: bool = False,
                         name: str = "grads", **labels) -> None:
    """Reduce the ``.grad`` of ``params`` over ``group`` in one flat all-reduce (``op``, in ``dtype``,
    default the first parameter's), then ÷ ``divide_by``. ``missing="zeros"``: a parameter without a
    gradient takes part as zeros and gets one; ``"skip"``: it is left out. ``in_place``: write into
    the existing gradients (their storage is kept); otherwise each parameter gets a gradient of its
    own, in its own dtype. ``skip_alone``: on a group of one rank, no collective (and no event)."""
    ps = [p for p in params if missing == "zeros" or p.grad is not None]
    if not ps:
        return
    dtype = dtype or ps[0].dtype
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in ps])
    if not (skip_alone and group_size(group) == 1):
        all_reduce(flat, op=op, group=group, name=name, **labels)
    if divide_by != 1:
        flat /= divide_by
    for p, g in zip(ps, flat.split([p.numel() for p in ps])):
        g = g.view(p.shape)
        if in_place:
            p.grad.copy_(g)
        else:
            p.grad = g.to(p.dtype) if g.dtype != p.dtype else g.clone()
