"""``python -m minipar.bench pipeline``: minipar's 1F1B against torch.distributed.pipelining's.

The same GPT, cut at the same layers (balanced by parameter count), the same batch and
micro-batches, the same SGD step, on p ranks of one launch: each repetition times one
training step of minipar's :class:`~minipar.pipeline.Pipeline` with the 1F1B schedule and
then one of PyTorch's ``Schedule1F1B`` over ``PipelineStage`` (alternating, so both see
the same machine load; a barrier before and after each). It also checks that the two
compute the same loss. Reported: median step time of each and the ratio minipar / torch.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from .. import data, launch
from ..models import GPT, GPTConfig, lm_loss
from ..pipeline import Pipeline, build_stages, layer_costs, make_schedule, partition
from ..pipeline.train import boundary_shapes
from .common import parser, report


def _rank(cfg: GPTConfig, p: int, m: int, batch: int, repeats: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    rank = dist.get_rank()
    tokens, _ = data.corpus_tokens()
    x, y = data.get_batch(tokens, batch, cfg.block_size, step=0)
    ours_model, theirs_model = GPT(cfg, seed=0), GPT(cfg, seed=0)
    bounds = partition(layer_costs(ours_model.layers()), p)
    ours = build_stages(ours_model.layers(), bounds, rank, p)
    pipe = Pipeline(ours, make_schedule("1f1b", p, m), boundary_shapes(
        ours_model.layers(), bounds, x.chunk(m)[0]).__getitem__)
    theirs = build_stages(theirs_model.layers(), bounds, rank, p)[rank]
    stage = PipelineStage(theirs, rank, p, torch.device("cpu"))
    base = {"sched": Schedule1F1B(stage, m, loss_fn=lm_loss),
            "opt": torch.optim.SGD(theirs.parameters(), lr=0.1)}
    del stage, theirs, theirs_model
    opt_ours = torch.optim.SGD(list(pipe.parameters()), lr=0.1)

    def step_ours():
        opt_ours.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        opt_ours.step()
        return loss

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

    first = (step_ours(), step_theirs())   # warm-up (and torch's shape inference); same loss?
    times = {"minipar": [], "torch": []}
    for _ in range(repeats):
        for name, fn in (("minipar", step_ours), ("torch", step_theirs)):
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t)
    base.clear()   # free PyTorch's pipeline before returning (avoids aborts at exit)
    gc.collect()
    return {"times": times, "first_losses": first}


def main(argv=None) -> dict:
    ap = parser("pipeline", __doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="pipeline sizes (default 2 4)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    ranks = args.ranks or ([2] if args.quick else [2, 4])
    repeats = args.repeats or (5 if args.quick else 20)
    cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=256)
    batch, m = 16, args.microbatches
    rows = []
    for p in ranks:
        res = launch(_rank, p, args=(cfg, p, m, batch, repeats), timeout=600)
        ours_loss, theirs_loss = res[p - 1]["first_losses"]
        if abs(ours_loss - theirs_loss) > 1e-4 * abs(theirs_loss):
            raise AssertionError(f"p={p}: minipar loss {ours_loss} but torch's {theirs_loss}")
        t_ours = statistics.median(res[0]["times"]["minipar"])
        t_theirs = statistics.median(res[0]["times"]["torch"])
        rows.append({"ranks": p, "microbatches": m, "minipar ms": 1e3 * t_ours,
                     "torch ms": 1e3 * t_theirs, "ratio": t_ours / t_theirs})
    result = {"name": "pipeline", "baseline": "torch.distributed.pipelining Schedule1F1B",
              "rows": rows, "ratio": statistics.mean(r["ratio"] for r in rows),
              "model": f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} T={cfg.block_size}, batch {batch}"}
    return report(result, args, ["ranks", "microbatches", "minipar ms", "torch ms", "ratio"])
