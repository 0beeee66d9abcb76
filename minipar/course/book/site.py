"""The book's sources, made from the executed notebooks: one page a chapter, one a landing page,
one per exercise and challenge; then Sphinx with MyST-NB and the Sphinx Book Theme builds the site.

Why this tool: Sphinx, MyST-NB and the Sphinx Book Theme (the Executable Books project's stack,
Jupyter Book 1's engine) install from the package registry and build offline. Jupyter Book 2
(mystmd) fetches its site theme from a web service at build time, which a machine with no
access beyond the package registries cannot reach.

What a page gets that the notebook does not carry:
* plotly figures as HTML that draws itself (hover, zoom) with one shared copy of plotly.js;
* a line under the title: the chapter's place (previous, next), its exercise and challenge,
  and the same notebook on Colab;
* equations rendered by a local MathJax (``npm install mathjax@3``, done by the build).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from .. import chapters, colab, exercise_files
from .picture import chapter_map_svg

ROOT = chapters.ROOT
NODE = ROOT / "build" / "node"
MATHJAX = NODE / "node_modules" / "mathjax" / "es5" / "tex-svg-full.js"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="117" height="20" role="img" aria-label="Open in Colab">'
             '<rect width="117" height="20" rx="3" fill="#555"/><rect x="24" width="93" height="20" rx="3" fill="#f9ab00"/>'
             '<circle cx="12" cy="10" r="5" fill="none" stroke="#f9ab00" stroke-width="3"/>'
             '<text x="70" y="14" fill="#fff" font-family="Verdana,sans-serif" font-size="11" '
             'text-anchor="middle">Open in Colab</text></svg>\n')


def blob_url(path: str) -> str:
    return f"{colab.REPOSITORY}/blob/{colab.BRANCH}/{path}"


def _plotly_html(fig: dict, div_id: str) -> str:
    import plotly.io as pio
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"responsive": True, "displaylogo": False})


def figures_to_html(nb, stem: str) -> int:
    """Give every plotly output an HTML form that draws itself; returns how many there are."""
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                fig = data[PLOTLY_MIME]
                fig = json.loads(fig) if isinstance(fig, str) else fig
                data["text/html"] = _plotly_html(fig, f"fig-{stem}-{n}")
                del data[PLOTLY_MIME]
                n += 1
    return n


WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def drop_widget_views(nb) -> int:
    """Live widget views need a kernel (and the widget manager from a CDN): a page keeps what
    else the output carried (its text form) and drops the rest; returns how many were dropped."""
    n = 0
    for cell in nb.cells:
        kept = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_MIME in data:
                del data[WIDGET_MIME]
                n += 1
                if not data:
                    continue
            kept.append(out)
        if "outputs" in cell:
            cell["outputs"] = kept
    nb.metadata.pop("widgets", None)
    return n


def nav_line(i: int) -> str:
    """Markdown under a chapter's title: its place, its exercise and challenge, Colab."""
    ch, parts = chapters.CHAPTERS[i], []
    parts.append(f"**Chapter {ch.number} of {chapters.CHAPTERS[-1].number}**")
    if i > 0:
        prev = chapters.CHAPTERS[i - 1]
        parts.append(f"← [{prev.number} · {prev.title}]({prev.notebook})")
    if i + 1 < len(chapters.CHAPTERS):
        nxt = chapters.CHAPTERS[i + 1]
        parts.append(f"[{nxt.number} · {nxt.title}]({nxt.notebook}) →")
    if ch.exercise:
        parts.append(f"exercise: [{ch.exercise[:4]}](../exercises/{ch.exercise}.md)")
        if (ROOT / "exercises" / "challenges" / f"{ch.challenge}.py").exists():
            parts.append(f"challenge: [{ch.challenge[:4]}](../exercises/{ch.challenge}.md)")
    parts.append(f"[open in Colab]({colab.colab_url(ch.notebook)})")
    return " · ".join(parts)


