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
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the ranks compute: cuda puts each rank on a GPU (NCCL with one GPU "
                        "per rank), PyTorch's baseline on the same GPUs; times then synchronize")
    return p


def here():
    """This rank's device (:func:`minipar.device`)."""
    from ..backend import device
    return device()


def to_here(obj):
    """``obj`` (module, tensor, batches) on this rank's device."""
    from ..strategy import to_device
    return to_device(obj, here())


def clock() -> float:
    """``time.perf_counter()`` after the GPU finished what was queued (a plain read on CPU):
    CUDA kernels and NCCL return before their work is done."""
    from ..gpu import synchronize
    synchronize()
    return time.perf_counter()


def interleaved(fns: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Call each function in turn, ``repeats`` rounds (after ``warmup``); seconds per call.

    Alternating A, B, A, B... means a slow spell of the machine hits both equally.
    """
    times = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for k, fn in fns.items():
            t = clock()
            fn()
            if i >= warmup:
                times[k].append(clock() - t)
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
