"""Grading helpers (minimal stand-in): comparisons whose failure says what differs.

Each helper raises :class:`GradeFailure`, an ``AssertionError`` whose multi-line message
labels the values, names the first difference and shows expected against got.
"""
from __future__ import annotations

import torch


class GradeFailure(AssertionError):
    """A graded check failed; the message is meant to be shown whole."""


def expect_equal(got, want, what: str, keys: str | None = None) -> None:
    """``got == want`` (scalars, lists, dicts); else the first difference, then both whole."""
    if got == want:
        return
    first = ""
    if isinstance(want, (list, tuple, dict)) and isinstance(got, type(want)):
        idx = list(want) if isinstance(want, dict) else range(max(len(got), len(want)))
        for k in idx:
            g = got.get(k, "<missing>") if isinstance(got, dict) else (got[k] if k < len(got) else "<missing>")
            w = want[k] if not isinstance(want, dict) else want[k]
            if isinstance(want, (list, tuple)) and k >= len(want):
                w = "<missing>"
            if g != w:
                first = f"{keys or 'position'} {k}: expected {w}, got {g}\n"
                break
    raise GradeFailure(f"{what}: {first or ''}expected {want!r}, got {got!r}" if not first
                       else f"{what}: {first}  expected: {want!r}\n  got:      {got!r}")


def expect_close(got, want, what: str, where: str = "", rtol: float | None = None,
                 atol: float | None = None) -> None:
    """Tensors equal within ``rtol``/``atol`` (fp32 defaults); else the first differing element."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    label = f"{what}{' (' + where + ')' if where else ''}"
    if got.shape != want.shape:
        raise GradeFailure(f"{label}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
    rtol = 1.3e-6 if rtol is None else rtol
    atol = 1e-5 if atol is None else atol
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    bad = ~(torch.isclose(g, w, rtol=rtol, atol=atol) | (torch.isnan(g) & torch.isnan(w)))
    if not bad.any():
        return
    flat = int(bad.reshape(-1).nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), w.shape)) if w.dim() else ()
    diff = (g - w).abs()[bad].max().item()
    raise GradeFailure(f"{label}: element {index}: expected {w.reshape(-1)[flat].item():.6g}, "
                       f"got {g.reshape(-1)[flat].item():.6g}\n  {int(bad.sum())} of {w.numel()} "
                       f"elements differ; largest difference {diff:.3g} (rtol {rtol:g}, atol {atol:g})")


def diagnose(condition: bool, message: str) -> None:
    """Fail with ``message`` when ``condition`` holds (an explanation tied to that failure)."""
    if condition:
        raise GradeFailure(message)
