"""``python -m minipar.bench pipeline``: minipar's 1F1B and ZB-H1 against torch.distributed.pipelining's 1F1B.

The same GPT, cut at the same layers (balanced by parameter count), batch, micro-batches and
SGD step on p ranks of one launch: each repetition times one training step of minipar's
:class:`~minipar.pipeline.Pipeline` with 1F1B, one with ZB-H1 and one of PyTorch's
``Schedule1F1B`` over ``PipelineStage`` (alternating, a barrier before and after each), after
checking that the three compute the same loss. Reported: median step times, minipar 1F1B / torch,
ZB-H1 / 1F1B, and from a few more traced steps on rank 0 (medians over the micro-batches)
ZB-H1's B + W over 1F1B's fused B and ZB-H1's forward over 1F1B's.

:func:`split_backward` measures, in one process, what ZB-H1's split costs: the backward of
one micro-batch through the whole GPT, fused (``loss.backward()``) against B (the same
backward under :func:`~minipar.pipeline.deferred`: input gradients only) plus W
(:meth:`~minipar.pipeline.WeightGrads.apply`: ``dW = dYᵀ X`` for every linear layer).
"""
from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from functools import partial

import torch
import torch.distributed as dist

from .. import data
from ..runtime import trace
from ..runtime.launch import launch
from ..models import GPT, GPTConfig, lm_loss
from ..pipeline import Pipeline, WeightGrads, build_stages, deferred, layer_costs, make_schedule, partition
from ..model_parallel.partition import boundary_shapes
from .common import clock, here, placement, parser, report, row, size, to_here

# why it cannot run with its ranks sharing a GPU
NEEDS_GPU = ("PyTorch's pipelining baseline sends CUDA tensors point to point, and Gloo's send and recv move "
             "host memory only")

SCHEDULES = ("1f1b", "zb-h1")


