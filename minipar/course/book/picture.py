"""The landing page's chapter map: the chapters as a path, coloured by what they split."""
from __future__ import annotations

from html import escape

from .. import chapters

# what each chapter splits, for its colour (the legend under the map)
GROUPS = [("the machinery", "#6b7280", "00 01"), ("the batch", "#2563eb", "02"),
          ("the layers", "#059669", "03 04"), ("each layer", "#d97706", "05"),
          ("the training state", "#7c3aed", "06"), ("all of them", "#dc2626", "07 10 11 12"),
          ("the sequence and the experts", "#0891b2", "08 09")]


def _colour(number: str) -> str:
    found = [c for _, c, nums in GROUPS if number in nums.split()]
    if not found:
        raise ValueError(f"chapter {number} is in no group of minipar.course.book.picture.GROUPS: add it to one")
    return found[0]


def chapter_map_svg(per_row: int = 4, w: int = 210, h: int = 64, gap: int = 34) -> str:
    """An SVG of the chapters in reading order, a snake of rows, with a legend."""
    chs, parts = chapters.CHAPTERS, []
    rows = (len(chs) + per_row - 1) // per_row
    width, height = per_row * (w + gap) + gap, rows * (h + gap) + gap + 40
    pos = []
    for i, _ in enumerate(chs):
        r, c = divmod(i, per_row)
        c = c if r % 2 == 0 else per_row - 1 - c   # a snake: every other row runs right to left
        pos.append((gap + c * (w + gap), gap + r * (h + gap)))
    for (x0, y0), (x1, y1) in zip(pos, pos[1:]):
        if y0 == y1:
            a, b = (x0 + w, x1) if x1 > x0 else (x0, x1 + w)
            parts.append(f'<line x1="{a}" y1="{y0 + h / 2}" x2="{b}" y2="{y1 + h / 2}" class="arrow"/>')
        else:
            parts.append(f'<line x1="{x0 + w / 2}" y1="{y0 + h}" x2="{x1 + w / 2}" y2="{y1}" class="arrow"/>')
    for ch, (x, y) in zip(chs, pos):
        parts.append(f'<a href="notebooks/{ch.notebook[:-6]}.html"><rect x="{x}" y="{y}" width="{w}" height="{h}" '
                     f'rx="10" fill="{_colour(ch.number)}"/>'
                     f'<text x="{x + 14}" y="{y + 27}" class="num">{ch.number}</text>'
                     f'<text x="{x + 48}" y="{y + 27}" class="title">{escape(ch.title)}</text>'
                     f'<text x="{x + 48}" y="{y + 47}" class="sub">{"exercise + challenge" if ch.exercise else ""}'
                     f'</text></a>')
    x = gap
    for name, colour, _ in GROUPS:
        parts.append(f'<rect x="{x}" y="{height - 30}" width="14" height="14" rx="3" fill="{colour}"/>'
                     f'<text x="{x + 20}" y="{height - 18}" class="legend">{escape(name)}</text>')
        x += 30 + 7.2 * len(name)
    style = ("<style>.num{font:700 20px sans-serif;fill:#fff}.title{font:600 15px sans-serif;fill:#fff}"
             ".sub{font:12px sans-serif;fill:#f3f4f6}.legend{font:12px sans-serif;fill:#374151}"
             ".arrow{stroke:#9ca3af;stroke-width:3;marker-end:url(#head)}</style>")
    defs = ('<defs><marker id="head" markerWidth="8" markerHeight="8" refX="6" refY="4" orient="auto">'
            '<path d="M0,0 L8,4 L0,8 z" fill="#9ca3af"/></marker></defs>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" role="img" aria-label="the chapters of the course">{style}{defs}'
            + "".join(parts) + "</svg>\n")
