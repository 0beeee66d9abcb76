"""What the one step loop costs: :func:`minipar.strategy.loop` around a step against a bare loop.

Every strategy's ``train`` hands its step body to :func:`minipar.strategy.loop`, which times
the step, reads its bytes by dimension from the trace and records the loss (an all-reduce,
kept on the device until the loop ends). This benchmark runs the same step body (PyTorch's
DDP on a small GPT: zero_grad, forward, backward, optimizer step) on every rank, in blocks of
all the batches, three ways, rounds interleaved (A, B, C, C, B, A, ...):

* ``torch loop``: a plain ``for`` loop, the loss all-reduced with ``torch.distributed``, the
  baseline;
* ``strategy.loop, recording off``: what ``python -m minipar.train`` and a long run see;
* ``strategy.loop, recording on``: with the trace's events (the course's default).

``ratio`` = recording off / torch loop: 1.0 means the loop costs nothing beside the step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import strategy
from ..data import batches as make_batches, synthetic_tokens
from ..models.gpt import GPT, GPTConfig
from ..runtime import trace
from ..runtime.launch import launch
from .common import clock, median, placement, parser, report, row, size, to_here

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("the same DDP step both ways; the ratio is the loop's own cost in this placement")


def _ranks(config, data, repeats: int) -> dict:
    """Inside each rank: seconds per step of each way, the slowest rank's, per round."""
    from torch.nn.parallel import DistributedDataParallel as DDP   # deferred: the baseline, only in its ranks

    model = DDP(to_here(GPT(config, seed=0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = to_here(data)

    def step(i, batch):
        opt.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        opt.step()
        return loss

    def torch_loop():
        records = []
        for i, batch in enumerate(data):
            t = step(i, batch).detach().float().reshape(1).clone()
            dist.all_reduce(t)
            records.append(t / dist.get_world_size())
        return torch.cat(records).tolist()

    def minipar_loop(on: bool):
        with trace.recording(on):
            return strategy.loop(data, step, mean_over=None)[0]

    ways = {"torch loop": torch_loop, "strategy.loop, recording off": lambda: minipar_loop(False),
            "strategy.loop, recording on": lambda: minipar_loop(True)}
    order, times = list(ways), {k: [] for k in ways}
    for r in range(repeats + 1):                      # round 0 warms up
        for name in (order if r % 2 == 0 else order[::-1]):
            dist.barrier()
            t = clock()
            ways[name]()
            dt = torch.tensor([(clock() - t) / len(data)], device=data[0][0].device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if r:
                times[name].append(dt.item())
    return times


def main(argv=None) -> dict:
    ap = parser("loop", __doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="batches per block")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    placement(ap, a.device, a.ranks, shares=SHARED_GPU)
    steps, repeats = size(a, a.steps, 4, 2), size(a, a.repeats, 3, 1)
    config = GPTConfig(vocab_size=256, block_size=size(a, 64, 64, 16), n_layer=2, n_head=size(a, 4, 4, 2),
                       n_embd=size(a, 64, 64, 16))
    data = make_batches(synthetic_tokens(20000, config.vocab_size), steps, 8 * a.ranks, config.block_size)
    times = launch(_ranks, a.ranks, device=a.device, args=(config, data, repeats), timeout=600)[0]
    s = {k: median(v) for k, v in times.items()}
    rows = [row(s[k], s["torch loop"], loop=k) for k in s if k != "torch loop"]
    result = {"rows": rows, "baseline": "torch loop", "ratio": s["strategy.loop, recording off"] / s["torch loop"],
              "device": a.device, "ranks": a.ranks, "steps": steps, "repeats": repeats}
    return report(result, a, intro=[f"{a.ranks} ranks, DDP step of a small GPT, {steps} steps per block, "
                                    f"median of {repeats} rounds"],
                  notes=["each rank trains its own copy of the global batch: the step is the same in all three"])


if __name__ == "__main__":
    main()
