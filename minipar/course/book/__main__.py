"""``python -m minipar.course.book``: execute what changed, build the site, check it in a browser.

    python -m minipar.course.book                 # build/book/html/index.html, then the checks
    python -m minipar.course.book --no-execute    # fail instead of executing a notebook whose copy is stale
    python -m minipar.course.book --no-browser    # links and figures only

The executed copies come from ``build/executed/`` (the notebook tests leave them there); a
notebook whose copy is missing or older than its source is executed first. Ends with one line:
pages, figures drawn, equations, size; exit 1 on any problem.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import chapters
from . import check, site
from .execute import EXECUTED, execute, fresh

BUILD = chapters.ROOT / "build" / "book"


def _size(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipar.course.book", description=__doc__.splitlines()[0])
    p.add_argument("--no-execute", action="store_true", help="never execute; a stale copy is an error")
    p.add_argument("--no-browser", action="store_true", help="skip the headless-Chromium check")
    a = p.parse_args(argv)
    t = time.perf_counter()
    notebooks = [chapters.ROOT / "notebooks" / c.notebook for c in chapters.CHAPTERS]
    stale = [nb for nb in notebooks if not fresh(nb)]
    if stale and a.no_execute:
        print("book: no fresh executed copy of " + ", ".join(nb.name for nb in stale))
        return 1
    for nb in stale:
        print(f"book: executing {nb.name}", flush=True)
        execute(nb)
    t_exec = time.perf_counter() - t
    figures = site.sources(EXECUTED, BUILD / "src")
    site.build(BUILD / "src", BUILD / "html")
    t_build = time.perf_counter() - t - t_exec
    problems = [f"dead link: {d}" for d in check.dead_links(BUILD / "html")]
    problems += [f"missing figure: {m}" for m in check.missing_figures(BUILD / "html")]
    summary = {"pages": "?", "figures": sum(figures.values()), "equations": "?"}
    if not a.no_browser:
        seen = check.browser(BUILD / "html")
        problems += seen["problems"]
        summary = seen
        for shot in seen["screenshots"]:
            print(f"book: screenshot {shot}")
    for line in problems:
        print(f"book: {line}")
    print(f"book: {BUILD / 'html' / 'index.html'}: {summary['pages']} pages, {summary['figures']} figures drawn, "
          f"{summary['equations']} equations, {_size(BUILD / 'html'):.1f} MiB; executed {len(stale)} notebooks "
          f"in {t_exec:.0f} s, built in {t_build:.0f} s; {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
