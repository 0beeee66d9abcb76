"""Mixed precision, the one rule every strategy follows (Micikevicius et al. 2018).

The parameters, their gradients and the optimizer state stay fp32 (the *master* copy); the
forward and its loss compute in ``dtype`` under ``torch.autocast``: matrix multiplies in bf16,
reductions such as softmax, layer norm and the loss in fp32. ``dtype=None`` (or ``torch.float32``)
is plain fp32. Every strategy's ``train(..., dtype=...)`` and the single-process reference enter
:func:`autocast` at one site, :func:`minipar.strategy.forward`, around the forward only, so the two
compare in the same precision.

``"fp16"`` autocasts to float16 the same way. minipar scales no loss, so gradients below
float16's smallest subnormal (6e-8) flush to zero: on the course's models a handful of
elements whose fp32 gradient is ~1e-13; a large model in fp16 needs a loss scale
(``torch.amp.GradScaler``); bf16, with fp32's exponent range, needs none.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {None: None, "fp32": None, "float32": None, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def resolve(dtype) -> torch.dtype | None:
    """``None`` for fp32, else the compute dtype; accepts ``"bf16"``, ``torch.bfloat16``, ..."""
    if isinstance(dtype, torch.dtype):
        return None if dtype == torch.float32 else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(k for k in DTYPES if k)} or a torch dtype, got {dtype!r}")
    return DTYPES[dtype]


def autocast(dtype, device: torch.device | str = "cpu"):
    """The context a forward runs in: ``torch.autocast(device.type, dtype)``, or nothing for fp32.
    A ``torch.dtype`` (what :func:`resolve` returns, and what a decided plan holds) is used as it is,
    so a forward per micro-batch resolves nothing; a name is resolved here."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        dtype = resolve(dtype)
    if dtype is None or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)
