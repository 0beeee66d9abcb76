"""A straggler beaten, and what a live switch costs: chapter 12's adaptive runs, timed.

Two things, on 4 ranks of the course GPT (SGD with momentum):

* **the straggler**: pp=4 with rank 1 made ``--factor`` times slower
  (:func:`minipar.adapt.straggler.slow_down`), trained ``--steps`` steps as it is (the baseline)
  and with ``adapt_every`` (the pipeline cut again on the layers' measured times when it pays),
  runs interleaved (static, adaptive, adaptive, static, ...). The time is the whole run's, the
  switches included. ``ratio`` = adaptive / static, the median of ``--repeats`` pairs (the range
  is printed too);
* **a switch**: dp4 → dp2·tp2 → pp2·tp2 under ZeRO-1, each switch's plan bytes and the time of
  its move (packing, the all-to-all, unpacking) beside the α-β estimate of that exchange on this machine
  (:func:`minipar.plan.measure_machine`'s α and β, the busiest sender's bytes), and the
  whole switch's time (describing the holdings, the plan, the move; the new mesh and model are
  built before it).
"""
from __future__ import annotations

import statistics

import torch

from .. import adapt, data
from ..models.gpt import GPT, GPTConfig
from .common import one_gpu_per_rank, parser, report, row, size


def momentum(ps):
    return torch.optim.SGD(ps, lr=0.2, momentum=0.9)


def _whole(result) -> float:
    m = result.measured[0]
    return sum(m["step_seconds"]) + sum(s["seconds"] for s in m["switches"])


def main(argv=None) -> dict:
    ap = parser("adapt", __doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--factor", type=float, default=3.0, help="how much slower rank 1 computes")
    ap.add_argument("--every", type=int, default=5, help="adapt_every: steps between measurements")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    one_gpu_per_rank(ap, a.device, 4)
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
    notes = [f"ratio range over {repeats} pairs: {min(ratios):.3f} .. {max(ratios):.3f} (whole runs, switches included)",
             "a switch:  " + "; ".join(f"{s['to']}: {s['plan_MiB']:.2f} MiB, move {s['move_ms']:.1f} ms "
                                       f"(pack, all-to-all, unpack; the exchange's α-β estimate {s['estimate_ms']:.1f} ms), "
                                       f"whole switch {s['switch_ms']:.0f} ms"
                                       for s in switches)]
    return report(result, a, intro=[f"4 ranks, GPT {config.n_layer}×{config.n_embd}, {steps} steps, "
                                    f"median of {repeats} interleaved pairs"], notes=notes)


def _switches(config, batches, a) -> list[dict]:
    from ..plan import measure_machine
    machine = measure_machine(config, 4)
    res = adapt.run(GPT(config, seed=0), batches, 4, momentum, launch_options={"device": a.device}, layout="dp=4,zero=1",
                    switches=["2=dp=2,tp=2,zero=1", "4=pp=2,tp=2,zero=1"])
    out = []
    for i, s in enumerate(res.measured[0]["switches"]):
        per_rank = [m["switches"][i] for m in res.measured]
        busiest = max(r["bytes_sent"] for r in per_rank)
        out.append({"to": s["to"], "plan_MiB": s["plan_bytes"] / 2**20,
                    "move_ms": 1e3 * max(r["phases"]["move"] for r in per_rank),
                    "estimate_ms": 1e3 * (3 * machine["alpha"] + busiest * machine["beta"]),
                    "switch_ms": 1e3 * max(r["seconds"] for r in per_rank)})
    return out


if __name__ == "__main__":
    main()
