"""Colab and Kaggle: every notebook opens there and installs the course from one repository."""
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minipar.course import colab

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_starts_with_the_colab_link_and_the_setup_cell(path):
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[0].cell_type == "markdown" and colab.badge(path.name) in nb.cells[0].source, \
        f"{path.name}: the first cell must carry {colab.badge(path.name)}"
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    assert first_code.source == colab.setup_cell(), f"{path.name}: the setup cell differs from minipar.course.colab.setup_cell()"


def test_the_repository_is_named_once():
    assert colab.REPOSITORY in colab.setup_cell()
    assert colab.colab_url("11_real_hardware.ipynb") == (
        "https://colab.research.google.com/github/minipar/minipar/blob/main/notebooks/11_real_hardware.ipynb")


def test_setup_cell_does_nothing_but_report_where_minipar_is_installed():
    out = subprocess.run([sys.executable, "-c", colab.setup_cell()], capture_output=True, text=True,
                         timeout=120, cwd=ROOT / "notebooks")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("minipar on torch ") and "2 ranks:" in out.stdout and "8 ranks:" in out.stdout


def test_setup_cell_on_a_fresh_runtime_installs_only_what_it_lacks(monkeypatch):
    """As on Colab: minipar is not installed; the cell clones MINIPAR_REPO, installs the course
    without its dependencies (torch, ipywidgets, pytest of the runtime stay), then only the
    needed packages the runtime lacks (here plotly and cloudpickle), and nothing more when it
    lacks none."""
    for lacking, want in ((("minipar", "plotly", "cloudpickle"), ["plotly", "cloudpickle"]), (("minipar",), None)):
        calls = []
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, lacking=lacking: None if name in lacking else True)
        monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
        monkeypatch.setenv("MINIPAR_REPO", "https://example.org/fork.git")
        path = list(sys.path)
        try:
            exec(compile(colab.setup_cell().replace("import minipar\nprint(minipar.runtime.backend.summary())", ""),
                         "setup", "exec"), {})
            added = sys.path[0]
        finally:
            sys.path[:] = path
        assert calls[0][:3] == ["git", "clone", "-q"] and "https://example.org/fork.git" in calls[0]
        assert calls[1] == [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", "minipar-course"]
        assert calls[2:] == ([[sys.executable, "-m", "pip", "install", "-q", *want]] if want else [])
        assert added == os.path.abspath("minipar-course")  # the cell puts the clone first on sys.path


def test_the_setup_cell_needs_what_the_package_needs_but_torch_and_the_lab():
    """RUNTIME_NEEDS is pyproject's dependencies less torch (the runtime's own CUDA build) and
    jupyterlab (a hosted runtime is its own notebook server)."""
    import re
    deps = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    names = re.findall(r'"([A-Za-z0-9_-]+)', deps)
    assert sorted(colab.RUNTIME_NEEDS) == sorted(set(names) - {"torch", "jupyterlab"})


def test_readme_opens_every_notebook_in_colab():
    """README's chapter table lists every notebook with its badge (derived from colab.REPOSITORY)."""
    readme = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        assert f"| `{path.stem}` | {colab.badge(path.name)} |" in readme, f"README lacks {path.stem}'s row"
