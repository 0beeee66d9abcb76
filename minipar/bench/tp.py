"""``python -m minipar.bench tp``: minipar's tensor-parallel MLP and block against PyTorch's.

On t ranks (default 2, one thread each) both implementations split the same transformer
block (same weights, same input) the Megatron-LM way: minipar's
:class:`~minipar.tensor_parallel.ParallelMLP` / :class:`~minipar.tensor_parallel.ParallelBlock`,
and the single-device modules parallelised by ``torch.distributed.tensor.parallel`` with
``ColwiseParallel`` (qkv, fc) and ``RowwiseParallel`` (attention and MLP projections).
The run first checks that both give the same output, then times one forward + backward
of each, interleaved, and reports the median step time and the ratio minipar / PyTorch.
A single-device block (every rank running the whole layer, no communication) is timed
alongside for scale.
"""
from __future__ import annotations

import gc
import math

import torch
import torch.nn as nn

from .common import here, interleaved, median, parser, report, to_here


class _LocalHeadsAttention(nn.Module):
    """Attention over whatever heads this rank's qkv output holds (for PyTorch's TP: its
    column shard of a qkv weight permuted so that shard r is ``[q_r; k_r; v_r]``)."""

    def __init__(self, h: int, n_head: int):
        super().__init__()
        self.head_dim = h // n_head
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, x):
        qkv = self.qkv(x)
        B, T, three_local = qkv.shape
        q, k, v = qkv.split(three_local // 3, dim=2)
        nh = q.shape[-1] // self.head_dim
        q, k, v = (u.reshape(B, T, nh, self.head_dim).transpose(1, 2) for u in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, nh * self.head_dim))


class _Block(nn.Module):
    def __init__(self, h: int, n_head: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(h), _LocalHeadsAttention(h, n_head)
        self.ln2 = nn.LayerNorm(h)
        self.mlp = nn.Sequential()
        self.mlp.fc, self.mlp.gelu, self.mlp.proj = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _rank(b: int, s: int, h: int, n_head: int, repeats: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from minipar import tensor_parallel as tp
    from minipar.models import Block, GPTConfig

    t = dist.get_world_size()
    cfg = GPTConfig(vocab_size=64, block_size=s, n_layer=1, n_head=n_head, n_embd=h)
    with torch.random.fork_rng(devices=[]):   # the same single-device block on every rank
        torch.manual_seed(0)
        ref = Block(cfg)
        ref.apply(lambda m: nn.init.normal_(m.weight, 0, 0.02) if isinstance(m, nn.Linear) else None)
    ref = to_here(ref)
    state = ref.state_dict()

    # minipar
    mine = to_here(tp.ParallelBlock(cfg))
    mine.load_state_dict(tp.shard_state_dict(state, t, dist.get_rank()))
    # PyTorch: same weights, qkv rows permuted so that its contiguous column shards are head-aligned
    native = to_here(_Block(h, n_head))
    perm = dict(state)
    for k in ("attn.qkv.weight", "attn.qkv.bias"):
        perm[k] = torch.cat([tp.gpt.shard(k, state[k], t, r) for r in range(t)])
    native.load_state_dict(perm)
    mesh = init_device_mesh(here().type, (t,))
    parallelize_module(native, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                      "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})

    x = to_here(torch.randn(b, s, h, generator=torch.Generator().manual_seed(1), device="cpu"))
    with torch.no_grad():
        err = max((mine(x) - native(x)).abs().max().item(), (mine(x) - ref(x)).abs().max().item())

    def step(module, fn=None):
        def run():
            module.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            (fn or module)(xi).sum().backward()
        return run

    fns = {"minipar mlp": step(mine.mlp), "torch mlp": step(native.mlp),
           "minipar block": step(mine), "torch block": step(native), "single-device block": step(ref)}
    times = interleaved(fns, repeats=repeats, warmup=2)
    out = {k: median(v) for k, v in times.items()}
    out["max_abs_diff"] = err
    del native, mine, ref, mesh
    gc.collect()
    return out


def main(argv=None) -> dict:
    p = parser("tp", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel size t (default 2)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 128, --quick 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps each (default 20, --quick 8)")
    a = p.parse_args(argv)
    import minipar
    from minipar import tensor_parallel as tp
    from minipar.models import GPTConfig

    s = a.seq or (64 if a.quick else 128)
    repeats = a.repeats or (8 if a.quick else 20)
    tp.check(GPTConfig(vocab_size=64, block_size=s, n_head=a.heads, n_embd=a.hidden), None, a.ranks)
    res = minipar.launch(_rank, a.ranks, args=(a.batch, s, a.hidden, a.heads, repeats), timeout=600,
                         device=a.device)
    r0 = res[0]
    if max(r["max_abs_diff"] for r in res) > 1e-4:
        raise RuntimeError(f"minipar and PyTorch disagree: max |diff| = {r0['max_abs_diff']:.2e}")
    rows = []
    for layer in ("mlp", "block"):
        rows.append({"layer": layer, "minipar_ms": 1e3 * r0[f"minipar {layer}"],
                     "torch_ms": 1e3 * r0[f"torch {layer}"],
                     "ratio": r0[f"minipar {layer}"] / r0[f"torch {layer}"]})
    rows.append({"layer": "block, 1 device", "minipar_ms": "-",
                 "torch_ms": 1e3 * r0["single-device block"], "ratio": "-"})
    result = {"name": "tp", "baseline": "torch.distributed.tensor.parallel", "ranks": a.ranks,
              "shape": {"b": a.batch, "s": s, "h": a.hidden, "heads": a.heads}, "rows": rows,
              "ratio": rows[1]["ratio"], "mlp_ratio": rows[0]["ratio"],
              "max_abs_diff": max(r["max_abs_diff"] for r in res)}
    if not a.json:
        print(f"tensor-parallel block, t={a.ranks} ranks x 1 thread, b={a.batch} s={s} h={a.hidden} "
              f"heads={a.heads}; forward+backward, median of {repeats}; outputs agree to "
              f"{result['max_abs_diff']:.1e}")
    return report(result, a, ["layer", "minipar_ms", "torch_ms", "ratio"])
