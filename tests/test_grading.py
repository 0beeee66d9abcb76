"""The grader itself: stubs score zero quickly and cleanly (cores and challenges, one grading
run for all), a correct file scores 100% through it, a challenge is graded by its goal (a
second, different way passes) and alone (``ch99``: the core is not run), the progress table
adds up and states its formula, and ``--reset`` puts a stub back.

The stubs graded are freshly generated ones (:func:`minipar.course.exercise_files.write_stubs`
into a temporary directory), never the learner's ``exercises/``: a learner who solved
some exercises still sees these tests pass."""
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from minipar.course import exercise_files, grade
from minipar.course.markers import GRADED, ROOT

CHAPTERS = sorted(set(grade.exercises()) | {f"ex{grade._chapter(c)}" for c in grade.challenges()})


@pytest.fixture(scope="module")
def fresh_stubs(tmp_path_factory):
    """Freshly generated stubs in a temporary directory (the layout of exercises/), and the
    challenges with no pristine copy to be found (no git history and a written file)."""
    where = tmp_path_factory.mktemp("stubs")
    return where, exercise_files.write_stubs(where)


@pytest.fixture(scope="module")
def stub_reports(fresh_stubs):
    """Every chapter's graded tests, cores and challenges, on fresh stubs, in one grading run."""
    where, _ = fresh_stubs
    t = time.perf_counter()
    reports = {grade._chapter(r.exercise): r
               for r in grade.grade_many(CHAPTERS, "exercise", verbose=False, exercises_dir=where, challenge=True)}
    return reports, time.perf_counter() - t


def _all_fail_with_their_stub(report, label):
    assert report.tests, f"{report.exercise}: no graded tests were collected"
    assert report.score == 0.0
    assert all(r["outcome"] == "failed" for r in report.tests), [r["outcome"] for r in report.tests]
    assert all("NotImplementedError" in r["error"] and label in r["error"] for r in report.tests), \
        [r["error"][:200] for r in report.tests]


@pytest.mark.slow   # grades every stub
@pytest.mark.parametrize("exercise", grade.exercises())
def test_exercise_stubs_score_zero_without_hanging(exercise, stub_reports):
    """Every graded test of a generated stub fails, within the stub's own NotImplementedError
    (in the driver or in a rank), and nothing hangs."""
    reports, seconds = stub_reports      # nothing hangs: every test fails with its stub's error, not a timeout
    _all_fail_with_their_stub(reports[exercise[2:]], f"Exercise {exercise[2:]}")


@pytest.mark.slow   # grades every stub
@pytest.mark.parametrize("name", grade.challenges())
def test_challenge_stubs_score_zero(name, stub_reports, fresh_stubs):
    """A challenge's learner file, unwritten, scores 0: each of its functions raises."""
    if name in fresh_stubs[1]:
        pytest.skip(f"{name}: no pristine stub here (no git history, and the file is written)")
    reports, _ = stub_reports
    report = reports[name[2:]].challenge
    assert report is not None, f"{name} was not graded after its chapter's core"
    _all_fail_with_their_stub(report, f"Challenge {name[2:]}")


@pytest.mark.slow   # the grader as a learner runs it
def test_the_solution_scores_full_marks_through_the_grader(capsys):
    report = grade.grade("ex01", target="solution")
    assert report.score == 1.0 and len(report.tests) >= 5
    out = capsys.readouterr().out
    assert f"score: {len(report.tests)}/{len(report.tests)} (100%)" in out
    if report.challenge is not None:
        assert report.challenge.score == 1.0, str(report.challenge)
    assert "stuck?" not in out, "the grader suggests a hint only on a failure"


# ----------------------------------------------------------------------------- a demo challenge
DEMO_TEST = '''
    """Challenge 99: order n ranks on a ring so that every hop joins neighbours (|a - b| = 1 mod n).
    Goal: 0 long hops, measured on 2 ranks and for n = 2..9."""
    import minipar
    from minipar.course.grading import expect_equal

    CHALLENGE = "ch99_demo"
    HINTS = {"": ("Which neighbours does rank i have?", "Walk the ranks in order.", "range(n)")}


    def _long_hops(order):
        n = len(order)
        return sum((order[i] - order[(i + 1) % n]) % n not in (1, n - 1) for i in range(n)) if n > 2 else 0


    def test_every_rank_agrees_on_a_ring(challenge):
        """The order computed on 2 ranks (the function travels to them) is the same ring on both."""
        orders = minipar.launch(challenge.ring_order, 2, args=(6,), timeout=30)
        expect_equal(orders[1], orders[0], "the ring order, rank 1 against rank 0")


    def test_no_long_hops(challenge):
        """Measured: long hops of the ring for n = 2..9 (goal: 0 each)."""
        got = {n: _long_hops(challenge.ring_order(n)) for n in range(2, 10)}
        expect_equal(got, dict.fromkeys(got, 0), "long hops of your ring (goal 0)", keys="n")
        for n in range(2, 10):
            expect_equal(sorted(challenge.ring_order(n)), list(range(n)), f"n = {n}: every rank once")
'''
STUB = 'def ring_order(n):\n    raise NotImplementedError("Challenge 99: ring_order")\n'
ALTERNATIVE = 'def ring_order(n):\n    return [(n - i) % n for i in range(n)]  # the other way round\n'
WRONG = 'def ring_order(n):\n    return [2 * i % n for i in range(n)]\n'


