"""pytest plugin used by ``minipar.course.grade``: what each graded test said, in words, to JSON.

* A failure keeps its whole explanation: a :class:`minipar.course.grading.GradeFailure`'s message,
  a rank's own exception (not the launcher's wrapper), a hang's report.
* **An error names the place in the learner's file**: when a rank (or the driver) raised inside
  the learner's code (``exercises/`` or ``$MINIPAR_EXERCISES``), the message starts with that
  file, line and code: ``rank 1: exercises/ex02_data_parallel.py:57  bucket.flat.copy_(g)
  AttributeError: ...``.
* Transfers are checked (``MINIPAR_CHECKED_COMM``): a send and a receive of different sizes
  raise in words on both ranks instead of aborting Gloo.
* **A hang fails fast.** Each rank keeps its last collective in a file (``MINIPAR_FLIGHT_DIR``,
  :class:`minipar.runtime.flight.Beacon`); when a launch times out, the failure lists every rank's last
  collective, step and peers, and every later test that launches ranks is skipped with that
  reason: one timeout, not one per test.
"""
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

_results: dict[str, dict] = {}
_hung: str | None = None          # why the remaining rank tests are skipped, once one hung
_flight_dir: Path | None = None


def pytest_configure(config):
    global _flight_dir
    os.environ["MINIPAR_CHECKED_COMM"] = "1"
    _flight_dir = Path(tempfile.mkdtemp(prefix="minipar-flight-"))
    os.environ["MINIPAR_FLIGHT_DIR"] = str(_flight_dir)
    import sys
    import minipar.runtime.launch  # noqa: F401 - the module (minipar.runtime.launch is also the function)
    launch_module = sys.modules["minipar.runtime.launch"]
    real = launch_module.get_pool

    def get_pool(*args, **kwargs):  # every launch passes here before starting ranks
        if _hung:
            pytest.skip(_hung)
        return real(*args, **kwargs)
    launch_module.get_pool = get_pool


def pytest_unconfigure(config):
    if _flight_dir is not None:
        shutil.rmtree(_flight_dir, ignore_errors=True)


def _key(location: str, nodeid: str) -> str:
    """A test's key: its file and node id (files outside the rootdir share empty node-id paths)."""
    return f"{location}::{nodeid}"


def pytest_collection_finish(session):
    for item in session.items:  # after -k / deselection: only what runs
        doc = (getattr(item, "function", None).__doc__ or "").strip()
        observes = list(getattr(getattr(item, "function", None), "__observes__", ()))
        _results[_key(item.location[0], item.nodeid)] = {"name": item.name, "doc": doc, "observes": observes,
                                 "outcome": "not run", "error": "",
                                 "file": str(item.path), "seconds": 0.0}


def pytest_runtest_setup(item):
    for f in _flight_dir.glob("rank*.json") if _flight_dir else []:
        f.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- explanations
def rank_exception(tb: str) -> str:
    """The exception text at the end of a traceback (type and whole message), without frames."""
    lines = tb.rstrip().splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.startswith('  File "')]
    j = frames[-1] + 1 if frames else 0
    while j < len(lines) and lines[j].startswith("    "):
        j += 1
    text = "\n".join(lines[j:]).strip() or (lines[-1] if lines else "?")
    if text.startswith(("minipar.course.grading.GradeFailure: ", "GradeFailure: ")):
        text = text.split(": ", 1)[1]
    return re.sub(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): ", r"\1: ", text)


_FRAME = re.compile(r'  File "(.+)", line (\d+), in ')


def learner_dirs() -> list[Path]:
    """Where the learner's files live: ``exercises/`` and ``$MINIPAR_EXERCISES``."""
    from minipar.course.exercise import EXERCISES_ENV
    from minipar.course.markers import ROOT
    dirs = [ROOT / "exercises"]
    if os.environ.get(EXERCISES_ENV):
        dirs.append(Path(os.environ[EXERCISES_ENV]))
    return [d.resolve() for d in dirs]


def _shown(path: str) -> str | None:
    """``path`` as the learner reads it (relative to the repository when inside it), or None
    when it is no learner's file."""
    from minipar.course.markers import ROOT
    try:
        p = Path(path).resolve()
    except (OSError, ValueError):
        return None
    if not any(p.is_relative_to(d) for d in learner_dirs()):
        return None
    return str(p.relative_to(ROOT.resolve())) if p.is_relative_to(ROOT.resolve()) else str(p)


def place_in_traceback(tb: str) -> str | None:
    """``file:line  code`` of the innermost frame of a formatted traceback (its last exception)
    that runs in the learner's file; None when no frame does."""
    lines = tb.splitlines()
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")), default=0)
    found = None
    for i in range(start, len(lines)):
        m = _FRAME.match(lines[i])
        if m and (shown := _shown(m[1])):
            code = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") \
                and not _FRAME.match(lines[i + 1]) else ""
            found = f"{shown}:{m[2]}  {code}".rstrip()
    return found


