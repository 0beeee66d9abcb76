"""All-reduce from scratch against the backend's own: ``python -m minipar.bench collectives``.

On ``--ranks`` ranks, for message sizes from 1 KiB upwards, times minipar's ring all-reduce (and,
for a power-of-two number of ranks, recursive halving-doubling) against ``torch.distributed.all_reduce``
on the same backend, calls interleaved: Gloo on the CPU, NCCL with ``--device cuda`` (one GPU per
rank; the tensors are then CUDA tensors, and the reported backend is the one that moved them). Reports the fastest of the repeats per size, the
bus bandwidth (2(n-1)/n·N / t), the α-β fit of each, and as ``ratio`` minipar's ring time over the
backend's at the largest size.
"""
from __future__ import annotations

from .. import cost
from ..plan.calibrate import time_all_reduces as measure   # the planner's calibration times the same loop
from ..runtime.launch import launch
from .common import placement, parser, report, row, size

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("the ring stages every message through host memory, Gloo's all_reduce copies the whole tensor to "
              "host once; the ratio weighs minipar's per-message staging, not NCCL's speed")


def main(argv=None) -> dict:
    p = parser("collectives", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=None, help="ranks (default 4, --smoke 2)")
    a = p.parse_args(argv)
    n = a.ranks or size(a, 4, 4, 2)
    sizes = [2 ** k for k in range(10, size(a, 24, 22, 14) + 1, 2)]   # 1 KiB to 16, 4 MiB (16 KiB)
    placement(p, a.device, n, shares=SHARED_GPU)
    res = launch(measure, n, args=(sizes, size(a, 10, 5, 1)), timeout=600, device=a.device)
    backend = res[0]["backend"]
    times = {k: [max(r["seconds"][k][i] for r in res) for i in range(len(sizes))] for k in res[0]["seconds"]}
    fits = {k: cost.fit_alpha_beta("all_reduce", sizes, ts, n, k if k == "halving_doubling" else "ring")
            for k, ts in times.items()}
    rows = []
    for i, s in enumerate(sizes):
        r = row(times["ring"][i], times[backend][i], bytes=s)   # minipar's ring against the backend's
        for k, ts in times.items():
            if k == "halving_doubling":
                r["halving_doubling ms/step"] = 1e3 * ts[i]
            r[f"{k} MB/s"] = cost.bus_bandwidth("all_reduce", s, n, ts[i]) / 1e6
        rows.append(r)
    result = {"benchmark": "collectives", "ranks": n, "backend": backend, "baseline": f"{backend} all_reduce",
              "sizes": sizes, "seconds": times, "ratio": times["ring"][-1] / times[backend][-1],
              "alpha_beta": {k: {"alpha_s": a_, "beta_s_per_byte": b_,
                                 "bandwidth_MBps": (1 / b_ / 1e6) if b_ > 0 else None}
                             for k, (a_, b_) in fits.items()},
              "rows": rows}
    return report(result, a, notes=[f"α-β fit {k}: α = {a_ * 1e6:.0f} µs per step, "
                                    f"1/β = {1 / b_ / 1e6 if b_ > 0 else float('inf'):.0f} MB/s"
                                    for k, (a_, b_) in fits.items()])
