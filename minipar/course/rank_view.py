"""How a ``%%ranks`` cell's output looks: one column per rank, in plain HTML.

A cell ran on every rank; each rank printed something and may have ended on a value. They are
shown side by side, labelled by rank, four columns to a row, in a table with inline styles and
nothing else: no script and no widget, so the output reads the same in JupyterLab, Colab,
``nbconvert`` and the web book (MyST-NB keeps ``text/html`` as it is). A ``text/plain`` copy,
each line prefixed with its rank as ``launch`` prints it, goes with it for terminals.
"""
from __future__ import annotations

import html

COLUMNS = 4          # ranks per row of the table
MUTED, BAD, WARN = "#7a7a7a", "#c62828", "#b26a00"
_PRE = ("margin:0;padding:0;white-space:pre-wrap;word-break:break-word;background:transparent;border:none;"
        "font-family:var(--jp-code-font-family,ui-monospace,SFMono-Regular,Menlo,Consolas,monospace);"
        "font-size:var(--jp-code-font-size,0.85em);line-height:1.35;text-align:left")


def _pre(text: str, color: str | None = None) -> str:
    style = _PRE + (f";color:{color}" if color else "")
    return f'<pre style="{style}">{html.escape(text.rstrip())}</pre>'


def column(reply: dict | None, status: str = "", figure_from: int | None = None, rank: int = 0) -> str:
    """The HTML of one rank's cell: what it printed, its value, its error or where it was stopped."""
    parts = []
    if reply is not None and reply.get("out", "").strip():
        parts.append(_pre(reply["out"]))
    if reply is not None and reply.get("value") is not None:
        parts.append(f'<div style="color:{MUTED};font-size:0.75em;margin-top:0.2em">value</div>'
                     + _pre(reply["value"]))
    if reply is not None and reply.get("figure") is not None:
        drawn = "drawn below" if figure_from == rank else f"rank {figure_from}'s is drawn below"
        parts.append(_pre(f"[a figure: {drawn}]", MUTED))
    if reply is not None and reply.get("error"):
        line = f" (cell line {reply['line']})" if reply.get("line") else ""
        parts.append(_pre(f"✗ {'died: ' if reply.get('died') else ''}{reply['exc']}{line}", BAD))
    if status:
        parts.append(_pre(status, WARN))
    return "".join(parts) or _pre("(no output)", MUTED)


def to_html(columns: dict[int, str], header: str = "") -> str:
    """``columns``: rank -> its column's HTML, laid out four ranks to a row."""
    ranks = sorted(columns)
    th = ("text-align:left;padding:0.15em 0.6em;border:none;border-bottom:2px solid #8a8a8a;"
          "font-weight:600;font-size:0.85em;background:transparent")
    td = ("vertical-align:top;text-align:left;padding:0.3em 0.6em;border:none;"
          "border-left:1px solid rgba(128,128,128,0.35);background:transparent")
    out = ['<div class="minipar-ranks" style="margin:0.2em 0">']
    if header:
        out.append(f'<div style="color:{MUTED};font-size:0.85em;margin-bottom:0.3em">{html.escape(header)}</div>')
    for i in range(0, len(ranks), COLUMNS):
        row = ranks[i:i + COLUMNS]
        width = f"{100 * len(row) / min(COLUMNS, len(ranks)):.0f}%"
        out.append(f'<table style="border-collapse:collapse;table-layout:fixed;width:{width};'
                   f'margin:0 0 0.4em 0;border:none">')
        out.append("<thead><tr>" + "".join(f'<th style="{th}">rank {r}</th>' for r in row) + "</tr></thead>")
        out.append("<tbody><tr>" + "".join(f'<td style="{td}">{columns[r]}</td>' for r in row)
                   + "</tr></tbody></table>")
    out.append("</div>")
    return "".join(out)


def to_text(replies: dict[int, dict | None], statuses: dict[int, str], header: str = "") -> str:
    """The same, as text: every line prefixed with ``[rank r]``."""
    lines = [header] if header else []
    for r in sorted(replies):
        reply, body = replies[r] or {}, []
        body += (reply.get("out") or "").rstrip().splitlines()
        if reply.get("value") is not None:
            body += reply["value"].splitlines()
        if reply.get("figure") is not None:
            body.append("[a figure]")
        if reply.get("error"):
            body.append(f"✗ {reply['exc']}" + (f" (cell line {reply['line']})" if reply.get("line") else ""))
        if statuses.get(r):
            body.append(statuses[r])
        lines += [f"[rank {r}] {line}" for line in body]
    return "\n".join(lines)
