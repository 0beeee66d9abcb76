"""Gradient buckets: many small all-reduces merged into a few large ones.

An all-reduce of N bytes on n ranks costs about ``2(n-1)·α + 2(n-1)/n·N·β`` (α-β model,
:func:`minipar.cost.alpha_beta_time`): one all-reduce per parameter pays the latency α per
parameter, buckets of about ``bucket_cap_mb`` pay it per bucket, for the same bytes (Li et al.,
"PyTorch Distributed", VLDB 2020, §3.2.3). Buckets fill in **reverse** parameter order, the order
of backward's gradients, so the first bucket is complete first and can be all-reduced early.
"""
from __future__ import annotations

import torch


# Contract:
# ex02.B.order: the buckets, read in order, list every parameter of ``params`` exactly once, in
#     the order in which backward makes their gradients ready (for a model whose layers run in
#     the order of ``params``).
# ex02.B.cap: no bucket holds more than ``bucket_cap_mb`` MiB (2**20 bytes) of parameters, unless
#     it holds a single parameter; ``bucket_cap_mb=0``: one parameter per bucket.
# ex02.B.full: no bucket could have taken the first parameter of the next one without breaking
#     ex02.B.cap or ex02.B.dtype (the fewest buckets that order allows).
# ex02.B.dtype: the parameters of a bucket share one dtype (a bucket is one flat tensor); no
#     bucket is empty.
# ex02.B.negative: a negative ``bucket_cap_mb`` raises ``ValueError``.
def assign_buckets(params, bucket_cap_mb: float) -> list[list[torch.nn.Parameter]]:
    """Group ``params`` into buckets in the order backward makes their gradients ready, each
    at most ``bucket_cap_mb`` megabytes (2**20 bytes) unless it holds one larger parameter, of
    one dtype (a bucket is one flat tensor), as few as that order allows; ``bucket_cap_mb=0``
    gives one bucket per parameter."""
    # >>> ex02 B
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
    cap = bucket_cap_mb * 2**20
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
    # <<< ex02 B


class Bucket:
    """A flat ``buffer`` (what gets all-reduced) holding the gradients of ``params`` back to
    back: ``pack(p)`` copies ``p.grad`` into its slice, ``unpack()`` copies the slices back."""

    def __init__(self, params: list[torch.nn.Parameter]):
        if len({p.dtype for p in params}) != 1:
            raise ValueError("a bucket's parameters must share one dtype")
        self.params = list(params)
        self.offsets, total = {}, 0
        for p in self.params:
            self.offsets[id(p)] = (total, p.numel())
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def slice(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self.buffer.narrow(0, *self.offsets[id(p)])

    def pack(self, p: torch.nn.Parameter) -> None:
        """Copy ``p.grad`` into this bucket (zeros if ``p`` has no gradient)."""
        if p.grad is None:
            self.slice(p).zero_()
        else:
            self.slice(p).copy_(p.grad.reshape(-1))

    def unpack(self) -> None:
        """Write the buffer back into every parameter's ``.grad``."""
        for p in self.params:
            g = self.slice(p).view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
