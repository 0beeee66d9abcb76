"""``python -m minipar.bench zero``: ZeRO stage 1 and stage 3 against PyTorch's, same run.

Five trainers of the same GPT (same seed, same per-rank batches, AdamW) on the same ranks:

* ``zero1``: :class:`minipar.zero.ZeroOptimizer`, against PyTorch's ``ZeroRedundancyOptimizer``
  used as documented (inside ``DistributedDataParallel``);
* ``zero3``: :class:`minipar.zero.FullyShardedDataParallel` (flat units) and :func:`minipar.zero.fully_shard`
  (per parameter, FSDP2's design), against FSDP2 (``fully_shard`` on every layer, then on the model).

Step time: median, over blocks of steps that alternate between the five (so a slow spell hits
all), of the slowest rank's. Peak memory (rank 0): for each trainer separately, torch's profiler
records every CPU allocation and free of this process from before the model is built to the end of
its second step (on a GPU, the caching allocator's figures). The peak of the running sum is what the
trainer held at its high-water mark (parameters, gradients, optimizer state, gathered buffers,
activations, torch's communication buffers); "held" is the sum after the second step (what stays
between steps). ``ratio``: the slowest step-time ratio (minipar / PyTorch).
"""
from __future__ import annotations

import gc
import os
from contextlib import contextmanager, nullcontext
from itertools import accumulate

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from .. import data
from ..models import GPT, GPTConfig
from ..runtime import trace
from ..runtime.gpu import peak_memory
from ..runtime.launch import launch
from ..zero import FullyShardedDataParallel, ZeroOptimizer, full_state, fully_shard
from .common import (here, median, placement, parser, report, row, size, step_blocks,
                     to_here, train_step)

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("ZeroRedundancyOptimizer and FSDP2 run their broadcasts, all-gathers and reduce-scatters over the"
              " same Gloo group, which stages CUDA tensors through host memory as minipar does")

IMPLS = ("minipar zero1", "torch ZeroRedundancyOptimizer", "minipar zero3", "torch FSDP2",
         "minipar zero3 per-parameter")


def _build(name: str, cfg: GPTConfig, lr: float = 1e-3):
    """``(forward, optimizer)`` for one trainer; its parameters for checking."""
    model = to_here(GPT(cfg, seed=0))
    if name == "minipar zero1":
        return model, ZeroOptimizer([list(m.parameters()) for m in model.layers()], torch.optim.AdamW, lr=lr)
    if name == "torch ZeroRedundancyOptimizer":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    if name == "minipar zero3":
        fsdp = FullyShardedDataParallel(model)
        return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=lr)
    if name == "minipar zero3 per-parameter":
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    mesh = init_device_mesh(here().type, (dist.get_world_size(),))
    for layer in model.layers():
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


@contextmanager
def _quiet_stderr():
    """Silence C-level stderr (the profiler's start/stop lines) for the enclosed block."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _peak_bytes(name, cfg, batches) -> tuple[int, int]:
    """(peak, held) bytes of one trainer built and run for two steps (the first creates the
    optimizer state): the high-water mark of its allocations minus frees, and what stays."""
    from torch.profiler import ProfilerActivity, profile, record_function  # deferred: the profiler, heavy, only for this count
    gc.collect()
    dist.barrier()
    cuda = here().type == "cuda"  # on a GPU: the caching allocator's own figures; else the profiler's
    base = torch.cuda.memory_allocated() if cuda else 0
    profiler = nullcontext() if cuda else profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with (peak_memory() if cuda else _quiet_stderr()) as m, profiler as prof:
        fwd, opt = _build(name, cfg)
        for x, y in batches[:2]:
            train_step(fwd, opt, x, y)
        held = torch.cuda.memory_allocated() - base if cuda else None
        with record_function("zero_bench_mark"):
            pass
        del fwd, opt
        gc.collect()
    if cuda:
        return m.bytes - base, held
    events = list(prof.profiler.kineto_results.events())
    mark = min(e.start_ns() for e in events if e.name() == "zero_bench_mark")
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    running = list(accumulate((e.nbytes() for e in mem), initial=0))
    return max(running), running[sum(e.start_ns() < mark for e in mem)]  # held: the sum at the mark


def _rank(cfg: GPTConfig, batch: int, steps: int, repeats: int) -> dict:
    trace.enable(False)  # time the machinery, not the recorder's bookkeeping
    r = dist.get_rank()
    torch.manual_seed(0)
    tokens = data.synthetic_tokens(20_000, vocab_size=cfg.vocab_size)
    batches = to_here([data.get_batch(tokens, batch, cfg.block_size, s, seed=r) for s in range(steps)])
    peaks = {name: _peak_bytes(name, cfg, batches) for name in IMPLS}
    trainers = {name: _build(name, cfg) for name in IMPLS}
    times = step_blocks(trainers, batches, repeats)
    # the same training? each trainer's full parameters against minipar zero1's
    a = dict(trainers["minipar zero1"][0].named_parameters())
    others = {"diff_zero1": dict(trainers["torch ZeroRedundancyOptimizer"][0].module.named_parameters()),
              "diff_zero3": trainers["minipar zero3"][0].gather_full_params(),
              "diff_zero3p": full_state(trainers["minipar zero3 per-parameter"][0])}
    diffs = {key: max((b[k] - a[k]).abs().max().item() for k in a) for key, b in others.items()}
    del trainers, a, others  # free PyTorch's DDP/FSDP before the process may exit (DEVELOPING.md)
    gc.collect()
    trace.enable(True)
    return {"times": times, "peaks": peaks, **diffs}


def main(argv=None) -> dict:
    p = parser("zero", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=None)
    a = p.parse_args(argv)
    cfg = GPTConfig(vocab_size=65, block_size=size(a, 128, 64, 16), n_layer=size(a, 4, 4, 2),
                    n_head=size(a, 4, 4, 2), n_embd=size(a, 256, 128, 32))
    n, steps, repeats = a.ranks or size(a, 4, 2, 2), size(a, 3, 2, 2), size(a, 5, 3, 1)   # two steps at least
    placement(p, a.device, n, shares=SHARED_GPU)
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    res = launch(_rank, n, args=(cfg, 8, steps, repeats), timeout=900, device=a.device)[0]
    t, peak = {k: median(v) for k, v in res["times"].items()}, res["peaks"]  # peak: (peak, held) bytes
    rows = [{**row(t[mini], t[base], stage=stage, ranks=n, params=n_params),
             "minipar peak MiB": peak[mini][0] / 2**20, "pytorch peak MiB": peak[base][0] / 2**20,
             "memory ratio": peak[mini][0] / peak[base][0],
             "minipar held MiB": peak[mini][1] / 2**20, "pytorch held MiB": peak[base][1] / 2**20,
             "baseline": base}
            for stage, mini, base in ((1, IMPLS[0], IMPLS[1]), (3, IMPLS[2], IMPLS[3]),
                                      ("3 per-param", IMPLS[4], IMPLS[3]))]
    diffs = {"zero1_vs_torch": res["diff_zero1"], "zero3_vs_zero1": res["diff_zero3"],
             "zero3_per_param_vs_zero1": res["diff_zero3p"]}
    result = {"name": "zero", "baseline": "torch ZeroRedundancyOptimizer / FSDP2",
              "ratio": max(r["ratio"] for r in rows), "rows": rows,
              "memory_ratio": {f"stage{r['stage']}": r["memory ratio"] for r in rows},
              "max_param_diff": diffs}
    return report(result, a, list(rows[0])[:-1],  # every key but "baseline"
                  notes=[f"max |parameter difference| after training: {diffs}"])