def place_of(e: BaseException) -> str | None:
    """:func:`place_in_traceback` of an exception raised in this process."""
    import traceback
    return place_in_traceback("".join(traceback.format_exception(type(e), e, e.__traceback__)))


def _without_common_tail(other: str, own: str, limit: int = 300) -> str:
    """``other``'s first line without the closing sentences it shares with ``own``."""
    other = other.splitlines()[0] if other else ""
    a, b = other.split(". "), own.splitlines()[0].split(". ")
    while len(a) > 1 and len(b) > 1 and a[-1] == b[-1]:
        a, b = a[:-1], b[:-1]
    text = ". ".join(a)
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def flight_lines() -> list[str]:
    """Every rank's last recorded operation, from the files the ranks kept."""
    rows = []
    for f in sorted(_flight_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:])) if _flight_dir else []:
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        rows.append(f"  rank {d['rank']}: {d['line']}")
    return rows


def explain(e: BaseException) -> str:
    global _hung
    from minipar.course.grading import GradeFailure
    from minipar.runtime.launch import LaunchTimeout, RankError
    if isinstance(e, GradeFailure):
        return str(e)
    if isinstance(e, RankError):
        own = rank_exception(e.remote_traceback)
        where = place_in_traceback(e.remote_traceback)
        text = f"rank {e.rank}: {where}  {own}" if where else f"rank {e.rank} failed: {own}"
        if "died without a result" in own:
            last = [ln for ln in flight_lines() if ln.startswith(f"  rank {e.rank}:")]
            if last:
                text += "\n  its last recorded operation: " + last[0].split(": ", 1)[1]
        same, others = [], []
        for r, tb in sorted(e.others.items()):
            other = rank_exception(tb)
            if any(s in tb for s in ("Connection", "pair.cc", "Broken pipe")):
                continue
            alike = re.sub(r"rank \d+", "rank N", other) == re.sub(r"rank \d+", "rank N", own)
            (same if alike else others).append((r, other))
        if same:
            text += f"\n  (rank{'s' if len(same) > 1 else ''} {', '.join(str(r) for r, _ in same)} failed the same way)"
        for r, other in others:
            text += f"\n  (rank {r} also failed: {_without_common_tail(other, own)})"
        return text
    if isinstance(e, LaunchTimeout) and getattr(e, "starting", None):
        _hung = "an earlier launch's ranks did not start; fix that first"
        return f"the ranks did not start: {e}"
    if isinstance(e, LaunchTimeout):
        rows = flight_lines()
        text = (f"the ranks hung: {e}\n" + ("the last operation each rank started:\n" + "\n".join(rows)
                if rows else "(no rank recorded a collective)") +
                "\n  A rank that finished an operation and never started the next, while its peers wait "
                "inside one, is the one stuck (or it called another operation than they did).")
        _hung = ("an earlier test hung (" + "; ".join(r.strip() for r in rows[:4]) +
                 "); fix that hang first") if rows else "an earlier test hung; fix that hang first"
        return text
    if isinstance(e, AssertionError):
        where = place_of(e)
        return (f"{where}  " if where else "") + (f"AssertionError: {e}" if str(e) else "AssertionError")
    where = place_of(e)
    lines = ((f"{where}  " if where else "") + f"{type(e).__name__}: {e}").splitlines()
    return "\n".join(lines[:20] + (["..."] if len(lines) > 20 else []))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        try:
            report.minipar_error = explain(call.excinfo.value)
        except Exception as err:  # noqa: BLE001 - never lose the failure itself
            report.minipar_error = f"{type(call.excinfo.value).__name__}: {call.excinfo.value} ({err})"


def pytest_runtest_logreport(report):
    key = _key(report.location[0] if report.location else "", report.nodeid)
    r = _results.setdefault(key, {"name": report.nodeid, "doc": "", "error": "",
                                            "file": report.location[0] if report.location else ""})
    r["seconds"] = r.get("seconds", 0.0) + report.duration
    if report.failed:
        r["outcome"] = "failed"
        crash = getattr(report.longrepr, "reprcrash", None)
        r["error"] = getattr(report, "minipar_error", None) or (crash.message if crash else str(report.longrepr)[-2000:])
    elif report.when == "call" and report.passed:
        r["outcome"] = "passed"
    elif report.skipped:
        r["outcome"] = "skipped"
        longrepr = report.longrepr
        r["error"] = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).removeprefix("Skipped: ")


def pytest_sessionfinish(session):
    if path := os.environ.get("MINIPAR_GRADE_REPORT"):
        with open(path, "w") as f:
            json.dump(list(_results.values()), f)
