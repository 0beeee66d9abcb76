"""What the grader prints for an untouched stub gives no answer away.

``python -m minipar.grade exNN`` prints every graded test's description (its docstring's first
paragraph) on PASS and FAIL, the failure, the clauses it breaks and the hint line, before any
hint is asked for. For every core (and its chapter's challenge), the report of a stub that
fails every test is rendered through the grader's own path (:class:`minipar.course.grade.Report`)
and must hold none of the core's key lines or prose giveaways (``tests/test_key_lines.py``'s
``KEY_LINES`` and ``PROSE``, whitespace aside). One core, ex10 (pure Python), is also graded for
real on its stub, and its printed report is checked the same way.

The key lines are code, and a description leaks in prose, so ``PRINTED`` adds, per core, the
phrases the grader itself once printed that gave an answer away (descriptions and failure
messages, as new learners reported them); they may appear in no string of a graded test's
functions (the messages; the sealed ``HINTS`` are not printed and not checked), and in no report
unless the exercise's own contract states them (a failure quotes the clause it breaks).
"""
from __future__ import annotations

import ast
import importlib

import pytest

from minipar.course import exercise_files, grade
from minipar.course.grade import Report
from minipar.course.markers import GRADED, stem

try:                                     # the cores' key lines, kept with the check of the texts
    from test_key_lines import KEY_LINES, PROSE, _flat   # a learner is pointed to
except ImportError:                      # not there yet: the printed giveaways below only
    KEY_LINES, PROSE = {}, {}

    def _flat(text: str) -> str:
        return " ".join(text.split())


# answers the grader's own text once gave away (printed descriptions and failure messages)
PRINTED = {
    "ex01": ["2(n-1)/n of the tensor", "each step sends one chunk"],
    "ex02": ["last parameter first", "2(n-1)/n·Ψ·4", "2(n-1)/n · Ψ · 4"],
    "ex03": ["as a leaf requiring grad", "120 bytes of fp32 each way"],
    "ex05": ["f returns x unchanged", "sums the ranks' gradients in backward", "column rows 2r..2r+1",
             "row columns 3r..3r+2", "with the bias added once", "where exp overflows without the max"],
    "ex06": ["flat_grad[r·k:(r+1)·k]", "K·⌈Ψ_u/N⌉", "3(N-1)/N·Ψ", "empties the buffer's storage but keeps the tensor",
             "reduce-scatters units 2, 1, 0"],
    "ex07": ["rank = p·(dp·tp) + d·tp + t", "rank = ((p·dp + d)·cp + c)·tp + t", "tp [4, 5], dp [5, 7], pp [1, 5]",
             "tp inside a node; then fewest stages"],
    "ex08": ["2·cp-1-r", "kv_front from earlier ranks", "contiguous skips later blocks", "exp would overflow",
             "sequence chunks"],
    "ex10": ["34·sbh", "55·sbh", "7, 8 × 14, 7", "min(p, m)", "2·a·(s/cp)·s", "4·(s/cp)·a", "2 + 2 + 12 bytes",
             "2sbh per layer", "the gathered (s, b, h) input"],
    "ex12": ["the first holder after the destination in ring order", "rank 1 asks 2, 3, 0 and takes 3"],
}


def _keys(k: str) -> list[tuple[str, str]]:
    """The key lines and prose giveaways, and the printed ones beyond the exercise's own contract:
    a failure quotes the clause it breaks, and what the learner's file already states (a clause
    that fixes the bytes sent, say) is no giveaway when the grader repeats it; that a contract
    states too much is :mod:`test_key_lines`' concern."""
    contract = _flat(exercise_files.render(k, solution=False))
    return [(part, line) for part, lines in KEY_LINES.get(k, {}).items() for line in lines] + \
           [("prose", p) for p in PROSE.get(k, [])] + \
           [("printed", p) for p in PRINTED.get(k, []) if _flat(p) not in contract]


def _stub_errors(k: str) -> str:
    """What the untouched stub raises, every message of it (``Exercise 10 C: stage_layers``)."""
    stub = exercise_files.render(k, solution=False)
    found = [n.exc.args[0].value for n in ast.walk(ast.parse(stub))
             if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and n.exc.args
             and isinstance(n.exc.args[0], ast.Constant) and isinstance(n.exc.args[0].value, str)]
    return "NotImplementedError: " + "; ".join(found or ["not implemented"])


def _failed_report(path, error: str) -> Report:
    module = importlib.import_module(f"minipar.course.graded.{path.stem}")
    tests = [{"name": name, "doc": (fn.__doc__ or "").strip(), "observes": list(getattr(fn, "__observes__", ())),
              "outcome": "failed", "error": error, "file": path.name}
             for name, fn in vars(module).items() if name.startswith("test_") and callable(fn)]
    return Report(path.stem.removeprefix("test_"), "exercise", tests)


def stub_report(k: str) -> str:
    """The grader's text for ``k``'s stub failing every test of the core and its challenge."""
    error = _stub_errors(k)
    core = sorted(GRADED.glob(f"test_{k}_*.py"))
    rep = _failed_report(core[0], error)
    ch = sorted(GRADED.glob(f"test_ch{k[2:]}_*.py"))
    rep.challenge = _failed_report(ch[0], error) if ch else None
    return str(rep)


def leaks_in(k: str, text: str) -> list[str]:
    flat = _flat(text)
    return [f"{k} {part}: {line!r}" for part, line in _keys(k) if _flat(line) in flat]


@pytest.mark.parametrize("k", sorted(set(KEY_LINES) | set(PRINTED)))
def test_a_stubs_grade_report_holds_no_key_line(k):
    text = stub_report(k)
    assert "FAIL" in text and "stuck?" in text
    assert leaks_in(k, text) == []


def _function_strings(path) -> str:
    """Every string constant inside the functions of a graded module (descriptions, messages)."""
    tree = ast.parse(path.read_text())
    return "\n".join(c.value for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.Lambda))
                     for c in ast.walk(f) if isinstance(c, ast.Constant) and isinstance(c.value, str))


@pytest.mark.parametrize("k", sorted(PRINTED))
def test_no_graded_message_states_a_printed_giveaway(k):
    paths = sorted(GRADED.glob(f"test_{k}_*.py")) + sorted(GRADED.glob(f"test_ch{k[2:]}_*.py"))
    text = _flat("\n".join(_function_strings(p) for p in paths))
    assert [p for p in PRINTED[k] if _flat(p) in text] == []


def test_the_check_finds_a_key_line_in_a_description(monkeypatch):
    """A description that states the answer is caught (here ex08 B's, as it was printed once)."""
    module = importlib.import_module(f"minipar.course.graded.test_{stem('ex08')}")
    monkeypatch.setattr(module.test_zigzag_chunks, "__doc__", "Rank r holds chunks r and 2·cp-1-r.")
    assert leaks_in("ex08", stub_report("ex08")) == ["ex08 printed: '2·cp-1-r'"]
    if KEY_LINES:
        monkeypatch.setattr(module.test_zigzag_chunks, "__doc__", "Rank r holds 2 * cp - 1 - rank.")
        assert leaks_in("ex08", stub_report("ex08")) == ["ex08 B: '2 * cp - 1 - rank'"]


def test_grading_ex10s_stub_prints_no_key_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIPAR_HOME", str(tmp_path))
    exercise_files.write_stubs(tmp_path / "stubs")      # fresh stubs: the learner's file may be solved
    [report] = grade.grade_many(["ex10"], "exercise", verbose=False, challenge=True,
                                exercises_dir=tmp_path / "stubs")
    assert report.score == 0 and report.tests
    assert leaks_in("ex10", str(report)) == []
