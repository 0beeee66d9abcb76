"""Every notebook runs top to bottom, headless, without an error, and shows its figures.

Executed with nbclient in a fresh kernel from the notebooks/ folder, as a learner would
run them; any cell that raises fails the test with the cell's error. Each executed copy is
kept in build/executed/ (with its run time), and the web book is built from those copies.
Every code cell whose last statement is a figure expression (:func:`figure_cells`: ``fig``,
``viz.timeline(...)``, ``....show()``, ``plots.routing(...)`` ...) must have displayed a figure
(a Plotly figure, or an image), and what its text states must be what its cells printed
(:mod:`notebook_claims`: the key numbers, e.g. a loss difference from one process, recorded
bytes against the formula). Executing the notebooks is the slow tier (``-m slow``).
"""
import ast
import re
from pathlib import Path

import nbformat
import pytest

from minipar.course.book.execute import execute
from notebook_claims import CLAIMS, problems

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))


FIGURE = re.compile(r"(?i)\bfig\b|figure|timeline|diagram|curves|heatmap|update_layout|\.show\(|\bplots\.|\bdraw_|"
                    r"\bexplore\(|\bviz\.(?!color\b)\w+\(")
FIGURE_DATA = ("application/vnd.plotly.v1+json", "image/png", "image/svg+xml")


def figure_cells(nb) -> list[int]:
    """Indices of the code cells whose last top-level statement is an expression that makes a
    figure (its source matches :data:`FIGURE`; a call of ``print`` is none)."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        src = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            body = ast.parse(src).body
        except SyntaxError:
            continue
        last = body[-1] if body else None
        if not isinstance(last, ast.Expr):
            continue
        call = last.value.func if isinstance(last.value, ast.Call) else None
        if isinstance(call, ast.Name) and call.id in ("print", "display"):
            continue
        if FIGURE.search(ast.get_source_segment(src, last) or ""):
            out.append(i)
    return out


def missing_figures(nb) -> list[int]:
    """The :func:`figure_cells` of an executed notebook that displayed no figure."""
    return [i for i in figure_cells(nb)
            if not any(k in o.get("data", {}) for o in nb.cells[i].get("outputs", []) for k in FIGURE_DATA)]


def test_a_figure_cell_without_its_figure_is_found():
    """The check itself, on a notebook made here: a figure cell with a Plotly output passes,
    the same without one is found; a print, an assignment and a plain number are no figure cells."""
    v4 = nbformat.v4
    plotly = v4.new_output("display_data", data={"application/vnd.plotly.v1+json": {}})
    nb = v4.new_notebook(cells=[
        v4.new_code_cell("fig = make()\nfig", outputs=[plotly]),
        v4.new_code_cell("viz.timeline(res.trace,\n             title='x')"),
        v4.new_code_cell("print(fig)"),
        v4.new_code_cell("fig = viz.timeline(t)"),
        v4.new_markdown_cell("fig"),
        v4.new_code_cell("%matplotlib inline\nplots.routing(x).show()"),
        v4.new_code_cell("1 + 1", outputs=[v4.new_output("execute_result", data={"text/plain": "2"})]),
    ])
    assert figure_cells(nb) == [0, 1, 5]
    assert missing_figures(nb) == [1, 5]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("MINIPAR_STATIC_WIDGETS", "1")  # see minipar.runtime.viz.explore
    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name} is committed with outputs; clear them"
    executed, elapsed = execute(path)
    print(f"{path.name}: {elapsed:.1f} s")
    missing = missing_figures(executed)
    assert not missing, f"{path.name}: cell(s) {missing} end in a figure expression but showed no figure"
    wrong = problems(path.name[:2], executed)
    assert not wrong, f"{path.name}: what the text states is not what the cells printed: {wrong}"
    # how long it took is printed and kept with the executed copy, not asserted: on a loaded
    # machine a chapter of a few minutes took over five (a test must not depend on timing)


def test_every_notebook_states_claims_that_are_checked():
    """Each notebook has at least two claims (tests/notebook_claims.py), and the check finds a
    claim whose line is gone and a number that is off: here on a notebook made in the test."""
    from nbformat import v4
    assert sorted(CLAIMS) == [p.name[:2] for p in NOTEBOOKS]
    assert all(len(c) >= 2 for c in CLAIMS.values()), {k: len(c) for k, c in CLAIMS.items()}

    def nb(*texts):
        return v4.new_notebook(cells=[v4.new_code_cell("x", outputs=[v4.new_output("stream", text=t)])
                                      for t in texts])
    right = "largest loss difference over 20 steps: 7.4e-05\n"
    bytes_ = "2 ranks x 4 micro-batches of 2: same training; 440,832 B sent per step = 2(n-1)/n·Ψ·4 = 440,832 B\n"
    reducers = ("Ψ = 1 parameters; theory 2(n-1)/n·Ψ·4 B = 3.119 MiB per rank per step\n"
                "     naive:  53 all-reduces per step, 3.119 MiB sent by rank 0 per step\n"
                "  bucketed:   9 all-reduces per step, 3.119 MiB sent by rank 0 per step\n"
                "overlapped:   9 all-reduces per step, {} MiB sent by rank 0 per step\n")
    assert problems("02", nb(right, bytes_, reducers.format("3.119"))) == []
    assert problems("02", nb(right.replace("7.4e-05", "3.1e-02"), bytes_, reducers.format("3.119"))) == [
        "DDP's losses are one process's: not borne out by 'largest loss difference over 20 steps: 3.1e-02'"]
    wrong = problems("02", nb(right, bytes_, reducers.format("6.238")))
    assert len(wrong) == 1 and wrong[0].startswith("every reducer sends 2(n-1)/n·Ψ·4 bytes: not borne out"), wrong
    gone = problems("02", nb(right, reducers.format("3.119")))
    assert len(gone) == 1 and gone[0].startswith("accumulation sends the formula's bytes: 0 printed line(s) match")\
        and gone[0].endswith("expected at least 1"), gone
