"""Shared benchmark helpers: argument parsing, interleaved timing, tables, JSON output.

Every benchmark's rows speak one vocabulary (:func:`row`): ``minipar ms/step`` (minipar's time of
the benchmark's timed unit, its "step"), ``baseline ms/step`` (the same unit done by the result's
``baseline``, named in the result) and ``ratio`` (minipar / baseline, lower is better), beside the
columns that say what the row is. Three sizes: the default, ``--quick`` (under a minute) and
``--smoke`` (the smallest that runs every code path once: one repeat, times that mean nothing;
what ``tests/test_bench.py`` runs)."""
from __future__ import annotations

import argparse
import json
import time
from statistics import median  # noqa: F401 - the benchmarks import it from here

import torch
import torch.distributed as dist

from ..runtime import backend   # backend.gpu_count: looked up when called (tests replace it)
from ..runtime.backend import device as here  # this rank's device (minipar.device())
from ..runtime.gpu import synchronize
from ..strategy import to_device


def parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m minipar.bench {name}", description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, finishes in under a minute")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest sizes and one repeat: checks that the benchmark runs, its times mean nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the ranks compute: cuda puts each rank on a GPU (NCCL with one GPU "
                        "per rank; with fewer GPUs the ranks share them over Gloo where the benchmark "
                        "can), PyTorch's baseline in the same placement; times then synchronize")
    return p


MINIPAR, BASELINE, RATIO = "minipar ms/step", "baseline ms/step", "ratio"


def row(minipar: float, baseline: float, **columns) -> dict:
    """One row of a benchmark's table: ``columns`` (what the row is), then minipar's and the
    baseline's milliseconds per step from seconds, and their ``ratio``."""
    return {**columns, MINIPAR: 1e3 * minipar, BASELINE: 1e3 * baseline, RATIO: minipar / baseline}


def size(args, full, quick, smoke):
    """The value of one size for the run's tier: ``--smoke``, ``--quick`` or the default."""
    return smoke if args.smoke else quick if args.quick else full


SHARED = ("{n} ranks share {g} GPU(s): compute on the GPU, messages over Gloo through host memory, "
          "minipar's and the baseline's alike")


def decide(device: str, ranks: int, shares: str | None = None, needs: str | None = None,
           gpus: int | None = None):
    """Where a benchmark's ``ranks`` run for ``--device``: ``(placement, note)``, or ``(None, why
    not)``. ``--device cuda`` with a GPU per rank is NCCL; with fewer GPUs the ranks share them
    over Gloo (:func:`minipar.runtime.backend.place`) when the benchmark can (``shares``: what
    its ratio means there, both sides in that placement), else it is refused, saying what it
    ``needs``. ``gpus``: a simulated count (this machine's by default)."""
    try:
        p = backend.place(ranks, device, gpus=gpus)
    except backend.BackendError as e:
        return None, f"--device {device}: {e}"
    if not p.shared:
        return p, ""
    if needs is not None:
        return None, (f"--device cuda with {ranks} ranks on {p.gpus} GPU(s): {needs}; it needs one GPU "
                      f"per rank (NCCL): {ranks} ranks need {ranks} GPUs. Use fewer ranks (--ranks) "
                      f"where the benchmark takes them, or --device cpu.")
    return p, SHARED.format(n=ranks, g=p.gpus) + (f": {shares}" if shares else "")


_note = {"placement": ""}   # this run's placement note, for :func:`report`


def placement(ap: argparse.ArgumentParser, device: str, ranks: int, shares: str | None = None,
              needs: str | None = None):
    """:func:`decide` for this machine, before any process starts: a refusal is a plain error
    (exit code 2, one line); the placement's note goes into the report (its first line, and
    ``"placement"`` in ``--json``'s object)."""
    p, note = decide(device, ranks, shares, needs)
    if p is None:
        ap.error(note)
    _note["placement"] = note
    return p, note


def to_here(obj):
    """``obj`` (module, tensor, batches) on this rank's device."""
    return to_device(obj, here())


def clock() -> float:
    """``time.perf_counter()`` after the GPU finished what was queued (a plain read on CPU):
    CUDA kernels and NCCL return before their work is done."""
    synchronize()
    return time.perf_counter()


def interleaved(fns: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Call each function in turn, ``repeats`` rounds (after ``warmup``); seconds per call.
    Alternating A, B, A, B... means a slow spell of the machine hits both equally."""
    times = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for k, fn in fns.items():
            t = clock()
            fn()
            if i >= warmup:
                times[k].append(clock() - t)
    return times


def backward_step(fn, *inputs, module=None):
    """A function that runs one forward + backward of ``fn`` on fresh leaf copies of ``inputs``
    (clearing ``module``'s gradients first), the backward from the output's sum."""
    def run():
        if module is not None:
            module.zero_grad(set_to_none=True)
        fn(*(t.detach().requires_grad_() for t in inputs)).sum().backward()
    return run


def train_step(model, opt, x, y) -> None:
    """One optimizer step of ``model(x, y)``'s loss."""
    opt.zero_grad(set_to_none=True)
    model(x, y).backward()
    opt.step()


def step_blocks(trainers: dict, batches: list, repeats: int) -> dict[str, list[float]]:
    """Inside each rank: seconds per step of each ``(model, optimizer)`` in ``trainers``, timed
    in blocks of one :func:`train_step` per batch. Rounds alternate the order (A, B, B, A, ...)
    so a slow spell hits all; round 0 warms up; a block is as slow as the slowest rank."""
    def block(model, opt):
        dist.barrier()
        t = clock()
        for x, y in batches:
            train_step(model, opt, x, y)
        dt = torch.tensor([(clock() - t) / len(batches)], device=batches[0][0].device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return dt.item()

    order = list(trainers)
    times = {k: [] for k in order}
    for i in range(repeats + 1):
        for name in (order if i % 2 == 0 else order[::-1]):
            t = block(*trainers[name])
            if i:
                times[name].append(t)
    return times


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain text table (numbers formatted to 3 significant digits)."""
    cells = [[f"{v:.3g}" if isinstance(v := r.get(c, ""), float) else str(v) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [columns, ["-" * w for w in widths], *cells]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines)


def report(result: dict, args, columns: list[str] | None = None, intro=(), notes=()) -> dict:
    """Print ``result`` as JSON (``--json``) or as the lines ``intro``, a table of
    ``result["rows"]`` (``columns``, by default the first row's keys), the ratio and the lines ``notes``."""
    if _note["placement"]:
        result.setdefault("placement", _note["placement"])
        intro = [f"placement: {_note['placement']}", *intro]
    if args.json:
        print(json.dumps(result))
    else:
        print(*intro, table(result["rows"], columns or list(result["rows"][0])), sep="\n")
        print(f"\nratio (minipar / {result['baseline']}): {result['ratio']:.3f}  (lower is better)", *notes,
              sep="\n")
    return result