def chapter_page(executed: Path, i: int, out: Path) -> int:
    """The executed notebook as a page; returns its number of figures."""
    import nbformat
    ch = chapters.CHAPTERS[i]
    nb = nbformat.read(executed / ch.notebook, as_version=4)
    n = figures_to_html(nb, ch.number)
    drop_widget_views(nb)
    # the book carries no outside resource: the Colab badge is drawn by the book itself
    nb.cells[0].source = nb.cells[0].source.replace(BADGE_IMAGE, "../_static/colab-badge.svg")
    setup = next(c for c in nb.cells if c.cell_type == "code")
    setup.metadata.setdefault("tags", []).append("hide-input")   # what it printed stays visible
    nb.cells.insert(1, nbformat.v4.new_markdown_cell(nav_line(i)))
    nb.metadata.setdefault("minipar", {})["figures"] = n
    nbformat.write(nb, out / "notebooks" / ch.notebook)
    return n


def _module_doc(text: str) -> str:
    import ast
    return ast.get_docstring(ast.parse(text)) or ""


def exercise_pages(out: Path) -> None:
    """A page per exercise and challenge: its statement, its file, how to grade it."""
    (out / "exercises").mkdir(parents=True, exist_ok=True)
    for ch in chapters.CHAPTERS:
        if not ch.exercise:
            continue
        for name, folder, kind in ((ch.exercise, "exercises", "exercise"),
                                   (ch.challenge, "exercises/challenges", "challenge")):
            src = ROOT / folder / f"{name}.py"
            if not src.exists():
                continue
            body = textwrap.dedent(f"""\
                # {name[:4]} · {ch.title} ({kind})

                Chapter: [{ch.number} · {ch.title}](../notebooks/{ch.notebook}) ·
                the file to edit: [`{folder}/{name}.py`]({blob_url(f"{folder}/{name}.py")})

                Grade it from a clone: `python -m minipar.grade {ch.exercise[:4]}`, or
                `minipar.grade("{ch.exercise[:4]}")` in a notebook; ask for a hint, one tier at a
                time, with `minipar.hint("{ch.exercise[:4]}")`.

                ## The task

                """)
            # the stub as the course ships it, never the learner's own file (a solved workspace
            # must not put its answers into the book); without a pristine copy, the statement only
            stub = exercise_files.stub_text(name[:4])
            doc = _module_doc(stub if stub is not None else src.read_text())
            fence = "````"
            shown = f"\n\n## The file\n\n{fence}python\n{stub}{fence}\n" if stub is not None else "\n"
            (out / "exercises" / f"{name}.md").write_text(body + f"{fence}text\n{doc}\n{fence}" + shown)


