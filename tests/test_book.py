"""The web book's pieces and the one list of chapters (the build itself is CI's book step)."""
import json

import nbformat
import plotly.graph_objects as go
import pytest

from minipar.course import chapters
from minipar.course.book import check, site
from minipar.course.book.execute import fresh, source_hash


def test_readme_and_notebook_00_tables_come_from_the_one_list():
    stale = [p.name for p, text in chapters.expected_files().items() if p.read_text() != text]
    assert not stale, f"{stale} differ from minipar.course.chapters.CHAPTERS: python -m minipar.course.chapters --write"
    names = sorted(p.name for p in (chapters.ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [c.notebook for c in chapters.CHAPTERS] == names, "every notebook is a chapter, in order"
    for c in chapters.CHAPTERS:
        if c.exercise:
            assert (chapters.ROOT / "exercises" / f"{c.exercise}.py").exists(), c.exercise
    table = chapters.notebook_table()
    assert "| 11 | real hardware" in table and "| 09 | expert parallelism" in table


def test_minutes_are_measured_not_typed(tmp_path, monkeypatch):
    monkeypatch.setattr(chapters, "MINUTES", tmp_path / "minutes.json")
    nb = nbformat.v4.new_notebook()
    nb.metadata["minipar"] = {"seconds": 90.0}
    nbformat.write(nb, tmp_path / "03_model_parallel.ipynb")
    assert chapters.record_minutes(tmp_path) == {"03_model_parallel.ipynb": 1.5}
    assert "| `03_model_parallel` |" in chapters.readme_table() and "| 1.5 |" in chapters.readme_table()


def test_plotly_outputs_become_html_that_draws_itself():
    fig = go.Figure(go.Bar(y=[1, 2]))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("fig", outputs=[nbformat.v4.new_output(
        "display_data", data={site.PLOTLY_MIME: json.loads(fig.to_json())})])]
    assert site.figures_to_html(nb, "04") == 1
    html = nb.cells[0].outputs[0]["data"]["text/html"]
    assert 'id="fig-04-0"' in html and "Plotly.newPlot" in html and site.PLOTLY_MIME not in nb.cells[0].outputs[0]["data"]
    assert "plotly.js v" not in html  # the library is loaded once per page, not per figure


def test_every_chapter_knows_its_neighbours_exercise_and_colab():
    first, middle, last = site.nav_line(0), site.nav_line(4), site.nav_line(len(chapters.CHAPTERS) - 1)
    assert "←" not in first and "01_collectives.ipynb" in first
    assert "03_model_parallel.ipynb" in middle and "05_tensor_parallel.ipynb" in middle
    assert "../exercises/ex04_pipeline.md" in middle and "colab.research.google.com" in middle
    assert "→" not in last and "../exercises/ex12_adaptive.md" in last


def test_dead_internal_links_are_found(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html#there">b</a> <a href="https://x.org/y">out</a>'
                                     '<img src="_static/missing.png">')
    (tmp_path / "b.html").write_text('<h1 id="here">b</h1>')
    assert check.dead_links(tmp_path) == ["a.html: b.html#there (no such anchor)", "a.html: _static/missing.png"]


def test_an_executed_copy_is_fresh_only_for_the_source_it_came_from(tmp_path):
    src = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), src)
    out = tmp_path / "executed"
    out.mkdir()
    assert not fresh(src, out)
    copy = nbformat.v4.new_notebook()
    copy.metadata["minipar"] = {"source_sha256": source_hash(src)}
    nbformat.write(copy, out / "nb.ipynb")
    assert fresh(src, out)
    src.write_text(src.read_text().replace("}", " }", 1))
    assert not fresh(src, out)


@pytest.mark.parametrize("chapter", [c for c in chapters.CHAPTERS if c.exercise], ids=lambda c: c.number)
def test_exercise_pages_carry_the_statement_and_the_file(chapter, tmp_path):
    site.exercise_pages(tmp_path)
    page = (tmp_path / "exercises" / f"{chapter.exercise}.md").read_text()
    assert f"python -m minipar.grade {chapter.exercise[:4]}" in page and "raise NotImplementedError" in page


def test_widget_views_leave_the_page_but_their_text_stays():
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"state": {}}
    nb.cells = [nbformat.v4.new_code_cell("w", outputs=[
        nbformat.v4.new_output("display_data", data={site.WIDGET_MIME: {"model_id": "x"}, "text/plain": "Tab()"}),
        nbformat.v4.new_output("display_data", data={site.WIDGET_MIME: {"model_id": "y"}})])]
    assert site.drop_widget_views(nb) == 2
    assert [o["data"] for o in nb.cells[0].outputs] == [{"text/plain": "Tab()"}] and "widgets" not in nb.metadata


def test_the_chapter_map_colours_every_chapter_once():
    """The landing page's map (minipar.course.book.picture): every chapter of CHAPTERS in
    exactly one colour group, so the book's build cannot stop on a new chapter."""
    from minipar.course.book import picture
    numbers = [ch.number for ch in chapters.CHAPTERS]
    grouped = [n for _, _, nums in picture.GROUPS for n in nums.split()]
    assert sorted(grouped) == sorted(numbers), (grouped, numbers)
    svg = picture.chapter_map_svg()
    assert svg.count("<rect") >= len(numbers)
