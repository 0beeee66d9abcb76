"""The course on Colab and Kaggle: the repository's address, named here once, and what every
notebook's first cells carry because of it.

* :data:`REPOSITORY` is where the course lives: the setup cell clones it (``MINIPAR_REPO``
  overrides it, e.g. for a fork) and the "Open in Colab" links point into it.
* :func:`setup_cell` is every notebook's first code cell, verbatim: where minipar is installed
  it only says what it found; on Colab or Kaggle it installs the course without its
  dependencies, then only those of :data:`RUNTIME_NEEDS` the runtime lacks: its own torch (a
  CUDA build matched to its driver), ipywidgets (matched to its frontend) and pytest stay.
* :func:`badge` is the "Open in Colab" link a notebook's first (markdown) cell starts with;
  ``tests/test_colab.py`` checks every notebook against these.
"""
from __future__ import annotations

REPOSITORY = "https://github.com/minipar/minipar"
BRANCH = "main"

# what the notebooks import beyond torch: pyproject's dependencies less torch and jupyterlab (a
# hosted runtime is its own notebook server); the setup cell installs only those it lacks, so
# Colab's own ipywidgets, pytest, numpy and torch are never replaced
RUNTIME_NEEDS = ("numpy", "plotly", "cloudpickle", "tqdm", "ipywidgets", "pytest")

SETUP_CELL = '''\
# Setup. On Colab or Kaggle this installs the course, and of what it needs only what the
# runtime lacks (its torch and the rest stay); on your machine it does nothing. Then it says
# what it found.
import importlib.util, os, subprocess, sys
if importlib.util.find_spec("minipar") is None:
    REPO = os.environ.get("MINIPAR_REPO", "{repo}")  # or your fork
    subprocess.run(["git", "clone", "-q", "--depth", "1", REPO, "minipar-course"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", "minipar-course"],
                   check=True)
    needs = {needs!r}  # beyond torch
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)
    sys.path.insert(0, os.path.abspath("minipar-course"))
import minipar
print(minipar.runtime.backend.summary())'''


def setup_cell(repository: str = REPOSITORY) -> str:
    """The first code cell of every notebook."""
    return SETUP_CELL.format(repo=repository, needs=list(RUNTIME_NEEDS))


def colab_url(notebook: str, repository: str = REPOSITORY, branch: str = BRANCH) -> str:
    """Colab's address for ``notebooks/<notebook>`` in the repository (GitHub only)."""
    path = repository.removeprefix("https://github.com/").rstrip("/")
    return f"https://colab.research.google.com/github/{path}/blob/{branch}/notebooks/{notebook}"


def badge(notebook: str, repository: str = REPOSITORY) -> str:
    """The markdown "Open in Colab" badge linking to ``notebook``."""
    return (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"({colab_url(notebook, repository)})")