DEMO_CORE = '''"""Exercise 99: a core that always passes."""


def test_core_runs():
    """The core's one test."""
'''


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A graded directory holding a tiny challenge three times (chapters 97, 98 and 99) with its
    alternative, chapters 97 and 99 with a core too, and a learner's files: an unwritten stub for
    97 and 98, a wrong ring for 99."""
    root = tmp_path_factory.mktemp("graded")
    shutil.copy(GRADED / "conftest.py", root / "conftest.py")
    (root / "alternatives").mkdir()
    mine = tmp_path_factory.mktemp("exercises")
    (mine / "challenges").mkdir()
    for chapter, learner in (("97", STUB.replace("99", "97")), ("98", STUB.replace("99", "98")), ("99", WRONG)):
        test = textwrap.dedent(DEMO_TEST).lstrip().replace("99", chapter)
        (root / f"test_ch{chapter}_demo.py").write_text(test)
        (root / "alternatives" / f"ch{chapter}_demo.py").write_text(ALTERNATIVE)
        (mine / "challenges" / f"ch{chapter}_demo.py").write_text(learner)
    (root / "test_ex99_demo.py").write_text(DEMO_CORE)
    (root / "test_ex97_demo.py").write_text(DEMO_CORE.replace("99", "97"))
    return root, mine


@pytest.mark.slow   # the grader as a learner runs it
def test_a_challenge_is_graded_by_its_goal(demo, capsys):
    """The stub scores 0, a wrong way fails with the measured number against the goal (one
    grading run for both), and a second, different way passes: the goal is graded, not one answer."""
    root, mine = demo
    stub, wrong = grade.grade_many(["ch98", "ch99"], "exercise", graded=root, exercises_dir=mine)
    assert stub.tests == [] and stub.challenge is not None
    assert stub.challenge.score == 0.0 and len(stub.challenge.tests) == 2
    assert all("Challenge 98: ring_order" in t["error"] for t in stub.challenge.tests)
    hops = next(t for t in wrong.challenge.tests if t["name"].startswith("test_no_long_hops"))
    assert hops["outcome"] == "failed" and "long hops of your ring (goal 0): n 4: expected 0, got 4" in hops["error"]
    alt = grade.grade_many(["ch99"], "alternative", graded=root, verbose=False)[0]
    assert alt.challenge.score == 1.0, str(alt.challenge)
    assert alt.chapter_score == 1.0
    out = capsys.readouterr().out
    assert "ch98_demo (exercise):" in out and "score: 0/2 (0%)" in out
    assert 'stuck? minipar.hint("ch98")' in out and "Walk the ranks" not in out, "how to ask, never the hint"
    assert "ex99_demo" not in out and "test_core_runs" not in out, "ch99 grades the challenge alone"


def test_ex_grades_core_then_challenge_and_states_the_chapter_score(demo, capsys):
    root, mine = demo
    rep = grade.grade_many(["ex99"], "exercise", graded=root, exercises_dir=mine, select="core or long_hops")[0]
    assert [t["name"] for t in rep.tests] == ["test_core_runs"] and rep.score == 1.0
    assert [t["name"].split("[")[0] for t in rep.challenge.tests] == ["test_no_long_hops"]
    assert rep.challenge.score == 0.0 and rep.chapter_score == 0.5
    out = capsys.readouterr().out
    assert out.index("ex99_demo (exercise):") < out.index("ch99_demo (exercise):")
    assert "chapter 99: 50% = (core 100% + challenge 0%) / 2" in out

def test_an_unattempted_challenge_is_left_out_unless_asked(demo, capsys):
    """ex97's challenge is still its stub: ``ex97`` grades the core alone and says how to grade the
    challenge and how the chapter's score is formed; asked (``challenge=True``), it is graded."""
    root, mine = demo
    rep = grade.grade_many(["ex97"], "exercise", graded=root, exercises_dir=mine)[0]
    assert rep.challenge is None and rep.not_graded == "ch97_demo" and rep.chapter_score == 1.0
    out = capsys.readouterr().out
    assert "ch97_demo: not graded (not attempted yet; python -m minipar.grade ch97 (or --challenge)); " \
           "chapter score = (core + challenge) / 2 once it is" in out
    assert "Challenge 97" not in out and "chapter 97:" not in out
    asked = grade.grade_many(["ex97"], "exercise", graded=root, exercises_dir=mine, challenge=True, verbose=False)[0]
    assert asked.challenge is not None and asked.challenge.score == 0.0 and asked.chapter_score == 0.5


