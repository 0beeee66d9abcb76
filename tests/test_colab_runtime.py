"""Colab played end to end: a fresh runtime that already has its own torch, no minipar, a
notebook opened outside the repository. Run by ``python3 course.py test --colab`` (it makes
that runtime: a virtual environment with only torch 2.9.0, ipykernel and nbclient), skipped
otherwise; it downloads nothing but what pip installs for minipar.

It asserts what the setup cell promises: it clones ``MINIPAR_REPO`` and installs the course,
the runtime's torch is still the one it had, the notebooks run to the end, and
``python -m minipar.grade`` works from there, on the clone's exercises."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("MINIPAR_COLAB_PYTHON")
NOTEBOOKS = ["00_welcome.ipynb", "02_data_parallel.ipynb"]

pytestmark = pytest.mark.skipif(not PYTHON, reason="python3 course.py test --colab makes the runtime")

RUN = """
import json, sys, time, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
t = time.perf_counter()
NotebookClient(nb, timeout=600, kernel_name="python3").execute()
setup = "".join(o.get("text", "") for o in nb.cells[1].outputs)
print(json.dumps({"seconds": time.perf_counter() - t, "cells": len(nb.cells), "setup": setup}))
"""


def _py(*args, cwd, env=None, timeout=900):
    return subprocess.run([PYTHON, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _torch(cwd) -> str:
    return _py("-c", "from importlib.metadata import version; print(version('torch'))", cwd=cwd).stdout.strip()


def test_a_fresh_runtime_installs_the_course_keeps_its_torch_and_grades(tmp_path):
    clone, work = tmp_path / "origin", tmp_path / "content"   # a fork's clone, and Colab's /content
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    work.mkdir()
    before = _torch(work)
    assert before and _py("-c", "import minipar", cwd=work).returncode != 0, "the runtime must start without minipar"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "MINIPAR_", "VIRTUAL_ENV"))}
    env.update(MINIPAR_REPO=f"file://{clone}", MINIPAR_STATIC_WIDGETS="1")
    runs = {}
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / name, work / name)
        out = _py("-c", RUN, str(work / name), cwd=work, env=env)
        assert out.returncode == 0, f"{name} did not run to the end:\n{out.stderr[-4000:]}"
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert (work / "minipar-course" / "minipar").is_dir(), "the setup cell did not clone the course"
    assert runs[NOTEBOOKS[0]]["setup"].startswith("minipar on torch "), runs[NOTEBOOKS[0]]["setup"]
    assert _torch(work) == before, f"the runtime's torch changed: {before} -> {_torch(work)}"
    where = _py("-c", "import minipar; print(minipar.__file__)", cwd=tmp_path, env=env).stdout.strip()
    assert where.startswith(str(work / "minipar-course")), f"minipar imported from {where}"
    graded = _py("-m", "minipar.course.grade", "ex01", "--solution", cwd=tmp_path, env=env)
    assert graded.returncode == 0 and "(100%)" in graded.stdout, graded.stdout[-3000:] + graded.stderr[-3000:]
    print(json.dumps({"torch": before, "seconds": {k: round(v["seconds"]) for k, v in runs.items()}}))
