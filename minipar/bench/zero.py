"""``python -m minipar.bench zero``: ZeRO stage 1 and stage 3 against PyTorch's, same run.

Four trainers of the same GPT (same seed, same per-rank batches, AdamW) on the same ranks:

* ``zero1``: :class:`minipar.zero.ZeroOptimizer`, against PyTorch's
  ``ZeroRedundancyOptimizer`` used as documented (inside ``DistributedDataParallel``);
* ``zero3``: :class:`minipar.zero.FullyShardedDataParallel` (flat units) and
  :func:`minipar.zero.fully_shard` (per parameter, FSDP2's design), against FSDP2
  (``fully_shard`` on every layer, then on the model).

Step time: blocks of steps alternate between the four (so a slow spell hits all), a
step is as slow as the slowest rank, medians are reported. Peak memory: for each trainer
separately, torch's profiler records every CPU allocation and free of this process from
before the model is built until the end of its second step. The peak of the running sum
is the bytes of tensors the trainer held at its high-water mark (parameters, gradients,
optimizer state, gathered buffers, activations, communication buffers allocated by torch;
rank 0); "held" is the running sum after the second step (what stays between steps).
``ratio`` is the slower of the two step-time ratios (minipar / PyTorch).
"""
from __future__ import annotations

import gc
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .. import data, trace
from ..models import GPT, GPTConfig
from .common import clock, here, median, parser, report, to_here

IMPLS = ("minipar zero1", "torch ZeroRedundancyOptimizer", "minipar zero3", "torch FSDP2",
         "minipar zero3 per-parameter")