def split_backward(cfg: GPTConfig, micro_batch: int, repeats: int) -> dict:
    """Median seconds of a fused backward, of B and of W (one micro-batch of the GPT), and
    ``ratio``: the median over rounds of ``(B + W) / fused`` (each round times both, back to
    back, so a slow spell of the machine hits both); ``forward_ratio`` likewise for the
    forward under :func:`~minipar.pipeline.deferred` against a plain one. On the CPU the
    times are this process's CPU time (``time.process_time``), which other processes
    sharing the machine do not inflate (one thread); on a GPU, synchronized wall-clock time."""
    model = to_here(GPT(cfg, seed=0))
    clock_ = clock if here().type == "cuda" else time.process_time
    x, y = to_here(data.get_batch(data.corpus_tokens()[0], micro_batch, cfg.block_size, step=0))
    times = {"fused": [], "B": [], "W": [], "F": [], "F deferred": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                     # one thread, as every rank computes
    for k in range(repeats + 1):                 # round 0 warms up
        model.zero_grad(set_to_none=True)
        t0 = clock_()
        loss = model(x, y)
        t1 = clock_()
        loss.backward()
        t2 = clock_()
        model.zero_grad(set_to_none=True)
        dw = WeightGrads()
        t3 = clock_()
        with deferred(dw):
            loss = model(x, y)
        t4 = clock_()
        loss.backward()
        t5 = clock_()
        dw.apply()
        t6 = clock_()
        if k:
            for key, dt in (("F", t1 - t0), ("fused", t2 - t1), ("F deferred", t4 - t3), ("B", t5 - t4),
                            ("W", t6 - t5)):
                times[key].append(dt)
    torch.set_num_threads(threads)
    ratio = statistics.median((b + w) / f for b, w, f in zip(times["B"], times["W"], times["fused"]))
    fwd = statistics.median(d / f for d, f in zip(times["F deferred"], times["F"]))
    return {**{k: statistics.median(v) for k, v in times.items()}, "ratio": ratio, "forward_ratio": fwd}


def _rank(cfg: GPTConfig, p: int, m: int, batch: int, repeats: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # deferred: PyTorch's own baseline, loaded only when this benchmark runs it
    rank = dist.get_rank()
    x, y = to_here(data.get_batch(data.corpus_tokens()[0], batch, cfg.block_size, step=0))
    steps = {}
    for name in SCHEDULES:
        model = to_here(GPT(cfg, seed=0))
        bounds = partition(layer_costs(model.layers()), p)
        pipe = Pipeline(build_stages(model.layers(), bounds, rank, p), make_schedule(name, p, m),
                        boundary_shapes(model.layers(), bounds, x.chunk(m)[0]).__getitem__)
        steps[name] = partial(_ours, pipe, torch.optim.SGD(list(pipe.parameters()), lr=0.1), x, y)
    theirs = build_stages(to_here(GPT(cfg, seed=0)).layers(), bounds, rank, p)[rank]
    base = {"sched": Schedule1F1B(PipelineStage(theirs, rank, p, here()), m, loss_fn=lm_loss),
            "opt": torch.optim.SGD(theirs.parameters(), lr=0.1)}
    del theirs

    def step_theirs():
        base["opt"].zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            base["sched"].step(x)
        elif rank == p - 1:
            base["sched"].step(target=y, losses=losses)
        else:
            base["sched"].step()
        base["opt"].step()
        return sum(v.item() for v in losses) / m if losses else None

    steps["torch"] = step_theirs
    first = {k: fn() for k, fn in steps.items()}   # warm-up (and torch's shape inference); same loss?
    times = {k: [] for k in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            dist.barrier()
            t = clock()
            fn()
            dist.barrier()
            times[name].append(clock() - t)
    phases = defaultdict(lambda: defaultdict(list))  # a few more steps of ours, traced: F, B, W in place
    for _ in range(max(2, repeats // 4)):
        for name in SCHEDULES:
            mark = trace.mark()
            steps[name]()
            for e in trace.since(mark):
                if e["kind"] == "compute":
                    phases[name][e["labels"]["phase"]].append(e["end"] - e["start"])
    base.clear()   # free PyTorch's pipeline before returning (avoids aborts at exit)
    gc.collect()
    return {"times": times, "first_losses": first,
            "phases": {n: {k: statistics.median(v) for k, v in ph.items()} for n, ph in phases.items()}}


def _ours(pipe: Pipeline, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = pipe.step(x, y)
    opt.step()
    return loss


def main(argv=None) -> dict:
    ap = parser("pipeline", __doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="pipeline sizes (default 2 4)")
    ap.add_argument("--microbatches", type=int, default=None, help="default 8, --smoke 2")
    ap.add_argument("--repeats", type=int, default=None, help="default 20, --quick 5, --smoke 1")
    args = ap.parse_args(argv)
    ranks = args.ranks or size(args, [2, 4], [2], [2])
    repeats = args.repeats or size(args, 20, 5, 1)
    placement(ap, args.device, max(ranks), needs=NEEDS_GPU)
    cfg = GPTConfig(vocab_size=65, block_size=size(args, 64, 64, 16), n_layer=4, n_head=size(args, 4, 4, 2),
                    n_embd=size(args, 256, 256, 32))
    batch, m = size(args, 16, 16, 4), args.microbatches or size(args, 8, 8, 2)
    rows = []
    for p in ranks:
        res = launch(_rank, p, args=(cfg, p, m, batch, repeats), timeout=600, device=args.device)
        losses = res[p - 1]["first_losses"]
        for name in SCHEDULES:
            if abs(losses[name] - losses["torch"]) > 1e-4 * abs(losses["torch"]):
                raise AssertionError(f"p={p}: minipar {name} loss {losses[name]} "
                                     f"but torch's {losses['torch']}")
        t = {k: statistics.median(v) for k, v in res[0]["times"].items()}
        ph = res[0]["phases"]
        rows.append({**row(t["1f1b"], t["torch"], ranks=p, microbatches=m),   # minipar's 1F1B against torch's
                     "zb-h1 ms/step": 1e3 * t["zb-h1"], "zb-h1 / 1f1b": t["zb-h1"] / t["1f1b"],
                     "(B+W) / B": (ph["zb-h1"]["B"] + ph["zb-h1"]["W"]) / ph["1f1b"]["B"],
                     "F zb / F": ph["zb-h1"]["F"] / ph["1f1b"]["F"]})
    split = split_backward(cfg, batch // m, 3 * repeats)
    result = {"name": "pipeline", "baseline": "torch.distributed.pipelining Schedule1F1B",
              "rows": rows, "ratio": statistics.mean(r["ratio"] for r in rows), "split_backward": split,
              "model": f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} T={cfg.block_size}, batch {batch}"}
    return report(result, args, notes=[
        f"split backward, one micro-batch of {batch // m}: fused {1e3 * split['fused']:.2f} ms, "
        f"B {1e3 * split['B']:.2f} + W {1e3 * split['W']:.2f} ms; (B + W) / fused = {split['ratio']:.3f} "
        f"(median of paired rounds); deferred forward / plain = {split['forward_ratio']:.3f}"])
