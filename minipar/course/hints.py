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

The tiers are stored sealed (``"sealed:"`` and the text compressed, in base64), so that a
learner who greps the course for an answer does not read the hints on the way:
``python -m minipar.course.hints --unseal`` turns every graded module's ``HINTS`` into plain
text to edit them, ``--seal`` seals them again (``tests/test_hints_sealed.py`` checks that the
committed ones are sealed).
"""
from __future__ import annotations

import argparse
import ast
import base64
import re
import json
import os
import sys
import zlib
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


SEAL = "sealed:"


def seal(text: str) -> str:
    """``text`` as a sealed tier (unchanged if it is sealed already)."""
    if text.startswith(SEAL):
        return text
    return SEAL + base64.b64encode(zlib.compress(text.encode(), 9)).decode()


def unseal(text: str) -> str:
    """A tier's plain text (a plain tier is returned as it is)."""
    if not text.startswith(SEAL):
        return text
    return zlib.decompress(base64.b64decode(text[len(SEAL):])).decode()


def _hints_node(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HINTS" for t in node.targets):
            return node
    return None


def _literal(text: str, indent: str, width: int = 96) -> list[str]:
    """``text`` as Python string literals, one per line, that concatenate to it."""
    room = max(20, width - len(indent) - 4)
    if text.startswith(SEAL):
        cuts = [text[i:i + room] for i in range(0, len(text), room)]
    else:
        cuts, line = [], ""
        for word in re.split(r"(?<= )", text):
            if line and len(repr(line + word)) > room:
                cuts.append(line)
                line = ""
            line += word
        cuts.append(line)
    return [indent + repr(c) for c in cuts]


def rewrite(path: Path, sealed: bool) -> bool:
    """Rewrite the ``HINTS`` of graded module ``path`` sealed (or plain); whether it changed."""
    raw = Path(path).read_bytes()
    node = _hints_node(ast.parse(raw))
    if node is None:
        return False
    table = ast.literal_eval(node.value)
    lines = [("HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after"
              if sealed else "HINTS = {")]
    for part, tiers in table.items():
        tiers = tiers if isinstance(tiers, (list, tuple)) else (tiers,)
        lines.append(f"    {part!r}: (")
        for t in tiers:
            lit = _literal(seal(t) if sealed else unseal(t), " " * 8)
            lines += lit[:-1] + [lit[-1] + ","]
        lines.append("    ),")
    lines.append("}")
    offsets = [0]
    for ln in raw.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(ln))
    a = offsets[node.lineno - 1] + node.col_offset
    b = offsets[node.end_lineno - 1] + node.end_col_offset
    new = raw[:a] + "\n".join(lines).encode() + raw[b:]
    if new != raw:
        Path(path).write_bytes(new)
    return new != raw


def seal_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipar.course.hints",
                                description="seal or unseal the HINTS of every graded module")
    p.add_argument("--seal", action="store_true")
    p.add_argument("--unseal", action="store_true")
    a = p.parse_args(argv)
    if a.seal == a.unseal:
        p.error("give --seal or --unseal")
    for path in sorted(graded_dir().glob("test_*.py")):
        if rewrite(path, sealed=a.seal):
            print(f"{'sealed' if a.seal else 'unsealed'}: {path.name}")
    return 0


def hints_of(exercise: str) -> dict[str, tuple[str, ...]]:
    """``HINTS`` of the exercise's graded module, read without importing it."""
    k = _key(exercise)
    found = sorted(graded_dir().glob(f"test_{k}_*.py"))
    if not found:
        raise ValueError(f"no graded exercise or challenge {k!r}")
    for node in ast.parse(found[0].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HINTS" for t in node.targets):
            value = ast.literal_eval(node.value)
            return {str(p): tuple(unseal(x) for x in v) if isinstance(v, (list, tuple)) else (unseal(str(v)),)
                    for p, v in value.items()}
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


if __name__ == "__main__":   # python -m minipar.course.hints --seal | --unseal
    sys.exit(seal_main())