def _build(name: str, cfg: GPTConfig, lr: float = 1e-3):
    """``(forward, optimizer)`` for one trainer; its parameters for checking."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ..zero import FullyShardedDataParallel, ZeroOptimizer
    model = to_here(GPT(cfg, seed=0))
    if name == "minipar zero1":
        units = [list(m.parameters()) for m in model.layers()]
        return model, ZeroOptimizer(units, torch.optim.AdamW, lr=lr)
    if name == "torch ZeroRedundancyOptimizer":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    if name == "minipar zero3":
        fsdp = FullyShardedDataParallel(model)
        return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=lr)
    if name == "minipar zero3 per-parameter":
        from ..zero import fully_shard as minipar_fully_shard
        minipar_fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(here().type, (dist.get_world_size(),))
    for layer in model.layers():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _step(fwd, opt, x, y):
    opt.zero_grad(set_to_none=True)
    fwd(x, y).backward()
    opt.step()


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
    """Peak of the running sum of this process's CPU allocations (minus frees) from before
    the trainer is built to the end of its second step (the first creates the optimizer
    state): everything the trainer allocated, at its high-water mark."""
    from torch.profiler import ProfilerActivity, profile, record_function
    gc.collect()
    dist.barrier()
    if here().type == "cuda":  # on a GPU: the caching allocator's own figures
        from ..gpu import peak_memory
        base = torch.cuda.memory_allocated()
        with peak_memory() as m:
            fwd, opt = _build(name, cfg)
            for x, y in batches[:2]:
                _step(fwd, opt, x, y)
        held = torch.cuda.memory_allocated() - base
        del fwd, opt
        gc.collect()
        return m.bytes - base, held
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fwd, opt = _build(name, cfg)
        for x, y in batches[:2]:
            _step(fwd, opt, x, y)
        with record_function("zero_bench_mark"):
            pass
        del fwd, opt
        gc.collect()
    events = list(prof.profiler.kineto_results.events())
    mark = min(e.start_ns() for e in events if e.name() == "zero_bench_mark")
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    cur = peak = held = 0
    for e in mem:
        cur += e.nbytes()
        peak = max(peak, cur)
        if e.start_ns() < mark:
            held = cur
    return peak, held


def _rank(cfg: GPTConfig, batch: int, steps: int, repeats: int) -> dict:
    trace.enable(False)  # time the machinery, not the recorder's bookkeeping
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tokens = data.synthetic_tokens(20_000, vocab_size=cfg.vocab_size)
    batches = to_here([data.get_batch(tokens, batch, cfg.block_size, s, seed=r) for s in range(steps)])
    peaks = {name: _peak_bytes(name, cfg, batches) for name in IMPLS}
    trainers = {name: _build(name, cfg) for name in IMPLS}

    def block(name):
        fwd, opt = trainers[name]
        dist.barrier()
        t = clock()
        for x, y in batches:
            _step(fwd, opt, x, y)
        dt = torch.tensor([(clock() - t) / steps], device=batches[0][0].device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step is as slow as the slowest rank
        return dt.item()

    times = {k: [] for k in IMPLS}
    for i in range(repeats + 1):  # the first round warms up
        order = IMPLS if i % 2 == 0 else IMPLS[::-1]
        for name in order:
            t = block(name)
            if i:
                times[name].append(t)
    # the same training? minipar zero1 against ZeroRedundancyOptimizer (full params on every rank)
    a = dict(trainers["minipar zero1"][0].named_parameters())
    b = dict(trainers["torch ZeroRedundancyOptimizer"][0].module.named_parameters())
    diff1 = max((a[k] - b[k]).abs().max().item() for k in a)
    full3 = trainers["minipar zero3"][0].gather_full_params()
    diff3 = max((full3[k] - a[k]).abs().max().item() for k in a)
    from ..zero import full_state
    full3p = full_state(trainers["minipar zero3 per-parameter"][0])
    diff3p = max((full3p[k] - a[k]).abs().max().item() for k in a)
    del trainers, a, b  # free PyTorch's DDP/FSDP before the process may exit (DEVELOPING.md)
    gc.collect()
    trace.enable(True)
    return {"times": times, "peaks": peaks, "diff_zero1": diff1, "diff_zero3": diff3,
            "diff_zero3p": diff3p}


def main(argv=None) -> dict:
    from ..launch import launch
    p = parser("zero", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=None)
    a = p.parse_args(argv)
    if a.quick:
        cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
        n, steps, repeats = 2, 2, 3
    else:
        cfg = GPTConfig(vocab_size=65, block_size=128, n_layer=4, n_head=4, n_embd=256)
        n, steps, repeats = 4, 3, 5
    n = a.ranks or n
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    res = launch(_rank, n, args=(cfg, 8, steps, repeats), timeout=900, device=a.device)[0]
    t = {k: median(v) for k, v in res["times"].items()}
    rows = []
    for stage, mini, base in ((1, IMPLS[0], IMPLS[1]), (3, IMPLS[2], IMPLS[3]), ("3 per-param", IMPLS[4], IMPLS[3])):
        rows.append({"stage": stage, "ranks": n, "params": n_params, "minipar ms/step": 1e3 * t[mini],
                     "pytorch ms/step": 1e3 * t[base], "time ratio": t[mini] / t[base],
                     "minipar peak MiB": res["peaks"][mini][0] / 2**20,
                     "pytorch peak MiB": res["peaks"][base][0] / 2**20,
                     "memory ratio": res["peaks"][mini][0] / res["peaks"][base][0],
                     "minipar held MiB": res["peaks"][mini][1] / 2**20,
                     "pytorch held MiB": res["peaks"][base][1] / 2**20,
                     "baseline": base})
    result = {"name": "zero", "baseline": "torch ZeroRedundancyOptimizer / FSDP2",
              "ratio": max(r["time ratio"] for r in rows), "rows": rows,
              "memory_ratio": {f"stage{r['stage']}": r["memory ratio"] for r in rows},
              "max_param_diff": {"zero1_vs_torch": res["diff_zero1"], "zero3_vs_zero1": res["diff_zero3"],
                                 "zero3_per_param_vs_zero1": res["diff_zero3p"]}}
    out = report(result, a, ["stage", "ranks", "params", "minipar ms/step", "pytorch ms/step",
                             "time ratio", "minipar peak MiB", "pytorch peak MiB", "memory ratio",
                             "minipar held MiB", "pytorch held MiB"])
    if not a.json:
        print(f"max |parameter difference| after training: {result['max_param_diff']}")
    return out
