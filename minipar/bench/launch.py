"""Launch cost: ``minipar.runtime.launch`` against ``torch.multiprocessing.spawn``.

Each measurement runs in a fresh Python process that has already imported torch (as a notebook
kernel has): the time of minipar's first launch (cold: forkserver and pool start), of its next launch
(warm: the pool is reused), and of ``mp.spawn`` starting the same number of ranks, each initialising
a Gloo process group and passing a barrier. Runs alternate so both see the same machine load.
With ``--device cuda`` both launchers' ranks also make one tensor on their GPU (a CUDA context
each), minipar's in its placement for that device (ranks sharing a GPU when there are fewer).
"""
from __future__ import annotations

import json
import subprocess
import sys

import torch
import torch.distributed as dist

from ..runtime.rendezvous import free_port as _free_port
from .common import interleaved, median, placement, parser, report, row, size

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("both launchers start ranks that each make a CUDA context on the shared GPU; the ratio is the "
              "launch's cost")

_MINIPAR = """
import json, time, torch, torch.distributed as dist, minipar
def f():
    torch.zeros(1, device=minipar.device())
    dist.barrier()
t = time.perf_counter(); minipar.launch(f, {n}, device="{device}"); cold = time.perf_counter() - t
warm = []
for _ in range(5):
    t = time.perf_counter(); minipar.launch(f, {n}, device="{device}"); warm.append(time.perf_counter() - t)
print(json.dumps({{"cold": cold, "warm": sorted(warm)[2]}}))
"""

_SPAWN = """
import json, os, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from minipar.bench.launch import _spawn_rank
if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str({port}))
    t = time.perf_counter(); mp.spawn(_spawn_rank, args=({n}, "{device}"), nprocs={n}); dt = time.perf_counter() - t
    print(json.dumps({{"spawn": dt}}))
"""


def _spawn_rank(rank: int, n: int, device: str = "cpu") -> None:
    if device == "cuda":   # as minipar's ranks: a tensor on this rank's GPU (shared when fewer)
        torch.zeros(1, device=torch.device("cuda", rank % torch.cuda.device_count()))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    dist.barrier()
    dist.destroy_process_group()


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = parser("launch", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=None, help="ranks (default 4, --smoke 2)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    n, reps = a.ranks or size(a, 4, 4, 2), size(a, a.repeats, 1, 1)
    placement(p, a.device, n, shares=SHARED_GPU)
    got: dict[str, list] = {"minipar": [], "spawn": []}
    interleaved({"minipar": lambda: got["minipar"].append(_run(_MINIPAR.format(n=n, device=a.device))),
                 "spawn": lambda: got["spawn"].append(
                     _run(_SPAWN.format(n=n, port=_free_port(), device=a.device)))}, repeats=reps, warmup=0)
    cold, warm = (median([g[k] for g in got["minipar"]]) for k in ("cold", "warm"))
    spawn = median([g["spawn"] for g in got["spawn"]])
    rows = [row(t, spawn, launcher=name, ranks=n)   # a "step" here is one launch
            for name, t in (("minipar.runtime.launch, first (cold)", cold),
                            ("minipar.runtime.launch, again (warm)", warm))]
    result = {"benchmark": "launch", "ranks": n, "baseline": "torch.multiprocessing.spawn",
              "minipar_cold_s": cold, "minipar_warm_s": warm, "spawn_s": spawn,
              "ratio": cold / spawn, "warm_ratio": warm / spawn, "rows": rows}
    return report(result, a)
