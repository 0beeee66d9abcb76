"""pytest plugin used by ``minipar.grade``: writes each graded test's outcome to JSON."""
import json
import os

_results: dict[str, dict] = {}


def pytest_collection_modifyitems(items):
    for item in items:
        doc = (getattr(item, "function", None).__doc__ or "").strip()
        _results[item.nodeid] = {"name": item.name, "doc": doc, "outcome": "not run", "error": "",
                                 "file": item.nodeid.split("::")[0]}


def pytest_runtest_logreport(report):
    r = _results.setdefault(report.nodeid, {"name": report.nodeid, "doc": "", "error": "",
                                            "file": report.nodeid.split("::")[0]})
    if report.failed:
        r["outcome"] = "failed"
        crash = getattr(report.longrepr, "reprcrash", None)
        r["error"] = crash.message if crash else str(report.longrepr)[-2000:]
    elif report.when == "call" and report.passed:
        r["outcome"] = "passed"
    elif report.skipped:
        r["outcome"] = "skipped"


def pytest_sessionfinish(session):
    if path := os.environ.get("MINIPAR_GRADE_REPORT"):
        with open(path, "w") as f:
            json.dump(list(_results.values()), f)
