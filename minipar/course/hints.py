"""Hints in tiers, on request: ``minipar.hint("ex08", "A")`` (or ``python -m minipar.hint ex08 A``).

Each graded module (``minipar/course/graded/test_exNN_topic.py``) defines, right after ``EXERCISE``,
``HINTS = {"A": ("a nudge", "the idea", "the formula or pseudo-code"), ...}`` (the key ``""``
for a one-part exercise). Each call prints the next tier of that part, so a learner asks for
exactly as much help as they need; what was shown is kept in ``$MINIPAR_HOME/hints.json``
(default: ``.minipar/`` in the learner's exercises folder, ``$MINIPAR_EXERCISES`` or this
workspace's ``exercises/``, so two workspaces, or two people on one machine, keep apart).

* ``minipar.hint("ex08")``: the parts and how many tiers each has (or, for a one-part
  exercise, its next tier);
* ``minipar.hint("ex08", "A")``: the next tier of part A (the last one again once all are shown);
* ``minipar.hint("ex08", "A", tier=2)``: that tier;
* ``minipar.hint("ex08", "A", reset=True)``: start part A over (no part: every part).

The grader never prints a hint unasked; a failure only says ``stuck? minipar.hint(...)``.
"""
from __future__ import annotations

import argparse
import ast
import re
import json
import os
from pathlib import Path

from .challenge import graded_dir
from .exercise import key


def home() -> Path:
    """Where the course keeps the learner's state: ``$MINIPAR_HOME``, else ``.minipar/`` in the
    learner's exercises folder (``$MINIPAR_EXERCISES``, else the workspace's ``exercises/``)."""
    from .exercise import EXERCISES_ENV
    from .markers import ROOT
    if os.environ.get("MINIPAR_HOME"):
        return Path(os.environ["MINIPAR_HOME"])
    return Path(os.environ.get(EXERCISES_ENV) or ROOT / "exercises") / ".minipar"


def _key(name: str) -> str:
    """"ex04" or "ch04": a challenge's hints live in its graded module too."""
    m = re.search(r"ch\d+", str(name))
    return m[0] if m else key(name)


def hints_of(exercise: str) -> dict[str, tuple[str, ...]]:
    """``HINTS`` of the exercise's graded module, read without importing it."""
    k = _key(exercise)
    found = sorted(graded_dir().glob(f"test_{k}_*.py"))
    if not found:
        raise ValueError(f"no graded exercise or challenge {k!r}")
    for node in ast.parse(found[0].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HINTS" for t in node.targets):
            value = ast.literal_eval(node.value)
            return {str(p): tuple(v) if isinstance(v, (list, tuple)) else (str(v),) for p, v in value.items()}
    return {}


def parts(exercise: str) -> dict[str, int]:
    """The exercise's parts and their number of tiers: ``{"A": 3, "B": 2}``."""
    return {p: len(t) for p, t in hints_of(exercise).items()}


def suggestion(exercise: str, part: str | None = None) -> str:
    """The line the grader prints on a failure: how to ask for a hint (never the hint)."""
    k = _key(exercise)
    try:
        known = parts(k)
    except (ValueError, SyntaxError):
        known = {}
    if part is None and len(known) == 1:
        part = next(iter(known))
    if part is not None and part in known and part != "":
        return f'stuck? minipar.hint("{k}", "{part}")'
    return f'stuck? minipar.hint("{k}")'


def _state_file() -> Path:
    return home() / "hints.json"


def _load() -> dict:
    try:
        return json.loads(_state_file().read_text())
    except (OSError, ValueError):
        return {}


def _save(state: dict) -> None:
    path = _state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _label(k: str, part: str) -> str:
    return f"{k} {part}".rstrip()


def hint(exercise: str, part: str | None = None, tier: int | None = None, reset: bool = False,
         verbose: bool = True) -> str:
    """Print (when ``verbose``) and return the next hint for ``part`` of ``exercise``; see the
    module docstring for the forms."""
    k = _key(exercise)
    table = hints_of(k)
    out = _hint(k, table, part, tier, reset)
    if verbose:
        print(out)
    return out


def _hint(k: str, table: dict, part: str | None, tier: int | None, reset: bool) -> str:
    if not table:
        return f"{k} has no hints yet."
    state = _load()
    if part is None and (reset or len(table) > 1):
        if reset:
            state.pop(k, None)
            _save(state)
            return f"hints for {k} start over."
        shown = state.get(k, {})
        rows = [f'  part {p}: {len(t)} tiers, {shown.get(p, 0)} shown: minipar.hint("{k}", "{p}")'
                for p, t in table.items()]
        return "\n".join([f"{k} has {len(table)} parts:", *rows])
    if part is None:
        part = next(iter(table))
    if part not in table:
        raise ValueError(f"{k} has no part {part!r}; its parts: {', '.join(repr(p) for p in table)}")
    tiers, seen = table[part], state.setdefault(k, {})
    if reset:
        seen.pop(part, None)
        _save(state)
        return f"hints for {_label(k, part)} start over."
    if tier is None:
        n = min(seen.get(part, 0) + 1, len(tiers))
    elif not 1 <= tier <= len(tiers):
        raise ValueError(f"{_label(k, part)} has tiers 1 to {len(tiers)}, not {tier}")
    else:
        n = tier
    seen[part] = max(seen.get(part, 0), n)
    _save(state)
    more = ("" if n < len(tiers) else
            "  (that is the last hint" + ("" if tier else "; reset=True starts over") + ")")
    return f"{_label(k, part)}, hint {n} of {len(tiers)}: {tiers[n - 1]}" + more


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipar.hint", description=__doc__.splitlines()[0])
    p.add_argument("exercise", help="e.g. ex08")
    p.add_argument("part", nargs="?", help="e.g. A (omit: list the parts)")
    p.add_argument("--tier", type=int, help="show this tier (1 = the nudge)")
    p.add_argument("--reset", action="store_true", help="start over")
    a = p.parse_args(argv)
    try:
        hint(a.exercise, a.part, tier=a.tier, reset=a.reset)
    except ValueError as e:
        print(e)
        return 2
    return 0
