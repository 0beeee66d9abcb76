"""A straggler beaten, and what a live switch costs: chapter 12's adaptive runs, timed.

Two things, on 4 ranks of the course GPT (SGD with momentum):

* **the straggler**: pp=4 with rank 1 made ``--factor`` times slower
  (:func:`minipar.adapt.straggler.slow_down`), trained ``--steps`` steps as it is (the baseline)
  and with ``adapt_every`` (the pipeline cut again on the layers' measured times when it pays),
  runs interleaved (static, adaptive, adaptive, static, ...). The time is the whole run's, the
  switches included. ``ratio`` = adaptive / static, the median of ``--repeats`` pairs (the range
  is printed too);
* **a switch**: dp4 → dp2·tp2 → pp2·tp2 under ZeRO-1, each switch's plan bytes and the time of
  its all-to-all beside the α-β estimate of that exchange on this machine
  (:func:`minipar.adapt.switch.exchange_seconds` with :func:`minipar.plan.measure_machine`'s
  α and β: n − 1 messages and the busiest rank's bytes), and the switch's other phases, each the
  slowest rank's: building the new mesh and model, describing the holdings, the plan, waiting for
  the other ranks (a barrier), the copies (packing and unpacking).

The whole run's time is its steps plus its switches, their rebuilds included.
"""
from __future__ import annotations

import statistics

import torch

from .. import adapt, data
from ..adapt.switch import exchange_seconds
from ..models.gpt import GPT, GPTConfig
from ..plan import measure_machine
from .common import placement, parser, report, row, size

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
    switches = _switches(config, batches[:6], a)
    result = {"rows": rows, "baseline": "static", "ratio": statistics.median(ratios),
              "ratio_range": [min(ratios), max(ratios)], "ratios": ratios, "switches": switches,
              "device": a.device, "steps": steps, "repeats": repeats}
    notes = [f"ratio range over {repeats} pairs: {min(ratios):.3f} .. {max(ratios):.3f} (whole runs, switches and their rebuilds included)",
             *[f"a switch to {s['to']}: {s['plan_MiB']:.2f} MiB, all-to-all {s['all_to_all_ms']:.1f} ms "
               f"(α-β estimate {s['estimate_ms']:.1f} ms); build {s['build_ms']:.0f} ms, describe "
               f"{s['describe_ms']:.0f} ms, plan {s['plan_ms']:.0f} ms, wait {s['wait_ms']:.0f} ms, copy {s['copy_ms']:.1f} ms" for s in switches]]
    return report(result, a, intro=[f"4 ranks, GPT {config.n_layer}×{config.n_embd}, {steps} steps, "
                                    f"median of {repeats} interleaved pairs"], notes=notes)


def _switches(config, batches, a) -> list[dict]:
    machine = measure_machine(config, 4)
    res = adapt.run(GPT(config, seed=0), batches, 4, momentum, launch_options={"device": a.device}, layout="dp=4,zero=1",
                    switches=["2=dp=2,tp=2,zero=1", "4=pp=2,tp=2,zero=1"])
    out = []
    for i, s in enumerate(res.measured[0]["switches"]):
        per_rank = [m["switches"][i] for m in res.measured]
        estimate = exchange_seconds([r["bytes_sent"] for r in per_rank], [r["bytes_received"] for r in per_rank],
                                    machine["alpha"], machine["beta"])
        out.append({"to": s["to"], "plan_MiB": s["plan_bytes"] / 2**20, "estimate_ms": 1e3 * estimate,
                    "build_ms": 1e3 * max(r["build_seconds"] for r in per_rank),
                    **{f"{k}_ms": 1e3 * max(r["phases"][k] for r in per_rank) for k in s["phases"]},
                    "switch_ms": 1e3 * max(r["seconds"] + r["build_seconds"] for r in per_rank)})
    return out


if __name__ == "__main__":
    main()
