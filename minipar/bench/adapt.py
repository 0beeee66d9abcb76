"""A straggler beaten, and what a live switch costs: chapter 12's adaptive runs, timed.

Two things, on 4 ranks of the course GPT (SGD with momentum):

* **the straggler**: pp=4 with rank 1 made ``--factor`` times slower
  (:func:`minipar.adapt.straggler.slow_down`), trained ``--steps`` steps as it is (the baseline)
  and with ``adapt_every`` (the pipeline cut again on the layers' measured times when it pays),
  runs interleaved (static, adaptive, adaptive, static, ...). The time is the whole run's, the
  switches included. ``ratio`` = adaptive / static, the median of ``--repeats`` pairs (the range
  is printed too);
* **a switch at the cost of its bytes**: dp2·tp2 ZeRO-1 → dp4 ZeRO-3 → pp2·tp2 ZeRO-1 → back
  to the first, on the toy GPT and on one 10× larger (momentum SGD: weights and
  momentum move; three times round, twice with ``--quick``, once with ``--smoke``). Each switch's phases, the slowest rank's, against the α-β time of its all-to-all
  (:func:`minipar.adapt.switch.exchange_seconds`: n − 1 messages and the busiest rank's bytes, α
  and β fitted here on the all-to-all itself, :func:`~minipar.adapt.switch.measure_exchange`, at
  sizes up to a rank's share of the state): building the new mesh and model (the rebuild, apart),
  describing the holdings, the plan, the copies (packing and unpacking), the all-to-all; the wait
  for the other ranks (the switch's first collective) is shown but is not the switch's. The first time round each
  pair's plan is made; after that it is kept (:mod:`minipar.adapt.plans`), and the table says
  which. The goal: a switch, its rebuild apart, within 2× its α-β time (``over α-β`` ≤ 2); each
  size reports the median and the range over its switches, and the medians of made and kept.
  Beside it, ``warm``: the switch's own all-to-all (its split sizes) run again right after it
  into buffers already touched, and ``over warm``, the switch over that: the same bound measured
  at the load of that moment (α and β are fitted once, at the start, and a shared machine's
  load moves). And ``copies``: one copy of what the rank sends and one of what it receives,
  contiguous buffer to contiguous buffer, warm, right after: the least packing and unpacking
  can cost at this machine's memory speed; ``over floor`` is the switch over ``warm`` plus
  ``copies``, what a switch that copies each element once a side cannot go under. On a CPU the
  switch's send and receive buffer is kept between switches
  (:func:`minipar.adapt.cut.staging`): the first switch of a run pays the first touch of its
  pages (on a CPU several times the copy into it), the later ones do not.

The whole run's time is its steps plus its switches, their rebuilds included.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import adapt, data, hybrid
from ..adapt.switch import measure_exchange, reshard
from ..models.gpt import GPT, GPTConfig
from ..runtime.backend import device
from ..runtime.launch import launch
from .common import clock, placement, parser, report, row, size

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("static and adaptive runs alike; the straggler is simulated on ranks that already share the GPU's"
              " compute, so the ratio is the re-partitioning's effect in this placement")


def momentum(ps):
    return torch.optim.SGD(ps, lr=0.2, momentum=0.9)


def _whole(result) -> float:
    m = result.measured[0]
    return sum(m["step_seconds"]) + sum(s["seconds"] + s["build_seconds"] for s in m["switches"])


def main(argv=None) -> dict:
    ap = parser("adapt", __doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--factor", type=float, default=3.0, help="how much slower rank 1 computes")
    ap.add_argument("--every", type=int, default=5, help="adapt_every: steps between measurements")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    placement(ap, a.device, 4, shares=SHARED_GPU)
    steps, repeats = size(a, a.steps, 20, 6), size(a, a.repeats, 2, 1)
    width = size(a, 128, 64, 16)
    config = GPTConfig(vocab_size=64, block_size=size(a, 64, 32, 16), n_layer=size(a, 8, 6, 2), n_head=4 if width > 16 else 2,
                       n_embd=width)
    batches = data.batches(data.synthetic_tokens(50_000, 64), steps, 16, config.block_size)
    slow = f"1:{a.factor:g}"
    ways = {"static": dict(layout="pp=4", slow_rank=slow),
            "adapting": dict(layout="pp=4", slow_rank=slow, adapt_every=min(a.every, steps - 1))}
    whole = {k: [] for k in ways}
    last = {}
    for r in range(repeats):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            last[name] = adapt.run(GPT(config, seed=0), batches, 4, momentum, launch_options={"device": a.device}, timeout=600, **ways[name])
            whole[name].append(_whole(last[name]))
    ratios = [x / y for x, y in zip(whole["adapting"], whole["static"])]
    rows = [row(statistics.median(whole["adapting"]) / steps, statistics.median(whole["static"]) / steps,
                run=f"pp=4, rank 1 ×{a.factor:g}, adapt every {ways['adapting']['adapt_every']}",
                cut=str(last["adapting"].measured[0]["bounds"]))]
    switches = {name: _switches(cfg, a) for name, cfg in _switch_models(config, a).items()}
    result = {"rows": rows, "baseline": "static", "ratio": statistics.median(ratios),
              "ratio_range": [min(ratios), max(ratios)], "ratios": ratios, "switches": switches,
              "device": a.device, "steps": steps, "repeats": repeats}
    notes = [f"ratio range over {repeats} pairs: {min(ratios):.3f} .. {max(ratios):.3f} (whole runs, switches and their rebuilds included)"]
    for name, rows_ in switches.items():
        over = [r["over_alpha_beta"] for r in rows_]
        notes += [f"\nswitches of the {name} ({rows_[0]['params']:,} parameters; ms, slowest rank; α-β of the all-to-all "
                  f"α {rows_[0]['alpha_us']:.0f} µs, β {rows_[0]['beta_GBps']:.2f} GB/s):",
                  f"  {'to':<20}{'MiB':>7}{'α-β':>7}{'a2a':>7}{'describe':>9}{'plan':>7}{'copy':>7}{'wait':>7}"
                  f"{'build':>7}{'over α-β':>10}{'warm':>7}{'over warm':>10}{'copies':>7}{'over floor':>11}  plan",
                  *[f"  {r['to']:<20}{r['plan_MiB']:>7.2f}{r['estimate_ms']:>7.1f}{r['all_to_all_ms']:>7.1f}"
                    f"{r['describe_ms']:>9.1f}{r['plan_ms']:>7.1f}{r['copy_ms']:>7.1f}{r['wait_ms']:>7.1f}"
                    f"{r['build_ms']:>7.0f}{r['over_alpha_beta']:>10.1f}{r['warm_ms']:>7.1f}{r['over_warm']:>10.1f}"
                    f"{r['copies_ms']:>7.1f}{r['over_floor']:>11.1f}"
                    f"  {'kept' if r['kept'] else 'made'}"
                    for r in rows_],
                  f"  over α-β (the switch, its rebuild and wait apart, / its all-to-all's α-β time): median "
                  f"{statistics.median(over):.1f}, range {min(over):.1f} .. {max(over):.1f} over {len(over)} switches; "
                  f"the plan made (first time round): median {_median(rows_, False)}, kept: {_median(rows_, True)}",
                  f"  over warm (the same / its own all-to-all again, warm buffers, right after it): median "
                  f"{statistics.median(r['over_warm'] for r in rows_):.1f}, kept: "
                  f"{_median(rows_, True, 'over_warm')}",
                  f"  over floor (the same / that all-to-all plus one warm copy of what it sends and receives): median "
                  f"{statistics.median(r['over_floor'] for r in rows_):.1f}, kept: {_median(rows_, True, 'over_floor')}"]
    return report(result, a, intro=[f"4 ranks, GPT {config.n_layer}×{config.n_embd}, {steps} steps, "
                                    f"median of {repeats} interleaved pairs"], notes=notes)


def _median(rows_, kept: bool, key: str = "over_alpha_beta") -> str:
    over = [r[key] for r in rows_ if r["kept"] == kept]
    return f"{statistics.median(over):.1f}" if over else "-"


LAYOUTS = ["dp=2,tp=2,zero=1", "dp=4,zero=3", "pp=2,tp=2,zero=1"]


def _switch_models(config, a) -> dict:
    """The toy GPT and one about 10× larger (√10 wider)."""
    wide = size(a, 416, 192, 32)
    return {"toy GPT": config, "10× GPT": GPTConfig(vocab_size=config.vocab_size, block_size=config.block_size,
                                                     n_layer=config.n_layer, n_head=4, n_embd=wide)}


def _switches(config, a) -> list[dict]:
    rounds = size(a, 3, 2, 1)
    res = launch(switch_costs, 4, args=(config, LAYOUTS, rounds), device=a.device, timeout=900)
    alpha, beta = res[0]["alpha"], res[0]["beta"]
    out = []
    for i, s in enumerate(res[0]["records"]):
        per_rank = [r["records"][i] for r in res]
        slow = {k: 1e3 * max(r["phases"][k] for r in per_rank) for k in s["phases"]}
        est = s["alpha_beta_s"]
        work = max(r["seconds"] - r["phases"]["wait"] for r in per_rank)
        out.append({"to": s["to"], "plan_MiB": s["plan_bytes"] / 2**20, "estimate_ms": 1e3 * est,
                    "kept": s["plan_kept"],
                    "build_ms": 1e3 * max(r["build_seconds"] for r in per_rank), **{f"{k}_ms": v for k, v in slow.items()},
                    "switch_ms": 1e3 * work, "over_alpha_beta": work / est, "params": res[0]["params"],
                    "warm_ms": 1e3 * (warm := max(r["warm_seconds"] for r in per_rank)), "over_warm": work / warm,
                    "copies_ms": 1e3 * (copies := max(r["copy_seconds"] for r in per_rank)),
                    "over_floor": work / (warm + copies),
                    "alpha_us": 1e6 * alpha, "beta_GBps": 1e-9 / beta if beta else float("inf")})
    return out


def _fastest(run, repeats: int) -> float:
    """Seconds of ``run()``, each time after a barrier, timed by :func:`~.common.clock` (the GPU's
    queued work included): the fastest of ``repeats``."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = clock()
        run()
        times.append(clock() - t0)
    return min(times)


