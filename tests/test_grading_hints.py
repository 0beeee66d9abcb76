"""minipar.course.hint: tiers on request, one more per call, kept under $MINIPAR_HOME; read from the
graded module's HINTS without importing it; the grader only suggests asking (fast, no launch)."""
import subprocess
import sys

import pytest

import minipar
from minipar.course import grade, hints
from minipar.course.exercise import ROOT

GRADED = '''"""Exercise 98: a demo."""
EXERCISE = "ex98_demo"
HINTS = {"A": ("a nudge", "the idea", "the formula"), "B": ("look at the order", "reverse it")}
raise RuntimeError("hints must not import the graded module")
'''
ONE_PART = '''EXERCISE = "ex97_one"
HINTS = {"": ("only a nudge", "and the answer")}
'''


@pytest.fixture
def graded(tmp_path, monkeypatch):
    (tmp_path / "graded").mkdir()
    (tmp_path / "graded" / "test_ex98_demo.py").write_text(GRADED)
    (tmp_path / "graded" / "test_ex97_one.py").write_text(ONE_PART)
    (tmp_path / "graded" / "test_ex96_none.py").write_text('EXERCISE = "ex96_none"\n')
    monkeypatch.setenv("MINIPAR_GRADED", str(tmp_path / "graded"))
    monkeypatch.setenv("MINIPAR_HOME", str(tmp_path / "home"))
    return tmp_path


def test_next_tier_at_each_call_then_the_last_again(graded, capsys):
    assert minipar.hint("ex98", "A") == "ex98 A, hint 1 of 3: a nudge"
    assert minipar.hint("ex98", "A") == "ex98 A, hint 2 of 3: the idea"
    assert minipar.hint("ex98", "A").startswith("ex98 A, hint 3 of 3: the formula  (that is the last hint")
    assert minipar.hint("ex98", "A").startswith("ex98 A, hint 3 of 3: the formula")
    assert minipar.hint("ex98", "B") == "ex98 B, hint 1 of 2: look at the order"   # parts apart
    assert "hint 1 of 3: a nudge" in capsys.readouterr().out
    assert (graded / "home" / "hints.json").exists()


def test_a_chosen_tier_listing_and_reset(graded):
    assert minipar.hint("ex98", "B", tier=2, verbose=False).startswith("ex98 B, hint 2 of 2: reverse it")
    listing = minipar.hint("ex98", verbose=False)
    assert "part A: 3 tiers, 0 shown" in listing and "part B: 2 tiers, 2 shown" in listing
    assert 'minipar.hint("ex98", "A")' in listing
    assert minipar.hint("ex98", "B", reset=True, verbose=False) == "hints for ex98 B start over."
    assert minipar.hint("ex98", "B", verbose=False) == "ex98 B, hint 1 of 2: look at the order"
    with pytest.raises(ValueError, match="tiers 1 to 2"):
        minipar.hint("ex98", "B", tier=3, verbose=False)
    with pytest.raises(ValueError, match="no part 'C'"):
        minipar.hint("ex98", "C", verbose=False)


def test_one_part_exercise_and_none(graded):
    assert minipar.hint("ex97", verbose=False) == "ex97, hint 1 of 2: only a nudge"
    assert minipar.hint("ex97", verbose=False).startswith("ex97, hint 2 of 2: and the answer")
    assert minipar.hint("ex96", verbose=False) == "ex96 has no hints yet."
    assert hints.suggestion("ex97") == 'stuck? minipar.hint("ex97")'
    assert hints.suggestion("ex98", "B") == 'stuck? minipar.hint("ex98", "B")'
    assert hints.suggestion("ex98") == 'stuck? minipar.hint("ex98")'


def test_command_line(graded, capsys):
    out = subprocess.run([sys.executable, "-m", "minipar.course.hint", "ex98", "A"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.stdout.strip() == "ex98 A, hint 1 of 3: a nudge", out.stderr
    assert hints.main(["ex98", "A", "--tier", "3"]) == 0
    assert capsys.readouterr().out.startswith("ex98 A, hint 3 of 3: the formula")
    assert hints.main(["ex98", "Z"]) == 2 and "no part 'Z'" in capsys.readouterr().out


def test_every_graded_module_hints_are_well_formed(monkeypatch):
    """The real graded modules: HINTS, where present, map parts to 2-4 plain-string tiers."""
    monkeypatch.delenv("MINIPAR_GRADED", raising=False)
    for ex in grade.exercises():
        for part, tiers in hints.hints_of(ex).items():
            assert 2 <= len(tiers) <= 4 and all(isinstance(t, str) and t for t in tiers), (ex, part)


def test_state_stays_in_the_workspace_unless_minipar_home_says_otherwise(graded, monkeypatch):
    """Without $MINIPAR_HOME the shown tiers are kept beside the learner's files
    ($MINIPAR_EXERCISES/.minipar, else this workspace's exercises/.minipar), never in a home
    directory shared with other workspaces."""
    from minipar.course import hints
    from minipar.course.markers import ROOT
    assert hints.home() == graded / "home"
    monkeypatch.delenv("MINIPAR_HOME")
    monkeypatch.setenv("MINIPAR_EXERCISES", str(graded / "mine"))
    assert hints.home() == graded / "mine" / ".minipar"
    minipar.hint("ex98", "A")
    assert (graded / "mine" / ".minipar" / "hints.json").exists()
    monkeypatch.delenv("MINIPAR_EXERCISES")
    assert hints.home() == ROOT / "exercises" / ".minipar"
