"""Shared benchmark helpers: argument parsing, interleaved timing, tables, JSON output."""
from __future__ import annotations

import argparse
import json
import statistics
import time


def parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m minipar.bench {name}", description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, finishes in under a minute")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def interleaved(fns: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Call each function in turn, ``repeats`` rounds (after ``warmup``); seconds per call.

    Alternating A, B, A, B... means a slow spell of the machine hits both equally.
    """
    times = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            if i >= warmup:
                times[k].append(time.perf_counter() - t)
    return times


def median(xs) -> float:
    return statistics.median(xs)


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain text table (numbers formatted to 3 significant digits)."""
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def report(result: dict, args, columns: list[str]) -> dict:
    """Print ``result`` as JSON (``--json``) or as a table of ``result["rows"]`` plus the ratio."""
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result["rows"], columns))
        print(f"\nratio (minipar / {result['baseline']}): {result['ratio']:.3f}  (lower is better)")
    return result
