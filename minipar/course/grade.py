"""Grade a chapter: ``python -m minipar.grade ex01`` or ``minipar.grade("ex01")``.

``ex01`` runs the chapter's graded tests in a fresh pytest process: the core exercise's
(``minipar/course/graded/test_ex01_*.py``) against your file in ``exercises/`` (``--solution``: against
``solutions/``), then, once you have attempted it (your file in ``exercises/challenges/`` is
no longer its stub) or with ``--challenge``, the chapter's challenge
(``minipar/course/graded/test_ch01_*.py``) against ``exercises/challenges/``
(``solutions/challenges/``; target ``"alternative"``: the second way in
``minipar/course/graded/alternatives/``). ``ch01`` (``python -m minipar.grade ch01``,
``minipar.grade("ch01")``) grades the challenge alone, without re-running the core.

It prints one line per test and, for each failure, the whole explanation (the rank, the
place, expected against got; a rank's error at the line of your file where it was raised)
and how to ask for a hint; never the hint itself. ``--all`` grades every chapter and ends
with a progress table. A chapter's score is the mean of its core's and its challenge's
scores (each the fraction of its tests passed); the core's alone when the chapter has no
challenge, the challenge's alone when it is graded alone.

``--reset ex02`` (or ``ch04``) puts the stub back in ``exercises/``, keeping your file in
``exercises/.backup/``. The same tests check the library and the solutions in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path

from . import failure_clauses
from .challenge import GRADED_ENV, graded_dir
from .exercise import EXERCISES_ENV, environ
from .markers import ROOT  # the repository (site-packages once installed): exercises/, solutions/

TARGETS = ("exercise", "solution", "library", "alternative")
FORMULA = "chapter score = (core + challenge) / 2 (the core alone without a challenge; the challenge alone when graded alone)"
ASK = "python -m minipar.grade {ch} (or --challenge)"
_LABEL = re.compile(r"(?:Exercise|Challenge) (\d+)(?: ([A-Z]\w*))?:")


@dataclass
class Report:
    exercise: str                 # "ex01_collectives" or "ch01_topic"
    target: str
    tests: list[dict] = field(default_factory=list)
    challenge: "Report | None" = None   # the chapter's challenge, graded after the core
    not_graded: str | None = None       # the chapter's challenge, left out (not attempted, not asked)

    @property
    def passed(self) -> int:
        return sum(t["outcome"] == "passed" for t in self.tests)

    @property
    def score(self) -> float:
        """Fraction of graded tests passed (0.0 to 1.0)."""
        return self.passed / len(self.tests) if self.tests else 0.0

    @property
    def chapter_score(self) -> float:
        """The mean of the core's and the challenge's scores (the core's alone when there is no
        challenge, the challenge's alone when graded alone): :data:`FORMULA`."""
        if self.challenge is None or not self.challenge.tests:
            return self.score
        if not self.tests:
            return self.challenge.score
        return (self.score + self.challenge.score) / 2

    def __str__(self) -> str:
        if not self.tests and self.challenge is not None:  # a chapter with only a challenge
            return str(self.challenge)
        lines = [f"{self.exercise} ({self.target}):"]
        for t in self.tests:
            outcome = {"passed": "PASS", "skipped": "SKIP"}.get(t["outcome"], "FAIL")
            title = " ".join(t["doc"].split("\n\n")[0].split()) if t["doc"] else t["name"]
            lines.append(f"  {outcome}  {t['name']}: {title}")
            if t["outcome"] != "passed":
                lines += ["        " + ln for ln in (t["error"] or t["outcome"]).rstrip().splitlines()]
                ids = failure_clauses.named(t["error"], t.get("observes"))
                if t["outcome"] == "failed":
                    lines += ["        " + ln for ln in failure_clauses.lines(ids)]
                if t["outcome"] == "failed" and (self.exercise.startswith("ex") or _has_hints(self.exercise)):
                    lines.append("        " + _suggest(self.exercise, t["error"], t.get("observes") or ()))
        lines.append(f"score: {self.passed}/{len(self.tests)} ({100 * self.score:.0f}%)")
        text = "\n".join(lines)
        if self.challenge is None:
            if self.not_graded:
                ch = f"ch{_chapter(self.exercise)}"
                text += (f"\n{self.not_graded}: not graded ({'not attempted yet; ' if self.target == 'exercise' else ''}"
                         f"{ASK.format(ch=ch)}); {FORMULA[:FORMULA.index(' (the core')]} once it is")
            return text
        text += "\n" + str(self.challenge)
        if self.challenge.tests:
            text += (f"\nchapter {_chapter(self.exercise)}: {100 * self.chapter_score:.0f}% = "
                     f"(core {100 * self.score:.0f}% + challenge {100 * self.challenge.score:.0f}%) / 2")
        return text


def _has_hints(name: str) -> bool:
    from .hints import parts
    try:
        return bool(parts(name))
    except (ValueError, SyntaxError):
        return False


def _suggest(exercise: str, error: str, observes=()) -> str:
    """The hint line, for the part the failure names ("Exercise 10 A:"), else the part of the
    clauses it breaks (:func:`failure_clauses.failed_part`: none when that is not known)."""
    from .hints import suggestion
    m = _LABEL.search(error or "")
    return suggestion(exercise, m[2] if m and m[2] else failure_clauses.failed_part(error, observes))


def _chapter(name: str) -> str:
    m = re.search(r"(?:ex|ch|^)(\d+)", str(name))
    if not m:
        raise ValueError(f"not a chapter or exercise name: {name!r} (e.g. 'ex01')")
    return m[1]


def exercises() -> list[str]:
    """Short names of the graded exercises: ['ex01', ...]."""
    return sorted({p.name.split("_")[1] for p in graded_dir().glob("test_ex*_*.py")})


def challenges() -> list[str]:
    """Short names of the graded challenges: ['ch01', ...]."""
    return sorted({p.name.split("_")[1] for p in graded_dir().glob("test_ch*_*.py")})


def test_file(exercise: str) -> Path:
    kind = "ch" if str(exercise).startswith("ch") else "ex"
    found = sorted(graded_dir().glob(f"test_{kind}{_chapter(exercise)}_*.py"))
    if not found:
        known = exercises() if kind == "ex" else challenges()
        raise ValueError(f"no graded {'challenge' if kind == 'ch' else 'exercise'} {exercise!r}; "
                         f"known: {', '.join(known)}")
    return found[0]


def challenge_file(exercise: str) -> Path | None:
    found = sorted(graded_dir().glob(f"test_ch{_chapter(exercise)}_*.py"))
    return found[0] if found else None


def grade(exercise: str, target: str = "exercise", verbose: bool = True, timeout: float = 600,
          exercises_dir: str | os.PathLike | None = None, challenge: bool | None = None) -> Report:
    """Grade chapter ``exercise``: ``"ex01"`` its core exercise, then its challenge once attempted
    (``challenge=True``: anyway; ``False``: never); ``"ch01"``
    the challenge alone (the core is not run). ``target``: ``"exercise"`` (your files),
    ``"solution"``, ``"library"`` or ``"alternative"`` (challenges only); prints the report when
    ``verbose``; returns it (the challenge's report as ``.challenge``; for ``"ch01"`` the core's
    part is empty). Its ``chapter_score`` is :data:`FORMULA`."""
    return grade_many([exercise], target, verbose, timeout, exercises_dir=exercises_dir, challenge=challenge)[0]


def attempted(name: str, exercises_dir: str | os.PathLike | None = None) -> bool:
    """Whether the learner's file of challenge ``name`` ("ch04") is more than its stub: it exists
    and differs from the pristine stub (git HEAD's), or, with no pristine copy to compare, some
    function in it does more than raise ``NotImplementedError``."""
    from .exercise_files import is_challenge_stub, stub_text
    graded = challenge_file(_chapter(name))
    base = Path(exercises_dir) if exercises_dir is not None else \
        Path(os.environ.get(EXERCISES_ENV) or ROOT / "exercises")
    path = base / "challenges" / f"{graded.stem.removeprefix('test_')}.py" if graded else None
    if path is None or not path.exists():
        return False
    try:
        stub = stub_text(str(name)[:4])
    except ValueError:                   # a challenge the course does not list (another graded dir)
        stub = None
    text = path.read_text()
    return text != stub if stub is not None else not is_challenge_stub(text)


def grade_many(names: list[str], target: str = "exercise", verbose: bool = True,
               timeout: float = 1800, exercises_dir: str | os.PathLike | None = None,
               challenge: bool | None = None, select: str | None = None,
               graded: str | os.PathLike | None = None) -> list[Report]:
    """:func:`grade` for several chapters in one pytest process (one start-up for all), in the
    order given (``"exNN"``: core then challenge; ``"chNN"``: the challenge alone). ``exercises_dir``: load the learner's files from there instead of
    ``exercises/`` (same layout: ``exNN_topic.py``, ``challenges/chNN_topic.py``).
    ``challenge``: after each core, its chapter's challenge too (``True``), never (``False``), or
    (``None``) only once the learner attempted it (:func:`attempted`; target ``"exercise"``).
    ``select``: only the tests pytest's ``-k`` expression picks.
    ``graded``: another directory of graded tests (with its own ``conftest.py``)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}")
    if graded is not None:  # another directory of graded tests (the grader's own tests)
        with environ(GRADED_ENV, str(Path(graded).resolve())):
            return grade_many(names, target, verbose, timeout, exercises_dir, challenge, select)
    chapters = list(dict.fromkeys(_chapter(n) for n in names))
    alone = {_chapter(n) for n in names if str(n).startswith("ch")} - \
        {_chapter(n) for n in names if not str(n).startswith("ch")}   # challenges graded alone
    for c in sorted(alone):
        if challenge_file(c) is None:
            test_file(f"ch{c}")   # raises, naming the known challenges
    core_paths = [] if target == "alternative" else [test_file(f"ex{c}") for c in chapters if c not in alone
                                                     and list(graded_dir().glob(f"test_ex{c}_*.py"))]
    def wanted(c: str) -> bool:
        if challenge is not None or target == "alternative":
            return challenge is not False
        return target == "exercise" and attempted(f"ch{c}", exercises_dir)
    ch_paths = [p for c in chapters if (c in alone or wanted(c)) and (p := challenge_file(c)) is not None]
    if not core_paths and not ch_paths:
        raise ValueError(f"nothing to grade for {names} (target {target!r})")
    challenge_target = "solution" if target == "library" else target
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        env = dict(os.environ, MINIPAR_GRADE_REPORT=str(out))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if exercises_dir is not None:
            env[EXERCISES_ENV] = str(Path(exercises_dir).resolve())
        impl = target if target != "alternative" else "solution"
        cmd = [sys.executable, "-m", "pytest", *map(str, core_paths + ch_paths), f"--impl={impl}",
               f"--challenge={challenge_target}", "-q", "-p", "minipar.course._grade_plugin",
               "-p", "no:cacheprovider", "--rootdir", str(ROOT)] + (["-k", select] if select else [])
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(f"the grader could not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results = json.loads(out.read_text())
        if proc.returncode not in (0, 1) and not any(t["outcome"] in ("passed", "failed") for t in results):
            raise RuntimeError(f"the grader could not run the tests (pytest exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")

    def of(path: Path, tgt: str) -> Report:
        return Report(path.stem.removeprefix("test_"), tgt,
                      [t for t in results if Path(t.get("file", "")).name == path.name])

    reports = []
    for c in chapters:
        core = next((p for p in core_paths if p.name.startswith(f"test_ex{c}_")), None)
        ch = next((p for p in ch_paths if p.name.startswith(f"test_ch{c}_")), None)
        rep = of(core, target) if core else Report(f"{'ch' if c in alone else 'ex'}{c}", target)
        rep.challenge = of(ch, challenge_target) if ch else None
        if ch is None and core is not None and (left := challenge_file(c)) is not None:
            rep.not_graded = left.stem.removeprefix("test_")
        reports.append(rep)
    for report in reports if verbose else []:
        print(report)
    return reports


def table(reports: list[Report]) -> str:
    """The progress table: chapter, core (passed/total), challenge (passed/total), score."""
    rows = [("chapter", "core", "challenge", "score")]
    for r in reports:
        ch = r.challenge
        rows.append((_chapter(r.exercise), f"{r.passed}/{len(r.tests)}" if r.tests else "-",
                     f"{ch.passed}/{len(ch.tests)}" if ch is not None and ch.tests else "-",
                     f"{100 * r.chapter_score:.0f}%"))
    total = sum(r.chapter_score for r in reports) / len(reports) if reports else 0.0
    rows.append(("all", "", "", f"{100 * total:.0f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows] +
                     [f"({FORMULA}; all = the mean over the chapters)"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minipar.grade", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="  ex04         the core exercise of chapter 04, then its challenge once attempted\n"
               "  ch04         the challenge of chapter 04 alone (the core is not run)\n"
               "  --reset ex02 put the stub of ex02 (or ch04) back; your file goes to exercises/.backup/\n"
               f"score: {FORMULA}")
    p.add_argument("exercise", nargs="?", help="ex01 (core, then challenge) or ch01 (the challenge alone); "
                   "omit with --all")
    p.add_argument("--solution", action="store_true", help="grade solutions/ instead of exercises/")
    p.add_argument("--alternative", action="store_true", help="grade the challenges' second solutions")
    p.add_argument("--all", action="store_true", help="grade every chapter and its challenge, then print the "
                   "progress table")
    p.add_argument("--challenge", action="store_true", help="grade the chapter's challenge after its core even "
                   "if not attempted yet (--solution: the challenge's solution too)")
    p.add_argument("--exercises-dir", help="load your files from this directory instead of exercises/")
    p.add_argument("--reset", metavar="NAME", help="restore the stub of exercise NAME (ex02) or challenge "
                   "NAME (ch04) from the generator, without asking; your file is kept in .backup/")
    a = p.parse_args(argv)
    if a.reset:
        from .exercise_files import reset
        try:
            print(reset(a.reset, a.exercises_dir))
        except ValueError as e:
            p.error(str(e))
        return 0
    names = sorted(set(exercises()) | {f"ex{_chapter(c)}" for c in challenges()}) \
        if a.all or not a.exercise else [a.exercise]
    target = "alternative" if a.alternative else "solution" if a.solution else "exercise"
    reports = grade_many(names, target, exercises_dir=a.exercises_dir,
                         challenge=True if a.all or a.challenge else None)
    if len(reports) > 1:
        print()
        print(table(reports))
    return 0 if all(r.chapter_score == 1.0 for r in reports) else 1


class _CallableModule(types.ModuleType):
    """Lets ``minipar.grade("ex01")`` call :func:`grade` while ``python -m minipar.grade``
    runs this module: the module and the function share one name."""

    def __call__(self, exercise: str, target: str = "exercise", verbose: bool = True,
                 challenge: bool | None = None) -> Report:
        """``minipar.grade("ex04")``: the core, then the challenge once attempted (``challenge=True``:
        anyway); ``minipar.grade("ch04")``: the challenge alone."""
        return grade(exercise, target=target, verbose=verbose, challenge=challenge)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
