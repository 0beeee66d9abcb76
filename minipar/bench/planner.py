"""``python -m minipar.bench planner``: the planner's predicted step time against measured ones, here.

The planner is calibrated on this machine (:func:`minipar.plan.measure_machine`: α-β of Gloo's
all-reduce, GEMM FLOP/s by shape, memory bandwidth, one block's dispatch overhead), then predicts
one data-parallel training step of a GPT (:func:`minipar.plan.predict`, fp32, the gradients
all-reduced behind the backward). The same step is timed with minipar's DDP and PyTorch's
DistributedDataParallel (the loop of ``python -m minipar.bench ddp``: same GPT, same batches,
alternating blocks of steps, medians). ``ratio`` is minipar / PyTorch, measured; ``error`` is
predicted / measured - 1 for each, nothing fitted to either.

``--rho`` instead ranks chapter 07's ten strategies on 4 ranks (:func:`minipar.plan.course.
rank_correlation`: calibration and strategies interleaved in ``--rounds`` rounds, medians, the
CPU's one software number fitted on TP) and reports Spearman's ρ of predicted against measured
step times over the other nine, ``--runs`` times (each its own launch), with the load average
before and after each run (the goal: ρ ≥ 0.8 in two runs; a loaded machine's timings are noisy).
"""
from __future__ import annotations

import time

from .. import plan, data
from ..models import GPTConfig
from ..plan.course import rank_correlation
from ..runtime.launch import launch
from .common import RATIO, median, placement, parser, report, row, size
from .ddp import config, measure_rank

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("minipar's DDP against PyTorch's, both through host memory; the planner's calibration is measured"
              " in the same placement")


def main(argv=None) -> dict:
    p = parser("planner", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rho", action="store_true", help="rank chapter 07's strategies: Spearman's rho")
    p.add_argument("--runs", type=int, default=2, help="with --rho: separate runs, each reported")
    p.add_argument("--rounds", type=int, default=5, help="with --rho: interleaved rounds per run")
    a = p.parse_args(argv)
    placement(p, a.device, 4 if a.rho else a.ranks, shares=SHARED_GPU)
    if a.rho:
        return _rho(a)
    n, batch = a.ranks, size(a, 8, 8, 2)
    cfg = config(a)
    machine = plan.measure_machine(cfg, world_size=n, micro_batch=batch,
                                   sizes=[2 ** 10, 2 ** 14, 2 ** 18] if a.smoke else None)
    lay = plan.Layout(dp=n, micro_batch=batch, dtype="fp32", sequence_parallel=False)
    pred = plan.predict(plan.from_gpt_config(cfg), machine["cluster"], lay, batch * n, cfg.block_size)
    res = launch(measure_rank, n, args=(cfg, batch, size(a, 3, 2, 1), size(a, 10, 5, 1), 4.0), timeout=600,
                 device=a.device)[0]
    mini, torch_ = median(res["times"]["minipar"]), median(res["times"]["pytorch"])
    r = {**row(mini, torch_, ranks=n, **{"predicted ms/step": 1e3 * pred.step_time}),
         "error vs minipar": pred.step_time / mini - 1, "error vs baseline": pred.step_time / torch_ - 1,
         "bottleneck": pred.bottleneck}
    result = {"name": "planner", "baseline": "torch DDP", "ratio": mini / torch_, "rows": [r],
              "machine": {k: machine[k] for k in ("alpha", "beta", "flops", "bandwidth", "overhead")}}
    return report(result, a)


def _rho(a) -> dict:

    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=6, n_head=8, n_embd=32)   # chapter 07's
    batches = data.batches(data.synthetic_tokens(4000, cfg.vocab_size), steps=4, batch_size=16,
                           block_size=cfg.block_size)
    rows = []
    for run in range(1 if a.smoke else a.runs):
        t = time.perf_counter()
        r = rank_correlation(cfg, batches, 4, rounds=size(a, a.rounds, 2, 1))
        rows.append({"run": run + 1, "rho": r["rho"], RATIO: 0.8 / r["rho"] if r["rho"] > 0 else float("inf"),
                     "load before": r["load"][0], "load after": r["load"][1],
                     "seconds": time.perf_counter() - t,
                     **{f"{k} pred/meas ms": f"{r['predicted'][k]:.0f}/{r['measured'][k]:.0f}" for k in r["measured"]}})
    # no PyTorch baseline and no times: a row's ratio is the goal over its run's rho (at most 1: met)
    return report({"name": "planner", "baseline": "goal rho 0.8", "ratio": max(x[RATIO] for x in rows),
                   "rows": rows}, a)
