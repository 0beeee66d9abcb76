"""Grading helpers: failures that say what was expected, what came, and where.

A minimal stand-in with the interface's signatures (``GradeFailure``, ``expect_equal``,
``expect_close``, ``diagnose``); the full module replaces it."""
from __future__ import annotations

import torch


class GradeFailure(AssertionError):
    """A graded check that failed; its message is shown whole."""


def expect_equal(got, want, what: str, keys: str | None = None) -> None:
    """``got == want`` (scalars, lists, dicts), else the first difference, then both whole."""
    if got == want:
        return
    first = ""
    if isinstance(want, (list, tuple, dict)) and isinstance(got, type(want)):
        idx = list(want) if isinstance(want, dict) else range(max(len(got), len(want)))
        for i in idx:
            g = got.get(i, "nothing") if isinstance(got, dict) else (got[i] if i < len(got) else "nothing")
            w = want[i] if (isinstance(want, dict) or i < len(want)) else "nothing"
            if g != w:
                first = f"{keys or 'at'} {i}: expected {w}, got {g}\n"
                break
    raise GradeFailure(f"{what}: {first or f'expected {want!r}, got {got!r}'}"
                       f"\n  expected: {want!r}\n  got:      {got!r}")


def expect_close(got, want, what: str, where: str = "", rtol: float | None = None,
                 atol: float | None = None) -> None:
    """Tensors equal within ``rtol``/``atol`` (torch's defaults for the dtype when None)."""
    at = f" ({where})" if where else ""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    if got.shape != want.shape:
        raise GradeFailure(f"{what}{at}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, check_dtype=False)
    except AssertionError:
        g, w = got.double(), want.double()
        tol = (atol if atol is not None else 1e-5) + (rtol if rtol is not None else 1.3e-6) * w.abs()
        bad = ~((g - w).abs() <= tol) | (g.isnan() != w.isnan())
        i = tuple(int(j) for j in torch.unravel_index(bad.flatten().nonzero()[0, 0], bad.shape)) if bad.any() else ()
        raise GradeFailure(f"{what}{at}: at index {i} expected {w[i].item():.6g}, got {g[i].item():.6g}; "
                           f"{int(bad.sum())} of {bad.numel()} elements differ, the largest difference "
                           f"{(g - w).abs().nan_to_num(float('inf')).max().item():.3g}") from None


def diagnose(condition: bool, message: str) -> str:
    """``message`` (on a new line) where ``condition`` names the check that failed, else ""."""
    return f"\n{message}" if condition else ""
