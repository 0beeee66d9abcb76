"""The single-process run that every strategy must reproduce.

``train_reference(model, batches, make_optimizer)`` trains ``model`` on ``batches`` in one
process and returns the loss of every step and the final parameters. Equivalence tests
run a strategy on the same model (same seed), the same global batches and the same
optimizer, then compare with :func:`assert_same_training`.
"""
from __future__ import annotations

import torch


def sgd(lr: float = 0.1):
    """A picklable optimizer factory: ``sgd(0.1)(params)``."""
    return lambda params: torch.optim.SGD(params, lr=lr)


def adamw(lr: float = 1e-2, weight_decay: float = 0.1):
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def train_reference(model: torch.nn.Module, batches, make_optimizer=None) -> dict:
    """Plain training: forward (model returns the loss), backward, step. Returns
    ``{"losses": [...], "params": {name: tensor}}``."""
    make_optimizer = make_optimizer or sgd()
    opt = make_optimizer(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def assert_same_training(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses at every step and every final parameter equal within ``rtol``/``atol`` (fp32)."""
    gl, wl = torch.tensor(got["losses"]), torch.tensor(want["losses"])
    if gl.shape != wl.shape:
        raise AssertionError(f"{len(gl)} losses, expected {len(wl)}")
    torch.testing.assert_close(gl, wl, rtol=rtol, atol=atol, msg=lambda m: f"losses differ: {m}")
    missing = set(want["params"]) ^ set(got["params"])
    if missing:
        raise AssertionError(f"parameter names differ: {sorted(missing)}")
    for k, w in want["params"].items():
        torch.testing.assert_close(got["params"][k], w, rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"parameter {k} differs: {m}")
