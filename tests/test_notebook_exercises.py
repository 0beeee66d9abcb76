"""Every chapter with an exercise ends its notebook's teaching in the same form: an
``## Exercise NN`` section, the learner's file named, a code cell that grades it
(``minipar.grade("exNN")``) and the hint command, and a ``## Challenge NN`` section naming the
challenge's file, how to grade it alone and its hints. Read from the committed notebooks (no
execution); the chapters come from :data:`minipar.course.chapters.CHAPTERS`, none left out."""
import nbformat
import pytest

from minipar.course import chapters
from minipar.course.markers import GRADED

WITH_EXERCISE = [c for c in chapters.CHAPTERS if c.exercise]


def problems(nb, number: str, exercise: str, challenge: str | None) -> list[str]:
    """What notebook ``nb`` of chapter ``number`` lacks (empty: nothing)."""
    md = [c.source for c in nb.cells if c.cell_type == "markdown"]
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    out = []
    if not any(f"## Exercise {number}" in s for s in md):
        out.append(f"no '## Exercise {number}' section")
    if not any(f"exercises/{exercise}.py" in s for s in md):
        out.append(f"no markdown names exercises/{exercise}.py")
    if not any(f'minipar.grade("ex{number}")' in s for s in code):
        out.append(f'no code cell runs minipar.grade("ex{number}")')
    if not any(f'minipar.hint("ex{number}"' in s for s in md):
        out.append(f'no markdown says minipar.hint("ex{number}", ...)')
    if challenge:
        part = next((s for s in md if f"## Challenge {number}" in s), None)
        if part is None:
            out.append(f"no '## Challenge {number}' section")
        else:
            if f"exercises/challenges/{challenge}.py" not in part:
                out.append(f"the challenge section does not name exercises/challenges/{challenge}.py")
            if f"python -m minipar.grade ch{number}" not in part and f'minipar.grade("ch{number}")' not in part:
                out.append(f"the challenge section does not say how to grade ch{number} alone")
            if f'minipar.hint("ch{number}")' not in part:
                out.append(f'the challenge section does not say minipar.hint("ch{number}")')
    return out


@pytest.mark.parametrize("chapter", WITH_EXERCISE, ids=[c.number for c in WITH_EXERCISE])
def test_the_notebook_has_its_exercise_and_challenge_cells(chapter):
    nb = nbformat.read(chapters.ROOT / "notebooks" / chapter.notebook, as_version=4)
    challenge = chapter.challenge if (GRADED / f"test_{chapter.challenge}.py").exists() else None
    assert problems(nb, chapter.number, chapter.exercise, challenge) == []


def test_the_check_finds_a_missing_cell():
    v4 = nbformat.v4
    good = v4.new_notebook(cells=[
        v4.new_markdown_cell("## Exercise 98: x\nOpen `exercises/ex98_demo.py`. Stuck? `minipar.hint(\"ex98\", \"A\")`."),
        v4.new_code_cell('report = minipar.grade("ex98")'),
        v4.new_markdown_cell("## Challenge 98: y\n`exercises/challenges/ch98_demo.py`; `python -m minipar.grade ch98`, "
                             "`minipar.hint(\"ch98\")`.")])
    assert problems(good, "98", "ex98_demo", "ch98_demo") == []
    no_grade = v4.new_notebook(cells=[good.cells[0], good.cells[2]])
    assert problems(no_grade, "98", "ex98_demo", "ch98_demo") == ['no code cell runs minipar.grade("ex98")']
    assert problems(v4.new_notebook(cells=good.cells[:2]), "98", "ex98_demo", "ch98_demo") == ["no '## Challenge 98' section"]
    assert problems(v4.new_notebook(cells=good.cells[:2]), "98", "ex98_demo", None) == []