def warm_exchange(send: list[int], recv: list[int], repeats: int = 3) -> float:
    """The switch's own all-to-all again (its split sizes, fp32), into buffers already touched,
    each after a barrier: the fastest of ``repeats``. Measured right after the switch, so at the
    machine's load of that moment: what the exchange alone costs, its pattern included."""
    x = torch.ones(sum(send), device=device())
    y = torch.zeros(sum(recv), device=device())
    return _fastest(lambda: dist.all_to_all_single(y, x, recv, send), repeats)


def copy_floor(send: list[int], recv: list[int], repeats: int = 3) -> float:
    """One copy of the ``sum(send)`` elements a rank packs and one of the ``sum(recv)`` it unpacks
    (fp32), contiguous into contiguous, buffers already touched, each time after a barrier: the
    fastest of ``repeats``. The least a switch's packing and unpacking can take here."""
    n, out, back = max(sum(send), sum(recv)), sum(send), sum(recv)
    a, b = torch.ones(n, device=device()), torch.zeros(n, device=device())

    def copies():
        b[:out].copy_(a[:out])
        a[:back].copy_(b[:back])
    return _fastest(copies, repeats)


def switch_costs(config, layouts, rounds: int) -> dict:
    """Rank function: this machine's all-to-all α and β, then the model trained one step on
    ``layouts[0]`` and switched round the layouts ``rounds`` times; every switch's record (the
    rebuild timed beside it, ``alpha_beta_s`` its bound)."""
    params = sum(p.numel() for p in GPT(config).parameters())
    state = 2 * 4 * params // dist.get_world_size()                    # weights and momentum, fp32, a rank's share
    alpha, beta = measure_exchange((1 << 10, 1 << 16, state // 8, state // 2, state), repeats=7, device=device())

    def build(text):
        lay = adapt.parse(text)
        return hybrid.HybridModel(GPT(config, seed=0), lay.mesh(), optimizer=momentum, **lay.options())
    x, y = data.batches(data.synthetic_tokens(5_000, config.vocab_size), 1, 8, config.block_size)[0]
    old = build(layouts[0])
    old.train_step(x, y)
    records = []
    for _ in range(rounds):
        for text in layouts[1:] + layouts[:1]:
            t0 = time.perf_counter()
            new = build(text)
            built = time.perf_counter() - t0
            rec = reshard(old, new, (alpha, beta))
            records.append(rec | {"to": text, "build_seconds": built, "warm_seconds": warm_exchange(*rec["splits"]),
                                  "copy_seconds": copy_floor(*rec["splits"])})
            old = new
    return {"alpha": alpha, "beta": beta, "records": records, "params": params}


if __name__ == "__main__":
    main()
