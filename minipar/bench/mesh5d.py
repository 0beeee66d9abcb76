"""``python -m minipar.bench mesh5d``: one training step of a mixture-of-experts GPT on all five
dimensions of minipar's mesh against PyTorch's DistributedDataParallel on the same 8 ranks.

The same model (a GPT whose every block's MLP is an MoE layer), the same global batch, 8 ranks:

* **minipar 5D**: :func:`minipar.hybrid.build` on dp=2 × cp=2 × pp=2 with ep=2 and ZeRO-1
  (ring attention, zigzag, 1F1B with m=2): the layout a large MoE model needs, at toy size;
* **minipar dp8**: the same model on minipar's mesh with dp=8 only (every rank all experts);
* **baseline (torch DDP)**: ``torch.nn.parallel.DistributedDataParallel`` with dp=8, the simplest
  layout PyTorch offers for the same job.

The ratio is minipar 5D / torch DDP, seconds per step of the slowest rank. On a small model the
five dimensions pay their messages (stage boundaries, the ring, two all-to-alls per MoE layer)
without the memory relief they buy at scale, so expect a ratio above 1; on 2 shared CPU cores
the timings are noisy. The 5D step is checked against one process in ``tests/test_mesh5d.py``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import hybrid
from ..runtime import trace
from ..data import batches, synthetic_tokens
from ..runtime.launch import launch
from ..mesh import ProcessMesh
from ..models.gpt import GPT, GPTConfig
from ..reference import adamw
from .common import clock, median, placement, parser, report, row, size, to_here

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("the ratio is what the five dimensions' messages cost through host memory against PyTorch's DDP, "
              "with the GPU's compute shared by the 8 ranks")

FIVE = dict(dp=2, cp=2, pp=2, tp=1, ep=2)


def _config(n_embd: int, block: int) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=block, n_layer=4, n_head=4, n_embd=n_embd, moe_every=1,
                     n_experts=4, top_k=2)


def _rank(n_embd, block, batch, repeats):
    torch.set_num_threads(1)
    config = _config(n_embd, block)
    data = [tuple(to_here(t) for t in b) for b in batches(synthetic_tokens(vocab_size=64), 2, batch, block)]
    with trace.recording(False):
        five = hybrid.build(GPT(config, seed=0), ProcessMesh(**FIVE).build(), zero=1, microbatches=2,
                            optimizer=adamw())
        dp8 = hybrid.build(GPT(config, seed=0), ProcessMesh(dp=8).build(), optimizer=adamw())
        model = to_here(GPT(config, seed=0))
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)  # unchosen experts
        opt = adamw()(ddp.parameters())
        r, n = dist.get_rank(), dist.get_world_size()

        def torch_step(x, y):
            opt.zero_grad(set_to_none=True)
            ddp(x.chunk(n)[r], y.chunk(n)[r]).backward()
            opt.step()

        steps = {"minipar 5D": five.train_step, "minipar dp8": dp8.train_step, "torch DDP dp8": torch_step}
        times = {k: [] for k in steps}
        for i in range(repeats + 1):                       # round 0 warms up; orders alternate
            for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
                dist.barrier()
                t = clock()
                for x, y in data:
                    steps[name](x, y)
                dt = torch.tensor([(clock() - t) / len(data)], device=data[0][0].device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)   # a step is as slow as its slowest rank
                if i:
                    times[name].append(dt.item())
    return {k: median(v) for k, v in times.items()}


def main(argv=None) -> dict:
    p = parser("mesh5d", __doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=None, help="n_embd (default 64, --quick 32, --smoke 16)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per sequence (default 64, --quick 32, --smoke 16)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (a multiple of 8)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 6, --quick 3, --smoke 1)")
    a = p.parse_args(argv)
    placement(p, a.device, 8, shares=SHARED_GPU)
    h, T = a.hidden or size(a, 64, 32, 16), a.block_size or size(a, 64, 32, 16)
    repeats = a.repeats or size(a, 6, 3, 1)
    hybrid.check(_config(h, T), None, 8, batch_size=a.batch_size, microbatches=2, zero=1, seq_len=T, **FIVE)
    res = launch(_rank, 8, args=(h, T, a.batch_size, repeats), timeout=900, device=a.device)
    seconds = res[0]
    rows = [row(seconds[k], seconds["torch DDP dp8"], implementation=k) for k in ("minipar 5D", "minipar dp8")]
    result = {"rows": rows, "ratio": seconds["minipar 5D"] / seconds["torch DDP dp8"], "baseline": "torch DDP dp8",
              "layout": FIVE, "hidden": h, "block_size": T, "batch_size": a.batch_size,
              "ratio_dp8": seconds["minipar dp8"] / seconds["torch DDP dp8"]}
    return report(result, a, notes=[
        f"minipar dp8 / torch DDP dp8: {result['ratio_dp8']:.3f} (the same layout on both)"])
