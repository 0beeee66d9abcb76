"""The single-process run that every strategy must reproduce: :func:`train_reference`.

Equivalence tests run a strategy on the same model (same seed), the same global batches and the
same optimizer as ``train_reference(model, batches, make_optimizer)``, then compare the two with
:func:`assert_same_training`. The reference runs where the ranks run (a notebook's driver
itself stays on the CPU, but on a GPU machine its ranks compute on the GPU, with other kernels),
and the comparison's tolerance floor comes from where the result's ranks ran (its placement).
"""
from __future__ import annotations

import torch

from . import precision, strategy
from .runtime.backend import device as _driver_device
from .runtime.backend import ranks_device


def sgd(lr: float = 0.1):
    """A picklable optimizer factory: ``sgd(0.1)(params)``."""
    return lambda params: torch.optim.SGD(params, lr=lr)


def adamw(lr: float = 1e-2, weight_decay: float = 0.1):
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def _where(placed) -> torch.device | None:
    """The device type a result's ranks computed on: from a :class:`~minipar.runtime.backend.Placement`,
    anything with ``.placement`` (a ``TrainResult``, launch's ``Results``) or a dict with a
    ``"placement"``/``"device"`` key; ``None`` if it does not say."""
    if isinstance(placed, dict):
        placed = placed.get("placement") or placed.get("device")
    placed = getattr(placed, "placement", placed)
    placed = getattr(placed, "device", placed)
    return None if placed is None else torch.device(torch.device(placed).type)


def place(model: torch.nn.Module, device=None) -> torch.device:
    """Put ``model`` itself where a reference trains (``device``: a device, a placement or a
    result; by default :func:`minipar.runtime.backend.ranks_device`), in place as
    ``Module.to`` does, with fp32 as the ranks compute it (no TF32 on a GPU). The one path on
    every device: no copy is made (a copy of a model that holds a process group cannot be
    made, and a copy on one device but not on another trains different modules), so the caller
    passes a fresh model, or a copy made before wrapping. Returns the device."""
    here = ranks_device() if device is None else _where(device)
    if here.type == "cuda" and here.index is None:
        here = torch.device("cuda", torch.cuda.current_device())
    model.to(here)
    from .runtime.pool import deterministic_cuda
    deterministic_cuda()   # flags only: nothing changes on the CPU
    return here


def trained_params(model: torch.nn.Module) -> dict:
    """The final parameters by name, detached copies on the CPU (what results compare)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.named_parameters()}


def train_reference(model: torch.nn.Module, batches, make_optimizer=None, dtype=None,
                    device=None) -> dict:
    """Plain training of ``model`` itself: forward (model returns the loss), backward, step.
    Returns ``{"losses": [...], "params": {name: tensor}, "device": where it ran}``; the
    parameters are CPU copies, and ``model`` is left trained, on that device (:func:`place`:
    the same path on every device). ``dtype`` (e.g. ``torch.bfloat16``): mixed precision, the
    forward and loss under :func:`minipar.precision.autocast`, fp32 parameters, gradients and
    optimizer state, as every strategy's ``train(dtype=...)``. ``device``: where to train (a
    device, or a placement or result to train where its ranks ran); by default where
    ``minipar.runtime.launch`` puts ranks on this machine
    (:func:`minipar.runtime.backend.ranks_device`: the GPU when there is one)."""
    precision.resolve(dtype)
    here = place(model, device)
    opt = (make_optimizer or sgd())(model.parameters())
    losses = []
    for x, y in batches:
        x, y = x.to(here), y.to(here)
        opt.zero_grad(set_to_none=True)
        with strategy.forward(dtype, here):
            loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": trained_params(model), "device": str(here)}


# The least tolerance per device (fp32). On a GPU (TF32 off) the kernels of the sharded run and
# of the single process sum in different orders, and cuBLAS picks its algorithm by shape.
DEVICE_TOLERANCE = {"cpu": (0.0, 0.0), "cuda": (1e-4, 1e-5)}


def assert_same_training(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses at every step and every final parameter equal within ``rtol``/``atol`` (fp32),
    or within :data:`DEVICE_TOLERANCE` of the devices the two runs computed on, if that is
    larger: ``got``'s placement (where its ranks ran) and ``want``'s ``"device"``; a result
    that does not say is taken to have run on the driver's device."""
    kinds = {(_where(r) or _driver_device()).type for r in (got, want)}
    floor = tuple(max(DEVICE_TOLERANCE.get(k, (0.0, 0.0))[i] for k in kinds) for i in (0, 1))
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
