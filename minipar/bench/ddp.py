"""``python -m minipar.bench ddp``: minipar's overlapped DDP against PyTorch's, same run.

Both wrap the same GPT (same seed) on the same ranks and train on the same per-rank batches with
SGD, timed in alternating blocks of steps (so a slow spell of the machine hits both); the result is
the ratio of median step times, minipar / PyTorch. minipar's bucketed DDP without overlap is timed
alongside, to show what overlap buys. ``max |Δw|``: largest difference between the two DDPs' final
weights (0 on 2 ranks; on more ranks the two bucket layouts sum in different orders: a few ulps).
"""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from .. import data
from ..data_parallel import DistributedDataParallel as MiniDDP
from ..models import GPT, GPTConfig
from ..runtime import trace
from ..runtime.launch import launch
from .common import median, placement, parser, report, row, size, step_blocks, to_here

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("PyTorch's DDP copies its CUDA buckets to host memory for Gloo as minipar stages its own; the "
              "ratio compares the two implementations there, not NCCL's speed")


def measure_rank(cfg: GPTConfig, batch: int, steps: int, repeats: int, bucket_mb: float) -> dict:
    """On each rank: time minipar's DDP against PyTorch's on the same GPT (also the planner's probe)."""
    trace.enable(False)  # time the machinery, not the recorder's bookkeeping
    r = dist.get_rank()
    tokens = data.synthetic_tokens(20_000, vocab_size=cfg.vocab_size)
    batches = to_here([data.get_batch(tokens, batch, cfg.block_size, s, seed=r) for s in range(steps)])
    models = {"minipar": MiniDDP(to_here(GPT(cfg, seed=0)), bucket_cap_mb=bucket_mb, overlap=True),
              "pytorch": torch.nn.parallel.DistributedDataParallel(to_here(GPT(cfg, seed=0)),
                                                                   bucket_cap_mb=bucket_mb),
              "no overlap": MiniDDP(to_here(GPT(cfg, seed=0)), bucket_cap_mb=bucket_mb, overlap=False)}
    trainers = {k: (m, torch.optim.SGD(m.parameters(), lr=1e-3)) for k, m in models.items()}
    times = step_blocks(trainers, batches, repeats)
    diff = max((a - b).abs().max().item() for a, b in zip(models["minipar"].parameters(),
                                                           models["pytorch"].module.parameters()))
    del models, trainers  # free PyTorch's DDP before the process may exit (see DEVELOPING.md)
    gc.collect()
    trace.enable(True)
    return {"times": times, "max_diff": diff}


def config(a) -> GPTConfig:
    """The benchmark's GPT at the run's size (``a``: parsed arguments; also the planner's)."""
    return GPTConfig(vocab_size=65, block_size=size(a, 128, 64, 16), n_layer=size(a, 4, 4, 2),
                     n_head=size(a, 4, 4, 2), n_embd=size(a, 256, 128, 32))


def main(argv=None) -> dict:
    p = parser("ddp", __doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=None)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    a = p.parse_args(argv)
    cfg = config(a)
    sizes, steps, repeats = a.world_sizes or size(a, [2, 4], [2], [2]), size(a, 3, 2, 1), size(a, 10, 10, 1)
    placement(p, a.device, max(sizes), shares=SHARED_GPU)
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    rows = []
    for n in sizes:
        res = launch(measure_rank, n, args=(cfg, 8, steps, repeats, a.bucket_mb), timeout=600, device=a.device)[0]
        mini, torch_ = median(res["times"]["minipar"]), median(res["times"]["pytorch"])
        rows.append({**row(mini, torch_, ranks=n, params=n_params),
                     "minipar no-overlap ms/step": 1e3 * median(res["times"]["no overlap"]),
                     "max |Δw|": res["max_diff"]})
    result = {"name": "ddp", "baseline": "torch DDP", "ratio": max(r["ratio"] for r in rows), "rows": rows,
              "bucket_mb": a.bucket_mb, "steps_per_block": steps, "repeats": repeats}
    return report(result, a)
