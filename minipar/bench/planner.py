"""``python -m minipar.bench planner``: the planner's predicted step time against measured ones, here.

The planner is calibrated on this machine (:func:`minipar.analysis.plan.measure_machine`: α-β of Gloo's
all-reduce, GEMM FLOP/s by shape, memory bandwidth, one block's dispatch overhead), then predicts
one data-parallel training step of a GPT (:func:`minipar.analysis.plan.predict`, fp32, the gradients
all-reduced behind the backward). The same step is timed with minipar's DDP and PyTorch's
DistributedDataParallel (the loop of ``python -m minipar.bench ddp``: same GPT, same batches,
alternating blocks of steps, medians). ``ratio`` is minipar / PyTorch, measured; ``error`` is
predicted / measured - 1 for each, nothing fitted to either.

``--rho`` instead ranks chapter 07's ten strategies on 4 ranks (:func:`minipar.analysis.plan.course.
rank_correlation`: calibration and strategies interleaved in ``--rounds`` rounds, medians, the
CPU's one software number fitted on TP) and reports Spearman's ρ of predicted against measured
step times over the other nine, ``--runs`` times (each its own launch), with the load average
before and after each run (the goal: ρ ≥ 0.8 in two runs; a loaded machine's timings are noisy).
"""
from __future__ import annotations

from ..runtime.launch import launch
from ..analysis import plan
from ..models import GPTConfig
from .common import median, parser, report
from .ddp import measure_rank


def main(argv=None) -> dict:
    p = parser("planner", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rho", action="store_true", help="rank chapter 07's strategies: Spearman's rho")
    p.add_argument("--runs", type=int, default=2, help="with --rho: separate runs, each reported")
    p.add_argument("--rounds", type=int, default=5, help="with --rho: interleaved rounds per run")
    a = p.parse_args(argv)
    if a.rho:
        return _rho(a)
    q, n, batch = a.quick, a.ranks, 8
    cfg = GPTConfig(vocab_size=65, block_size=64 if q else 128, n_layer=4, n_head=4, n_embd=128 if q else 256)
    machine = plan.measure_machine(cfg, world_size=n, micro_batch=batch)
    lay = plan.Layout(dp=n, micro_batch=batch, dtype="fp32", sequence_parallel=False)
    pred = plan.predict(plan.from_gpt_config(cfg), machine["cluster"], lay, batch * n, cfg.block_size)
    res = launch(measure_rank, n, args=(cfg, batch, 2 if q else 3, 5 if q else 10, 4.0), timeout=600, device=a.device)[0]
    mini, torch_ = median(res["times"]["minipar"]), median(res["times"]["pytorch"])
    row = {"ranks": n, "predicted ms/step": 1e3 * pred.step_time, "minipar ms/step": 1e3 * mini,
           "pytorch ms/step": 1e3 * torch_, "error vs minipar": pred.step_time / mini - 1,
           "error vs pytorch": pred.step_time / torch_ - 1, "bottleneck": pred.bottleneck}
    result = {"name": "planner", "baseline": "torch DDP", "ratio": mini / torch_, "rows": [row],
              "machine": {k: machine[k] for k in ("alpha", "beta", "flops", "bandwidth", "overhead")}}
    return report(result, a)


def _rho(a) -> dict:
    import time

    from .. import data
    from ..analysis.plan.course import rank_correlation
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=6, n_head=8, n_embd=32)   # chapter 07's
    batches = data.batches(data.synthetic_tokens(4000, cfg.vocab_size), steps=4, batch_size=16,
                           block_size=cfg.block_size)
    rows = []
    for run in range(a.runs):
        t = time.perf_counter()
        r = rank_correlation(cfg, batches, 4, rounds=2 if a.quick else a.rounds)
        rows.append({"run": run + 1, "rho": r["rho"], "load before": r["load"][0], "load after": r["load"][1],
                     "seconds": time.perf_counter() - t,
                     **{f"{k} pred/meas ms": f"{r['predicted'][k]:.0f}/{r['measured'][k]:.0f}" for k in r["measured"]}})
    low = min(x["rho"] for x in rows)   # no PyTorch baseline: the goal over the worse run's rho, <= 1 met
    return report({"name": "planner", "baseline": "goal rho 0.8", "ratio": 0.8 / low if low > 0 else float("inf"),
                   "rows": rows}, a)
