"""Every notebook runs top to bottom, headless, without an error.

Executed with nbclient in a fresh kernel from the notebooks/ folder, as a learner would
run them; any cell that raises fails the test with the cell's error. Each executed copy is
kept in build/executed/ (with its run time), and the web book is built from those copies.
"""
from pathlib import Path

import nbformat
import pytest

from minipar.course.book.execute import execute

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("MINIPAR_STATIC_WIDGETS", "1")  # see minipar.runtime.viz.explore
    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name} is committed with outputs; clear them"
    _, elapsed = execute(path)
    print(f"{path.name}: {elapsed:.1f} s")
    assert elapsed < 300, f"{path.name} took {elapsed:.0f} s; a chapter should run in a few minutes"
