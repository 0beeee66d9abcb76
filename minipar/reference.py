"""The single-process run that every strategy must reproduce: :func:`train_reference`.

Equivalence tests run a strategy on the same model (same seed), the same global batches and the
same optimizer as ``train_reference(model, batches, make_optimizer)``, then compare the two with
:func:`assert_same_training`.
"""
from __future__ import annotations

import torch

from . import precision
from .backend import device


def sgd(lr: float = 0.1):
    """A picklable optimizer factory: ``sgd(0.1)(params)``."""
    return lambda params: torch.optim.SGD(params, lr=lr)


def adamw(lr: float = 1e-2, weight_decay: float = 0.1):
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def train_reference(model: torch.nn.Module, batches, make_optimizer=None, dtype=None) -> dict:
    """Plain training: forward (model returns the loss), backward, step. Returns
    ``{"losses": [...], "params": {name: tensor}}``. ``dtype`` (e.g. ``torch.bfloat16``):
    mixed precision, the forward and loss under :func:`minipar.precision.autocast`, fp32
    parameters, gradients and optimizer state, as every strategy's ``train(dtype=...)``."""
    precision.resolve(dtype)
    here = device()  # the CPU, or the GPU the ranks compute on (MINIPAR_DEVICE=cuda)
    moved = here.type != "cpu"
    if moved:  # a copy on that device: the caller's CPU model is left as it was
        import copy
        model = copy.deepcopy(model).to(here)
        batches = [tuple(t.to(here) for t in b) for b in batches]
        from .pool import deterministic_cuda
        deterministic_cuda()  # fp32 as the ranks compute it: no TF32
    opt = (make_optimizer or sgd())(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        with precision.autocast(dtype, here):
            loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: (v.detach().cpu() if moved else v.detach().clone())
                                         for k, v in model.named_parameters()}}


# The least tolerance per device (fp32). On a GPU (TF32 off) the kernels of the sharded run and
# of the single process sum in different orders, and cuBLAS picks its algorithm by shape.
DEVICE_TOLERANCE = {"cpu": (0.0, 0.0), "cuda": (1e-4, 1e-5)}


def assert_same_training(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses at every step and every final parameter equal within ``rtol``/``atol`` (fp32),
    or within :data:`DEVICE_TOLERANCE` of the device the run computed on, if that is larger."""
    floor = DEVICE_TOLERANCE.get(device().type, (0.0, 0.0))
    rtol, atol = max(rtol, floor[0]), max(atol, floor[1])
    gl, wl = torch.tensor(got["losses"], device="cpu"), torch.tensor(want["losses"], device="cpu")
    if gl.shape != wl.shape:
        raise AssertionError(f"{len(gl)} losses, expected {len(wl)}")
    torch.testing.assert_close(gl, wl, rtol=rtol, atol=atol, msg=lambda m: f"losses differ: {m}")
    missing = set(want["params"]) ^ set(got["params"])
    if missing:
        raise AssertionError(f"parameter names differ: {sorted(missing)}")
    for k, w in want["params"].items():
        torch.testing.assert_close(got["params"][k], w, rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"parameter {k} differs: {m}")
