"""No hint unasked: a graded module's failure messages say what was seen, never what to do.

Over every graded module under ``minipar/course/graded/`` (read with ``ast``, not imported): no
string holds ``why:``; no ``HINTS`` tier, nor any 40-character piece of one, appears in another
string of the module (the docstring, a message); every ``diagnose(cond, msg)`` message is one
line. The hints are shown only by ``minipar.hint``.
"""
import ast
from pathlib import Path

import pytest

from minipar.course.hints import unseal
from minipar.course.markers import GRADED

MODULES = sorted(GRADED.glob("test_*.py"))
PIECE = 40          # characters of a hint tier that may not reappear elsewhere
LINE = 200          # a diagnose message's literal text, at most


def _texts(node) -> list[str]:
    """The literal text of a string node: a constant, or each literal part of an f-string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def _hints_node(tree):
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == "HINTS" for t in targets):
                return node.value
    return None


def hint_problems(path: Path) -> list[str]:
    """Where a graded module shows a fix unasked (empty: nowhere)."""
    tree = ast.parse(path.read_text())
    hints = _hints_node(tree)
    in_hints = {id(n) for n in ast.walk(hints)} if hints is not None else set()
    tiers = [unseal(t) for n in (ast.walk(hints) if hints is not None else ()) for t in _texts(n)
             if isinstance(n, ast.Constant) and len(t) > 3]   # the plain text of sealed tiers
    pieces = {t[i:i + PIECE]: t for t in tiers for i in range(max(1, len(t) - PIECE + 1))}
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    problems = []
    for node in ast.walk(tree):
        if id(node) in parts:   # a literal part of an f-string: checked with its f-string
            continue
        for text in _texts(node):
            line = getattr(node, "lineno", "?")
            if "why:" in text:
                problems.append(f"{path.name}:{line}: a string holds 'why:'")
            if id(node) in in_hints:
                continue
            windows = (text[i:i + PIECE] for i in range(len(text) - PIECE + 1))
            hit = next((pieces[w] for w in windows if w in pieces), None) if len(text) >= PIECE \
                else next((t for t in tiers if t == text), None)
            if hit:
                problems.append(f"{path.name}:{line}: a string repeats the hint tier {hit[:60]!r}...")
        if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "diagnose"
                                           or getattr(node.func, "attr", None) == "diagnose"):
            msg = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "message"), None)
            text = "".join(_texts(msg)) if msg is not None else ""
            if "\n" in text or len(text) > LINE:
                problems.append(f"{path.name}:{node.lineno}: a diagnose message longer than one line")
    return problems


# modules still to be reworded (strict: one that is fixed must leave this set)
STILL_STATING: set = set()


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=() if p.name.split("_")[1] not in STILL_STATING
                                               else pytest.mark.xfail(strict=True, reason="not yet reworded"))
                                  for p in MODULES])
def test_no_failure_message_states_a_fix(path):
    assert hint_problems(path) == []


GOOD = '''"""Exercise 97: a demo. Each rank sums."""
from minipar.course.grading import diagnose, expect_equal

EXERCISE = "ex97_demo"
HINTS = {"A": ("Which rank holds the chunk you add at step s?",
               "At step s rank r sends chunk (r - s) mod n and adds the one it receives into its own.",
               "for s in range(n - 1): send chunk (r - s) % n, receive chunk (r - s - 1) % n, add")}


def test_sum(impl):
    r = 1
    with diagnose(True, f"rank {r}: the sum holds rank 0 twice"):
        expect_equal(3, 3, "sum")
'''


def test_the_check_passes_an_observation_and_fails_a_fix(tmp_path):
    path = tmp_path / "test_ex97_demo.py"
    path.write_text(GOOD)
    assert hint_problems(path) == []
    for bad, want in (
            (GOOD.replace("holds rank 0 twice", "holds rank 0 twice; why: a chunk is added twice"), "'why:'"),
            (GOOD.replace('"rank {r}: the sum holds rank 0 twice"',
                          '"rank {r}: rank r sends chunk (r - s) mod n and adds the one it receives"'),
             "repeats the hint tier"),
            (GOOD.replace('"""Exercise 97: a demo. Each rank sums."""',
                          '"""Exercise 97. Hint: Which rank holds the chunk you add at step s?"""'),
             "repeats the hint tier"),
            (GOOD.replace("holds rank 0 twice", "holds rank 0 twice\\n  and rank 1 never"),
             "longer than one line")):
        path.write_text(bad)
        problems = hint_problems(path)
        assert len(problems) == 1 and want in problems[0], (want, problems)
