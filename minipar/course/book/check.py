"""Check the built book as a reader meets it: no dead internal link, every figure there, and,
in a real browser (headless Chromium driven by Playwright), every plotly figure drawn and no
error in the console. Screenshots of three chapters go to ``html/_screenshots/``."""
from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
SCREENSHOTS = ("01_collectives", "04_pipeline_parallel", "08_context_parallel")


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        for key in ("href", "src"):
            if a.get(key):
                self.links.append(a[key])


def dead_links(html: Path) -> list[str]:
    """Every internal href/src of every page that names a missing file or anchor."""
    pages = {p: _Links() for p in html.rglob("*.html") if not p.relative_to(html).parts[0].startswith("_")}
    for p, parser in pages.items():
        parser.feed(p.read_text(errors="replace"))
    dead = []
    for page, parser in pages.items():
        for link in parser.links:
            url = urlsplit(link)
            if url.scheme or link.startswith(("//", "mailto:", "javascript:", "data:")):
                continue
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                dead.append(f"{page.relative_to(html)}: {link}")
            elif url.fragment and target.suffix == ".html" and target in pages \
                    and url.fragment not in pages[target].ids:
                dead.append(f"{page.relative_to(html)}: {link} (no such anchor)")
    return dead


def missing_figures(html: Path) -> list[str]:
    """Chapters whose page holds fewer plotly figures than their executed notebook drew."""
    want = json.loads((html / "figures.json").read_text())
    out = []
    for nb, n in want.items():
        page = html / "notebooks" / f"{nb[:-6]}.html"
        got = len(re.findall(r'class="plotly-graph-div"', page.read_text())) if page.exists() else -1
        if got != n:
            out.append(f"{page.name}: {got} figures on the page, {n} in the executed notebook")
    return out


def _serve(root: Path):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    handler = functools.partial(Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def browser(html: Path, screenshots: tuple[str, ...] = SCREENSHOTS) -> dict:
    """Open every page in headless Chromium; returns ``{"pages", "figures", "problems", "screenshots"}``."""
    from playwright.sync_api import sync_playwright
    exe = next((c for c in CHROMIUM if Path(c).exists()), None) or shutil.which("chromium")
    if exe is None:
        raise RuntimeError("no Chromium found (Debian: apt-get install chromium)")
    want = json.loads((html / "figures.json").read_text())
    shots = html / "_screenshots"
    shots.mkdir(exist_ok=True)
    server = _serve(html)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    problems, drawn, equations, pages = [], 0, 0, sorted(p.relative_to(html).as_posix() for p in html.rglob("*.html")
                                            if not p.name.startswith(("genindex", "search"))
                                            and not p.relative_to(html).parts[0].startswith("_"))
    try:
        with sync_playwright() as pw:
            chromium = pw.chromium.launch(executable_path=exe, headless=True, args=FLAGS)
            page = chromium.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.on("requestfailed", lambda r: None if "ERR_ABORTED" in (r.failure or "")  # left the page
                    else errors.append(f"failed {r.url}: {r.failure}"))
            for rel in pages:
                errors.clear()
                page.goto(f"{base}/{rel}", wait_until="load")
                stem = Path(rel).stem
                n = want.get(f"{stem}.ipynb", 0) if rel.startswith("notebooks/") else 0
                if n:
                    page.wait_for_function(
                        f"document.querySelectorAll('.plotly-graph-div .main-svg').length >= {n}", timeout=60_000)
                    empty = page.evaluate("""() => [...document.querySelectorAll('.plotly-graph-div')]
                        .filter(d => !d.querySelector('.main-svg') || d.getBoundingClientRect().height < 50).length""")
                    if empty:
                        problems.append(f"{rel}: {empty} of {n} figures not drawn")
                    drawn += n - empty
                maths = page.evaluate("document.querySelectorAll('.math').length")
                if maths:  # MathJax typesets every equation, offline, from the book's own copy
                    page.wait_for_function(f"document.querySelectorAll('mjx-container').length >= {maths}",
                                           timeout=60_000)
                    equations += maths
                if errors:
                    problems.append(f"{rel}: console errors: {errors[:3]}")
                if stem in screenshots:   # the first figure, as a reader scrolls to it
                    page.evaluate("document.querySelector('.plotly-graph-div')?.scrollIntoView({block: 'center'})")
                    page.wait_for_timeout(500)
                    page.screenshot(path=str(shots / f"{stem}.png"), full_page=False)
            chromium.close()
    finally:
        server.shutdown()
    return {"pages": len(pages), "figures": drawn, "equations": equations, "problems": problems,
            "screenshots": sorted(str(p) for p in shots.glob("*.png"))}
