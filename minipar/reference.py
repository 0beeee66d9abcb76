"""The single-process run that every strategy must reproduce: :func:`train_reference`.

Equivalence tests run a strategy on the same model (same seed), the same global batches and the
same optimizer as ``train_reference(model, batches, make_optimizer)``, then compare the two with
:func:`assert_same_training`. The reference runs where the ranks run (a notebook's driver
itself stays on the CPU, but on a GPU machine its ranks compute on the GPU, with other kernels),
and the comparison's tolerance floor comes from where the result's ranks ran (its placement).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import precision, strategy
from .runtime.backend import device as _driver_device
from .runtime.backend import ranks_device, ranks_device_type
from .runtime.pool import deterministic_cuda


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


@dataclass(frozen=True)
class Tolerance:
    """How far two computations of the same thing may differ (``torch.testing.assert_close``'s
    ``|got - want| <= atol + rtol·|want|``), and why. ``per_update``: ``atol`` is per optimizer
    update of size lr, multiplied by ``steps · lr`` (:func:`tolerance`)."""

    rtol: float
    atol: float
    why: str
    per_update: bool = False


_F32, _BF16 = torch.float32, torch.bfloat16
_ORDER = "fp32 sums in another order (a split, a merge of partial softmaxes, a sharded mean): worst seen ~1e-7"
_GPU = ("TF32 off (deterministic_cuda), but cuBLAS picks its algorithm by shape and the fused attention kernels "
        "tile the keys and accumulate dQ in their own order: dQ 2.1e-6 off, on values of 1e-2, on an H200")
_LONG = "SGD over tens of steps at a large lr: each step's rounding is carried into the next and grows"
_ADAM = "AdamW divides by sqrt(v): rounding in a tiny gradient is magnified (observed 2e-5)"
_BF16_ROUND = ("bf16 keeps 8 bits of mantissa: one ulp of a logit (2^-8 relative) moves with the order of the "
               "sums, and training carries it on")
_FLIP = ("bf16 against fp32 under AdamW: the update is about ±lr whatever the gradient's size, so where bf16 "
         "rounding flips a tiny gradient's sign an element moves by up to lr per step on the CPU's kernels")
_FLIP_GPU = ("as on the CPU, but cuBLAS's bf16 GEMMs round other products: a flipped update costs up to 2·lr "
             "(+lr against -lr), and the losses drift further")

#: Every equivalence test's tolerance: (device type, dtype, kind) -> :class:`Tolerance`. Kinds:
#: ``"kernel"`` one forward and backward of an operation against another way to compute it;
#: ``"sgd"`` a strategy's training (SGD, with or without momentum) against one process in the
#: same dtype, a few steps; ``"sgd long"`` the same over tens of steps; ``"adamw"`` under AdamW; ``"bf16-vs-fp32"`` bf16 training's losses
#: against fp32 training's, ``"bf16-vs-fp32 adamw params"`` its final parameters under AdamW.
#: The CPU's fp32 entries are what the CPU needs and no more: a mutant that changes a result
#: by more than rounding fails them.
TOLERANCES: dict[tuple[str, torch.dtype, str], Tolerance] = {
    ("cpu", _F32, "kernel"): Tolerance(1e-5, 1e-6, _ORDER),
    ("cuda", _F32, "kernel"): Tolerance(1e-4, 1e-5, _GPU),
    ("cpu", _F32, "sgd"): Tolerance(1e-5, 1e-6, _ORDER),
    ("cuda", _F32, "sgd"): Tolerance(1e-4, 1e-5, _GPU),
    ("cpu", _F32, "sgd long"): Tolerance(1e-4, 1e-5, _LONG),
    ("cuda", _F32, "sgd long"): Tolerance(1e-3, 1e-4, _LONG + "; " + _GPU + " (after 20 steps at lr 0.5: 6.7e-5, "
                                          "5.4e-4 relative, in the head's weight on an H200)"),
    ("cpu", _F32, "adamw"): Tolerance(1e-4, 5e-5, _ADAM),
    ("cuda", _F32, "adamw"): Tolerance(1e-4, 5e-5, _ADAM + "; " + _GPU),
    ("cpu", _BF16, "kernel"): Tolerance(4e-2, 3e-2, _BF16_ROUND + " (fused against materialized: 1.3e-2 seen)"),
    ("cuda", _BF16, "kernel"): Tolerance(4e-2, 3e-2, _BF16_ROUND + " (1.9e-2 seen on an H200)"),
    ("cpu", torch.float16, "kernel"): Tolerance(1e-2, 4e-3, "fp16 keeps 11 bits of mantissa (1.5e-3 seen)"),
    ("cuda", torch.float16, "kernel"): Tolerance(1e-2, 4e-3, "fp16 keeps 11 bits of mantissa (1.5e-3 seen on an H200)"),
    ("cpu", _BF16, "sgd"): Tolerance(1e-3, 2e-3, _BF16_ROUND),
    ("cuda", _BF16, "sgd"): Tolerance(1e-3, 2e-3, _BF16_ROUND + " (dp2·tp2: 4.7e-4 seen on an H200)"),
    ("cpu", _BF16, "bf16-vs-fp32"): Tolerance(0.0, 5e-2, _FLIP),
    ("cuda", _BF16, "bf16-vs-fp32"): Tolerance(0.0, 1e-1, _FLIP_GPU),
    ("cpu", _BF16, "bf16-vs-fp32 adamw params"): Tolerance(0.0, 1.0, _FLIP, per_update=True),
    ("cuda", _BF16, "bf16-vs-fp32 adamw params"): Tolerance(0.0, 2.0, _FLIP_GPU, per_update=True),
}


def tolerance(where=None, dtype=torch.float32, kind: str = "sgd", steps: int = 1, lr: float = 1.0) -> dict:
    """``{"rtol", "atol"}`` from :data:`TOLERANCES` for computations on ``where`` (a device or
    its name, a placement, a result; several in a list or tuple: the widest; by default where
    the ranks compute, :func:`minipar.runtime.backend.ranks_device`) in ``dtype``; ``steps`` and
    ``lr`` scale a per-update bound. A device, dtype or kind not in the table is an error."""
    places = where if isinstance(where, (list, tuple)) else [where]
    kinds = {ranks_device_type() if w is None else (_where(w) or _driver_device()).type for w in places}
    found = []
    for d in sorted(kinds):
        t = TOLERANCES.get((d, dtype, kind))
        if t is None:
            raise KeyError(f"no tolerance for {kind!r} in {dtype} on {d}: add it to minipar.reference.TOLERANCES")
        scale = steps * lr if t.per_update else 1.0
        found.append((t.rtol, t.atol * scale))
    return {"rtol": max(r for r, _ in found), "atol": max(a for _, a in found)}


# The least tolerance per device (fp32), applied under any tolerance a test states: the table's
# "sgd" entry off the CPU, where kernels sum in other orders than the test's author saw.
DEVICE_TOLERANCE = {"cpu": (0.0, 0.0), "cuda": (TOLERANCES["cuda", _F32, "sgd"].rtol, TOLERANCES["cuda", _F32, "sgd"].atol)}


def assert_same_training(got: dict, want: dict, rtol: float | None = None, atol: float | None = None, *,
                         kind: str = "sgd", dtype=torch.float32) -> None:
    """Losses at every step and every final parameter equal within ``rtol``/``atol``; by
    default :func:`tolerance` of ``kind`` in ``dtype`` on the devices the two runs computed on
    (``got``'s placement, where its ranks ran, and ``want``'s ``"device"``; a result that does
    not say is taken to have run on the driver's device). A stated ``rtol``/``atol`` is raised
    to :data:`DEVICE_TOLERANCE` of those devices if that is larger."""
    if rtol is None or atol is None:
        table = tolerance([got, want], dtype, kind)
        rtol, atol = (table["rtol"] if rtol is None else rtol), (table["atol"] if atol is None else atol)
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
