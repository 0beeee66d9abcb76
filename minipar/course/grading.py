"""Grading helpers: comparisons whose failure says what is wrong, where, and by how much.

Every helper raises :class:`GradeFailure` (an ``AssertionError``) with a multi-line message
that :mod:`minipar.course.grade` shows whole. A message names the place first (the rank, the chunk,
the step), then the first difference, expected against got, then both values whole and
labelled, so a learner never reads an unlabelled list or an object's repr:

    peak micro-batches held, per rank: rank 1: expected 3, got 4
      expected: [4, 3, 2, 1]
      got:      [4, 4, 3, 2]

* :func:`expect_equal` scalars, lists, tuples and dicts (nested);
* :func:`expect_close` tensors, within a tolerance (``torch.testing``'s defaults per dtype);
* :func:`expect_schedule` pipeline schedules, rank by rank, expected and got aligned;
* :func:`contributions` / :func:`expect_contributions` notebook 01's 2^r trick: rank r
  contributes 2^r, so a reduced value's bits say which ranks' data it holds;
* :func:`expect` a plain condition with its explanation;
* :func:`diagnose` an observation added to a failure only when its condition is the cause;
* :func:`expect_recorded` bytes the recorder saw against the contract's (nothing recorded: a
  transfer that did not go through ``minipar.comm``, the broken clause "recorded");
* :func:`launched` a rank's error while ranks run a case, reported with the case and its clause;
* :func:`observes` tags a graded test with the contract clauses it observes directly
  (``"ex02.C.group"``: exercise, part, clause; part ``*`` for a clause of every part), read back
  by :func:`observed`.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager

__all__ = ["GradeFailure", "expect", "expect_equal", "expect_close", "expect_schedule",
           "contributions", "expect_contributions", "diagnose", "expect_recorded", "launched", "observes", "observed", "CLAUSE_ID", "breaks"]

_WIDE = 100  # values longer than this are shown one entry per line


class GradeFailure(AssertionError):
    """A graded check failed; ``str(e)`` is the whole explanation, meant to be shown as is."""


def _fail(lines) -> None:
    raise GradeFailure("\n".join(lines))


# ----------------------------------------------------------------------------- formatting
def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "tolist")


def _fmt(x) -> str:
    """A value as a learner reads it: floats in %g, tensors as their values, never a repr."""
    if _is_tensor(x):
        x = x.detach().cpu().tolist()
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{_fmt(k)}: {_fmt(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_fmt(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
    if isinstance(x, str):
        return repr(x)
    if callable(x) and not isinstance(x, type):
        return f"<function {getattr(x, '__qualname__', '?')}>"
    return str(x)


def _whole(label: str, x) -> list[str]:
    """``label: value``, or one entry per line when the value is long."""
    text = _fmt(x)
    if len(text) <= _WIDE or not isinstance(x, (list, tuple, dict)):
        return [f"  {label}{text}"]
    items = x.items() if isinstance(x, dict) else enumerate(x)
    return [f"  {label.rstrip()}"] + [f"      {_fmt(k)}: {_fmt(v)}" for k, v in items]


def _where(where: str, what: str) -> str:
    return f"{where}: {what}" if where else what


# ----------------------------------------------------------------------------- equality
def _same(a, b) -> bool:
    if _is_tensor(a) or _is_tensor(b):
        return _is_tensor(a) and _is_tensor(b) and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values differ
        return False


def _first_difference(got, want, keys: str | None, path: str = ""):
    """(where, explanation) of the first difference between ``got`` and ``want``, or None."""
    def join(p, k, in_dict):
        if keys:
            return f"{keys} {_fmt(k)}"
        label = str(k) if in_dict and isinstance(k, str) else f"[{_fmt(k)}]" if not in_dict else _fmt(k)
        return (f"{p}, {label}" if in_dict else f"{p}{label}") if p else label
    if isinstance(want, dict) and isinstance(got, dict):
        missing = [k for k in want if k not in got]
        extra = [k for k in got if k not in want]
        if missing or extra:
            parts = ([f"missing {', '.join(map(_fmt, missing))}"] if missing else []) + \
                    ([f"unexpected {', '.join(map(_fmt, extra))}"] if extra else [])
            return path, "; ".join(parts)
        for k in want:
            found = _first_difference(got[k], want[k], None, join(path, k, True))
            if found:
                return found
        return None
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want)):
            found = _first_difference(g, w, None, join(path, i, False))
            if found:
                return found
        if len(got) != len(want):
            return path, f"expected {len(want)} entries, got {len(got)}"
        return None
    if _same(got, want):
        return None
    if type(got) is not type(want) and not (isinstance(got, (int, float)) and isinstance(want, (int, float))
                                            and not isinstance(got, bool)):
        return path, f"expected {_fmt(want)} ({type(want).__name__}), got {_fmt(got)} ({type(got).__name__})"
    return path, f"expected {_fmt(want)}, got {_fmt(got)}"


def expect_equal(got, want, what: str, keys: str | None = None) -> None:
    """``got == want`` (scalars, lists, tuples, dicts, nested), else a :class:`GradeFailure`
    naming the first difference ("rank 1: expected 3, got 4", ``keys`` naming the outer
    index), then both values whole, labelled with ``what``."""
    found = _first_difference(got, want, keys)
    if found is None:
        return
    path, why = found
    _fail([f"{what}: {path + ': ' if path else ''}{why}", *_whole("expected: ", want), *_whole("got:      ", got)])


def expect(condition, message: str) -> None:
    """A plain check: :class:`GradeFailure` with ``message`` unless ``condition`` holds."""
    if not condition:
        _fail([message])


def fail_if(condition, message: str) -> None:
    """A measured goal missed: :class:`GradeFailure` with ``message`` when ``condition`` holds."""
    if condition:
        _fail([message])


# ----------------------------------------------------------------------------- tensors
_TOL = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
        "float64": (1e-7, 1e-7)}


def _unravel(i: int, shape) -> tuple:
    out = []
    for d in reversed(shape):
        out.append(i % d)
        i //= d
    return tuple(reversed(out))


def expect_close(got, want, what: str, where: str = "", rtol: float | None = None,
                 atol: float | None = None) -> None:
    """Tensors ``got`` and ``want`` equal within ``|got - want| <= atol + rtol·|want|``
    (``torch.testing.assert_close``'s defaults for the dtype when not given). The failure
    names ``where`` and ``what``, the first differing element's index, expected against got,
    how many elements differ and the largest difference; small tensors are shown whole."""
    import torch
    head = _where(where, what)
    if not _is_tensor(got):
        _fail([f"{head}: expected a tensor of shape {tuple(want.shape)}, got {_fmt(got)}"
               f" ({type(got).__name__})"])
    want_t = want if _is_tensor(want) else torch.as_tensor(want)
    if tuple(got.shape) != tuple(want_t.shape):
        _fail([f"{head}: expected shape {tuple(want_t.shape)}, got shape {tuple(got.shape)}"])
    dtype = str(want_t.dtype).removeprefix("torch.")
    drt, dat = _TOL.get(dtype, (0.0, 0.0))
    rtol, atol = drt if rtol is None else rtol, dat if atol is None else atol
    g, w = got.detach().cpu().double(), want_t.detach().cpu().double()
    if not w.is_floating_point() and not w.is_complex():
        rtol = atol = 0.0
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    flat_bad = bad.reshape(-1)
    first = int(flat_bad.nonzero()[0])
    idx = _unravel(first, g.shape)
    diff = (g - w).abs().reshape(-1)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    worst = int(diff.argmax())
    at = lambda t, i: _fmt(t.reshape(-1)[i].item())  # noqa: E731
    lines = [f"{head}: element {idx}: expected {at(w, first)}, got {at(g, first)}",
             f"  {n_bad} of {g.numel()} elements differ (tolerance rtol={rtol:g}, atol={atol:g}); "
             f"the largest difference is {diff[worst].item():.3g} at {_unravel(worst, g.shape)}"]
    if g.numel() <= 16:
        lines += [f"  expected: {_fmt(want_t.detach().cpu().reshape(-1))}",
                  f"  got:      {_fmt(got.detach().cpu().reshape(-1))}"]
    if not bool(torch.isfinite(g).all()) and bool(torch.isfinite(w).all()):
        lines.append(f"  {int((~torch.isfinite(g)).sum())} of the values you computed are inf or nan")
    _fail(lines)


# ----------------------------------------------------------------------------- schedules
def expect_schedule(got: dict, want: dict, what: str = "1F1B schedule") -> None:
    """Schedules as ``{rank: [action, ...]}`` (strings such as ``"F0"``, ``"B3"``): equal, else
    both shown whole, rank by rank, expected and got aligned action by action, with the
    first differing action marked ``>>`` and its rank and position named."""
    if set(got) != set(want):
        _fail([f"{what}: expected ranks {sorted(want)}, got ranks {sorted(got)}"])
    first = None
    for r in sorted(want):
        g, w = [str(a) for a in got[r]], [str(a) for a in want[r]]
        if g != w:
            pos = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            first = first or (r, pos, g, w)
    if first is None:
        return
    r, pos, g, w = first
    exp_a = w[pos] if pos < len(w) else "(nothing: the schedule ends)"
    got_a = g[pos] if pos < len(g) else "(nothing: the schedule ends)"
    lines = [f"{what}: rank {r}, position {pos}: expected {exp_a}, got {got_a}"]
    for q in sorted(want):
        gq, wq = [str(a) for a in got[q]], [str(a) for a in want[q]]
        width = max([len(a) for a in gq + wq] + [1])
        mark = pos if q == r else -1
        cell = lambda seq, i: (">>" if i == mark else "  ") + (seq[i] if i < len(seq) else "").ljust(width)  # noqa: E731
        n = max(len(gq), len(wq))
        lines.append(f"  rank {q}  expected:" + "".join(cell(wq, i) for i in range(n)).rstrip())
        lines.append(f"  {'':>{len(str(q)) + 5}}  got:     " + "".join(cell(gq, i) for i in range(n)).rstrip()
                     + ("" if gq != wq else "   (same)"))
    _fail(lines)


# ----------------------------------------------------------------------------- the 2^r trick
def contributions(value, n: int) -> str:
    """Which ranks' contributions a reduced value holds, when rank r contributed 2^r
    (notebook 01): ``"holds ranks 0, 2; missing 1"``. A value that is no sum of distinct
    powers below 2^n (a rank counted twice, a wrong scale) says so."""
    v = float(value.item() if _is_tensor(value) else value)
    if not math.isfinite(v) or v < 0 or v != int(v) or int(v) >= 2 ** n:
        return (f"holds {v:g}, which is no sum of distinct ranks' contributions 2^r (r < {n}): "
                "a rank's data counted twice, a scale, or garbage")
    bits = int(v)
    held = [r for r in range(n) if bits >> r & 1]
    missing = [r for r in range(n) if not bits >> r & 1]
    text = f"holds rank{'s' if len(held) != 1 else ''} {', '.join(map(str, held))}" if held else "holds no rank's data"
    return text + (f"; missing {', '.join(map(str, missing))}" if missing else "")


def expect_contributions(got, n: int, want_ranks, where: str, positions=None) -> None:
    """Every element of ``got`` (reduced from ranks where rank r contributed 2^r) holds exactly
    the contributions of ``want_ranks``; else the first wrong element, which ranks it holds and
    which it misses. With ``positions`` (each element's index in the original tensor), rank r
    contributed ``2^r + 2^n·i`` at index i, so an element added from the wrong place shows too:
    the low n bits say which ranks, the rest the sum of the positions they came from."""
    import torch
    want_ranks = sorted(want_ranks)
    t = got if _is_tensor(got) else torch.as_tensor(got)
    flat = t.detach().cpu().double().reshape(-1)
    pos = None if positions is None else torch.as_tensor(positions).detach().cpu().double().reshape(-1)
    target = float(sum(2 ** r for r in want_ranks)) + (0 if pos is None else len(want_ranks) * 2 ** n * pos)
    bad = (flat != target).nonzero()
    if len(bad) == 0:
        return
    i = int(bad[0])
    v = flat[i].item()
    idx = _unravel(i, t.shape) if t.dim() else ()
    element = f"element {idx}" if idx else "the value"
    want_v = target if pos is None else target[i].item()
    if pos is None or not (math.isfinite(v) and v == int(v) and v >= 0):
        first = f"{where}: {element} {contributions(v, n)}"
    else:
        low, high = int(v) % 2 ** n, int(v) // 2 ** n
        first = f"{where}: {element} (position {int(pos[i])}) {contributions(low, n)}"
        if low == int(want_v) % 2 ** n and high != int(want_v) // 2 ** n:
            first += (f", but not all from position {int(pos[i])}: the positions it summed add up to {high}, "
                      f"expected {int(want_v) // 2 ** n}: a chunk came from the wrong place")
    _fail([first,
           f"  expected the contributions of rank{'s' if len(want_ranks) != 1 else ''} "
           f"{', '.join(map(str, want_ranks))} (value {want_v:g}), got {v:g}",
           f"  {len(bad)} of {flat.numel()} elements are wrong"])


# ----------------------------------------------------------------------------- explanations
@contextmanager
def diagnose(condition, message: str):
    """``with diagnose(condition, message): <checks>``: when a check inside fails and
    ``condition`` holds (a bool, or a callable taking the :class:`GradeFailure` and returning
    one, evaluated only then), ``message`` is appended to the failure as ``  seen: message``,
    so an observation appears only when its cause is the one that failed. ``message`` states
    what was observed (a symptom, one line), never what to change: the fix belongs in the
    module's ``HINTS`` tiers, shown only when asked. Blocks nest; each adds its own."""
    try:
        yield
    except GradeFailure as e:
        if condition(e) if callable(condition) else condition:
            raise GradeFailure(f"{e}\n  seen: {message}").with_traceback(e.__traceback__) from None
        raise


@contextmanager
def hang_breaks(clause: str | tuple[str, ...], explain_hang):
    """``with hang_breaks("ex04.C.sent", explain_hang): minipar.launch(...)``: ranks that hang
    (the launch's bound ends them) fail naming ``clause`` (or each of a tuple of clauses) when
    ``explain_hang(text)``, given the grader's account of the hang, returns the failure's message;
    when it returns ``None`` the hang is not this clause's, and is reported as any hang. Either way
    the grader then skips the later tests that start ranks."""
    from ..runtime.launch import LaunchTimeout
    try:
        yield
    except LaunchTimeout as e:
        from ._grade_plugin import explain
        message = explain_hang(explain(e))
        if message is None:
            raise
        with breaks(*((clause,) if isinstance(clause, str) else clause)):
            raise GradeFailure(message) from None


@contextmanager
def breaks(*ids: str):
    """``with breaks("ex01.*.avg"): <checks>``: a check inside that fails names these clauses
    (``  breaks ex01.*.avg``), so a test that observes several clauses reports the one whose check
    failed, not every clause it observes (the grader prints the clauses a message names, else
    all of the test's ``observes`` tags). The innermost block that names a clause wins."""
    bad = [c for c in ids if not CLAUSE_ID.match(c)]
    if not ids or bad:
        raise ValueError(f"clause ids look like 'ex02.C.group' or 'ex03.*.recorded'; got {bad or 'none'}")
    try:
        yield
    except GradeFailure as e:
        from .failure_clauses import ID
        if ID.search(str(e)):
            raise
        raise GradeFailure(f"{e}\n  breaks {', '.join(ids)}").with_traceback(e.__traceback__) from None


LAUNCH_TIMEOUT = 60
"""Seconds a graded launch may run before its ranks count as hung: a bound that ends a hang, not
a time the answer must meet (a case takes a few seconds; on a 2-core machine at load 150 one of
4 ranks in float64 took over 30). Every graded test's ``TIMEOUT`` is this one."""


# ----------------------------------------------------------------------------- the recorder
RECORDED = ("minipar.comm records a transfer once its handle is waited on; one made with torch.distributed "
            "directly, or never waited on, is not recorded (the clause 'recorded')")


def expect_recorded(got: int, want: int, what: str, where: str = "") -> None:
    """Bytes (or messages) the recorder saw, ``got``, equal the contract's ``want``; when nothing
    was recorded where something was due, the failure says that the clause broken is
    "recorded" (a collective or send that does not go through ``minipar.comm``)."""
    with diagnose(got == 0 and want != 0, "nothing was recorded: " + RECORDED):
        expect_equal(got, want, _where(where, what))


@contextmanager
def launched(what: str):
    """``with launched("the GPT over 3 ranks (any number of stages, one per rank)"): minipar.launch(...)``:
    a rank that raised or died while the ranks ran ``what`` fails the test as a
    :class:`GradeFailure` that names ``what`` (the case and the clause it checks) before the rank's
    error, at its line in the learner's file when it is there. A hang is left to the grader."""
    from ..runtime.launch import RankError
    try:
        yield
    except RankError as e:
        from ._grade_plugin import explain
        raise GradeFailure(f"{what}: {explain(e)}") from None


# ----------------------------------------------------------------------------- training runs
def expect_same_training(got: dict, want: dict, where: str = "", rtol: float = 1e-5,
                         atol: float = 1e-6) -> None:
    """A training run (``{"losses", "params"}``) equal to the single-process one: the loss at
    every step, then every final parameter by name, within ``rtol``/``atol`` (raised to
    :data:`minipar.reference.DEVICE_TOLERANCE` of the device computed on); the first failure
    names the step or the parameter (:func:`expect_close`)."""
    from ..runtime.backend import device
    from ..reference import DEVICE_TOLERANCE
    floor = DEVICE_TOLERANCE.get(device().type, (0.0, 0.0))
    rtol, atol = max(rtol, floor[0]), max(atol, floor[1])
    at = lambda s: f"{where}, {s}" if where else s  # noqa: E731
    expect_equal(len(got["losses"]), len(want["losses"]), at("number of losses (one per step)"))
    import torch
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        expect_close(torch.as_tensor(g, dtype=torch.float64), torch.as_tensor(w, dtype=torch.float64),
                     "loss (the single process's on the same global batch)", at(f"step {step}"), rtol, atol)
    expect_equal(sorted(got["params"]), sorted(want["params"]), at("parameter names"))
    for k, w in want["params"].items():
        expect_close(got["params"][k], w, "parameter after training (the single process's)",
                     at(f"parameter {k}"), rtol, atol)


def attempt(fn, *args):
    """``fn(*args)``, or, if it raised, the exception as one line of text with the innermost frame
    outside torch and minipar (the learner's file, line and code), so that a rank returns it and the
    driver reports it per case instead of the whole rank failing."""
    from pathlib import Path
    import traceback

    import torch

    try:
        return fn(*args)
    except Exception as e:                               # noqa: BLE001: reported by the driver
        libs = [Path(torch.__file__).parent.resolve(), Path(__file__).resolve().parents[1]]   # torch, minipar
        own = [fr for fr in traceback.extract_tb(e.__traceback__)
               if not any(Path(fr.filename).resolve().is_relative_to(d) for d in libs)]
        at = f" (at {Path(own[-1].filename).name}:{own[-1].lineno}  {own[-1].line})" if own else ""
        return f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{at}"


# ----------------------------------------------------------------------------- clause tags
CLAUSE_ID = re.compile(r"^(?:ex|ch)\d\d\.(?:\*|[A-Z])\.[a-z][a-z0-9_]*$")


def observes(*clauses: str):
    """Decorator: the contract clauses a graded test observes directly (it fails when one of
    them is broken, and its failure names the clause), as ids ``exNN.P.word``: the exercise, the
    part (``*`` for a clause of every part, such as ``ex03.*.recorded``: every transfer goes
    through ``minipar.comm`` and is recorded) and a word for the clause. Kept on the test as
    ``__observes__``; :func:`observed` reads a module's tags back."""
    bad = [c for c in clauses if not CLAUSE_ID.match(c)]
    if not clauses or bad:
        raise ValueError(f"clause ids look like 'ex02.C.group' or 'ex03.*.recorded'; got {bad or 'none'}")

    def tag(test):
        test.__observes__ = tuple(dict.fromkeys(getattr(test, "__observes__", ()) + clauses))
        return test
    return tag


def observed(module) -> dict[str, list[str]]:
    """``{clause id: [test names]}`` of a graded module's tests tagged with :func:`observes`."""
    out: dict[str, list[str]] = {}
    for name, test in vars(module).items():
        if name.startswith("test_") and callable(test):
            for clause in getattr(test, "__observes__", ()):
                out.setdefault(clause, []).append(name)
    return out