def landing_page(out: Path, figures: dict[str, int]) -> None:
    (out / "_static").mkdir(parents=True, exist_ok=True)
    (out / "_static" / "chapter_map.svg").write_text(chapter_map_svg())
    (out / "_static" / "colab-badge.svg").write_text(BADGE_SVG)
    (out / "_static" / "favicon.svg").write_text(   # four ranks, one ring
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32"><circle cx="16" cy="16" r="11" fill="none" '
        'stroke="#2563eb" stroke-width="3"/>' + "".join(f'<circle cx="{x}" cy="{y}" r="4.5" fill="#d97706"/>'
                                                          for x, y in ((16, 5), (27, 16), (16, 27), (5, 16))) + "</svg>\n")
    rows = "\n".join(f"| [{c.number} · {c.title}](notebooks/{c.notebook}) | {c.learn} | "
                     f"{figures.get(c.notebook, 0)} |" for c in chapters.CHAPTERS)
    text = f"""\
# minipar: distributed training, built from scratch and run for real

A hands-on course in how large neural networks are trained across many devices. Every
chapter explains one idea, **runs it on several processes**, and shows what happened: per-rank
timelines, memory per rank, losses beside a single-process run, theory beside measurement.
Every figure in this book comes from a real run of the course's own library, `minipar`,
executed when the book was built. Each page opens as a notebook on Colab, to run and change.

## What you will learn
To explain, implement and choose between **data, pipeline, tensor, context and expert
parallelism, ZeRO**, and their combinations on a process mesh; to predict memory and step
time of a layout for a real model on a real cluster; and to make every one of them train
**exactly like one process**: same losses, same final weights.

## The chapters

```{{image}} _static/chapter_map.svg
:alt: the chapters in order, from launching ranks to real hardware
:width: 100%
```

| chapter | you learn | figures |
|---|---|---|
{rows}

Each chapter from 01 to 10 has a graded **exercise** (one of the library's own functions,
with its body left to you) and a **challenge** graded by measurement.

## How to run it
* **On your machine** (Python 3.10 or newer, no GPU needed: the ranks are CPU processes):
  `git clone {colab.REPOSITORY} && cd minipar && python3 course.py lab` sets up `.venv` and
  opens notebook 00; `python3 course.py test` runs the tests.
* **On Colab or Kaggle**: the *open in Colab* link at the top of each page. The first cell
  installs the course and keeps the runtime's torch; with one or two GPUs the ranks share them.
  On Kaggle, turn on the internet and choose the GPU T4 ×2 accelerator in the settings first.
* **On a cluster**: the same code runs under `torchrun` and Slurm (chapter 11):
  `torchrun --nproc_per_node 8 -m minipar.train --dp 2 --pp 2 --tp 2`.

```{{toctree}}
:hidden:
:caption: Chapters
{chr(10).join("notebooks/" + c.notebook for c in chapters.CHAPTERS)}
```

```{{toctree}}
:hidden:
:caption: Exercises
:glob:
exercises/*
```
"""
    (out / "index.md").write_text(text)


def conf(out: Path) -> None:
    (out / "conf.py").write_text(f"""\
project = "minipar"
author = "the minipar authors"
extensions = ["myst_nb"]
html_theme = "sphinx_book_theme"
html_title = "minipar"
html_favicon = "_static/favicon.svg"
nb_execution_mode = "off"                 # the notebooks come executed
nb_output_stderr = "remove"
myst_enable_extensions = ["dollarmath", "amsmath"]
html_static_path = ["_static"]
html_js_files = ["plotly.min.js"]
mathjax_path = "mathjax/tex-svg-full.js"
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]
html_context = {{"default_mode": "light"}}
exclude_patterns = ["_build"]
html_theme_options = {{
    "repository_url": "{colab.REPOSITORY}",
    "repository_branch": "{colab.BRANCH}",
    "path_to_docs": "",
    "use_repository_button": True,
    "launch_buttons": {{"colab_url": "https://colab.research.google.com"}},
    "show_navbar_depth": 1,
}}
""")


def static_assets(out: Path) -> None:
    """plotly.js once for the whole site, and MathJax from the npm registry."""
    import plotly
    static = out / "_static"
    (static / "mathjax").mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", static / "plotly.min.js")
    if not MATHJAX.exists():
        NODE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(NODE),
                        "mathjax@3"], check=True)
    shutil.copy(MATHJAX, static / "mathjax" / MATHJAX.name)


def sources(executed: Path, out: Path) -> dict[str, int]:
    """Write the book's sources into ``out``; return the number of figures of each chapter."""
    if out.exists():
        shutil.rmtree(out)
    (out / "notebooks").mkdir(parents=True)
    figures = {c.notebook: chapter_page(executed, i, out) for i, c in enumerate(chapters.CHAPTERS)}
    exercise_pages(out)
    landing_page(out, figures)
    conf(out)
    static_assets(out)
    (out / "figures.json").write_text(json.dumps(figures, indent=1))
    return figures


def build(src: Path, html: Path) -> None:
    """Sphinx, warnings as errors: a broken reference or a page left out fails the build."""
    if html.exists():
        shutil.rmtree(html)
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
                    str(src), str(html)], check=True)
    shutil.copy(src / "figures.json", html / "figures.json")