def test_progress_table():
    core = grade.Report("ex01_collectives", "exercise", [{"outcome": "passed"}] * 3 + [{"outcome": "failed"}])
    core.challenge = grade.Report("ch01_x", "exercise", [{"outcome": "passed"}, {"outcome": "failed"}])
    lone = grade.Report("ex10_planning", "exercise", [{"outcome": "passed"}] * 5)
    lines = grade.table([core, lone]).splitlines()
    assert lines[0].split() == ["chapter", "core", "challenge", "score"]
    assert lines[1].split() == ["01", "3/4", "1/2", "62%"]        # (3/4 + 1/2) / 2
    assert lines[2].split() == ["10", "5/5", "-", "100%"]
    assert lines[3].split() == ["all", "81%"]
    assert lines[4] == f"({grade.FORMULA}; all = the mean over the chapters)"
    assert "(core + challenge) / 2" in grade.FORMULA
    alone = grade.Report("ch01", "exercise")
    alone.challenge = grade.Report("ch01_x", "exercise", [{"outcome": "passed"}, {"outcome": "failed"}])
    assert alone.chapter_score == 0.5 and grade.table([alone]).splitlines()[1].split() == ["01", "-", "1/2", "50%"]


def test_help_documents_ch_alone_reset_and_the_score():
    out = subprocess.run([sys.executable, "-m", "minipar.grade", "--help"], capture_output=True, text=True,
                         cwd=ROOT).stdout
    assert "the challenge of chapter 04 alone" in out and "--reset" in out and "(core + challenge) / 2" in out
    for doc in (grade.__doc__, grade.grade.__doc__):
        assert "the challenge alone" in doc


def test_reset_restores_a_stub_and_keeps_the_learners_file(tmp_path, capsys):
    """``python -m minipar.grade --reset ex02`` / ``ch04``: asks nothing, writes the stub, says
    what it overwrote and keeps it in .backup/; an unknown name is refused."""
    mine = tmp_path / "exercises"
    (mine / "challenges").mkdir(parents=True)
    solved = (ROOT / "solutions" / f"{grade.test_file('ex02').stem.removeprefix('test_')}.py").read_text()
    ex02 = mine / f"{grade.test_file('ex02').stem.removeprefix('test_')}.py"
    ex02.write_text(solved)
    ch04 = mine / "challenges" / f"{grade.test_file('ch04').stem.removeprefix('test_')}.py"
    ch04.write_text("def schedule(p, m, rank):\n    return []\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "minipar.grade", *a, "--exercises-dir", str(mine)],  # noqa: E731
                                    capture_output=True, text=True, cwd=ROOT, stdin=subprocess.DEVNULL, timeout=120)
    out = run("--reset", "ex02")
    assert out.returncode == 0, out.stderr
    assert ex02.read_text() == exercise_files.render("ex02", solution=False)
    backups = list((mine / ".backup").glob("ex02_*.py"))
    assert len(backups) == 1 and backups[0].read_text() == solved
    assert f"reset {ex02}" in out.stdout and f"kept as {backups[0]}" in out.stdout
    main = lambda *a: grade.main([*a, "--exercises-dir", str(mine)])  # noqa: E731 - the same, in process
    assert main("--reset", "ex02") == 0 and "already the stub" in capsys.readouterr().out
    assert len(list((mine / ".backup").iterdir())) == 1
    assert main("--reset", "ch04") == 0 and f"reset {ch04}" in capsys.readouterr().out
    assert exercise_files.is_challenge_stub(ch04.read_text()) and "Challenge 04" in ch04.read_text()
    assert [p.read_text() for p in (mine / ".backup").glob("ch04_*.py")] == ["def schedule(p, m, rank):\n    return []\n"]
    for bad in ("ex99", "ch99", "nope"):
        with pytest.raises(SystemExit) as e:
            main("--reset", bad)
        assert e.value.code == 2 and "error:" in capsys.readouterr().err, bad
    out = run("--reset", "nope")
    assert out.returncode == 2 and "not an exercise or challenge name: 'nope'" in out.stderr
