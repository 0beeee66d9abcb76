"""``python -m minipar.bench tp``: minipar's tensor-parallel MLP and block against PyTorch's.

On t ranks (default 2, one thread each) both implementations split the same transformer block
(same weights, same input) the Megatron-LM way: minipar's :class:`~minipar.tensor_parallel.ParallelMLP`
/ :class:`~minipar.tensor_parallel.ParallelBlock`, and the single-device modules parallelised by
``torch.distributed.tensor.parallel`` with ``ColwiseParallel`` (qkv, fc) and ``RowwiseParallel``
(attention and MLP projections). After checking that both give the same output, it times one
forward + backward of each, interleaved, and reports median step times and the ratio minipar /
PyTorch, with a single-device block (every rank running the whole layer, no communication) for scale.
"""
from __future__ import annotations

import gc
import math
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import tensor_parallel as tp
from ..models import Block, GPTConfig
from ..runtime.launch import launch
from .common import (backward_step, here, interleaved, median, placement, parser, report,
                     row, size, to_here)

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("PyTorch's tensor parallelism (DTensor) runs its all-reduces and all-gathers over the same Gloo "
              "group, which stages CUDA tensors through host memory as minipar does")


class _LocalHeadsAttention(nn.Module):
    """Attention over whatever heads this rank's qkv output holds (for PyTorch's TP: its
    column shard of a qkv weight permuted so that shard r is ``[q_r; k_r; v_r]``)."""

    def __init__(self, h: int, n_head: int):
        super().__init__()
        self.head_dim = h // n_head
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=2)
        B, T, local = q.shape
        nh = local // self.head_dim
        q, k, v = (u.reshape(B, T, nh, self.head_dim).transpose(1, 2) for u in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, nh * self.head_dim))


class _Block(nn.Module):
    def __init__(self, h: int, n_head: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(h), _LocalHeadsAttention(h, n_head), nn.LayerNorm(h)
        self.mlp = nn.Sequential(OrderedDict(fc=nn.Linear(h, 4 * h), gelu=nn.GELU(),
                                             proj=nn.Linear(4 * h, h)))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _rank(b: int, s: int, h: int, n_head: int, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh  # deferred: PyTorch's own baseline, loaded only when this benchmark runs it
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # deferred: the baseline's
    t = dist.get_world_size()
    cfg = GPTConfig(vocab_size=64, block_size=s, n_layer=1, n_head=n_head, n_embd=h)
    with torch.random.fork_rng(devices=[]):   # the same single-device block on every rank
        torch.manual_seed(0)
        ref = Block(cfg)
        ref.apply(lambda m: nn.init.normal_(m.weight, 0, 0.02) if isinstance(m, nn.Linear) else None)
    ref = to_here(ref)
    state = ref.state_dict()

    mine = to_here(tp.ParallelBlock(cfg))   # minipar's
    mine.load_state_dict(tp.shard_state_dict(state, t, dist.get_rank()))
    # PyTorch: same weights, qkv rows permuted so that its contiguous column shards are head-aligned
    native = to_here(_Block(h, n_head))
    native.load_state_dict({**state, **{k: torch.cat([tp.gpt.shard(k, state[k], t, r) for r in range(t)])
                                        for k in ("attn.qkv.weight", "attn.qkv.bias")}})
    mesh = init_device_mesh(here().type, (t,))
    parallelize_module(native, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                      "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})

    x = to_here(torch.randn(b, s, h, generator=torch.Generator().manual_seed(1), device="cpu"))
    with torch.no_grad():
        err = max((mine(x) - native(x)).abs().max().item(), (mine(x) - ref(x)).abs().max().item())

    modules = {"minipar mlp": mine.mlp, "torch mlp": native.mlp, "minipar block": mine,
               "torch block": native, "single-device block": ref}
    times = interleaved({k: backward_step(m, x, module=m) for k, m in modules.items()}, repeats, warmup=2)
    out = {**{k: median(v) for k, v in times.items()}, "max_abs_diff": err}
    del native, mine, ref, mesh, modules
    gc.collect()
    return out


def main(argv=None) -> dict:
    p = parser("tp", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel size t (default 2)")
    p.add_argument("--hidden", type=int, default=None, help="default 256, --smoke 32")
    p.add_argument("--heads", type=int, default=None, help="default 8, --smoke 2")
    p.add_argument("--batch", type=int, default=None, help="default 8, --smoke 2")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 128, --quick 64, --smoke 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps each (default 20, --quick 8, --smoke 1)")
    a = p.parse_args(argv)
    placement(p, a.device, a.ranks, shares=SHARED_GPU)
    s, repeats = a.seq or size(a, 128, 64, 16), a.repeats or size(a, 20, 8, 1)
    a.hidden, a.heads, a.batch = a.hidden or size(a, 256, 256, 32), a.heads or size(a, 8, 8, 2), a.batch or size(a, 8, 8, 2)
    tp.check(GPTConfig(vocab_size=64, block_size=s, n_head=a.heads, n_embd=a.hidden), None, a.ranks)
    res = launch(_rank, a.ranks, args=(a.batch, s, a.hidden, a.heads, repeats), timeout=600, device=a.device)
    r0, err = res[0], max(r["max_abs_diff"] for r in res)
    if err > 1e-4:
        raise RuntimeError(f"minipar and PyTorch disagree: max |diff| = {r0['max_abs_diff']:.2e}")
    rows = [row(r0[f"minipar {layer}"], r0[f"torch {layer}"], layer=layer, against="torch tensor parallel")
            for layer in ("mlp", "block")]
    rows.append(row(r0["minipar block"], r0["single-device block"], layer="block", against="one device, whole layer"))
    result = {"name": "tp", "baseline": "torch.distributed.tensor.parallel", "ranks": a.ranks,
              "shape": {"b": a.batch, "s": s, "h": a.hidden, "heads": a.heads}, "rows": rows,
              "ratio": rows[1]["ratio"], "mlp_ratio": rows[0]["ratio"], "max_abs_diff": err}
    return report(result, a, intro=[f"tensor-parallel block, t={a.ranks} ranks x 1 thread, b={a.batch} s={s} "
                                    f"h={a.hidden} heads={a.heads}; forward+backward, median of {repeats}; "
                                    f"outputs agree to {err:.1e}"])
