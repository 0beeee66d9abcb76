"""Activation recomputation: time and memory of none/selective/full: ``python -m minipar.bench recompute``.

Trains steps (forward + backward) of one GPT under each ``recompute`` mode, calls interleaved, and
reports per mode the median seconds, the extra time over no recomputation, the extra FLOPs counted
(:func:`minipar.cost.checkpoint_recompute_flops` over 3×forward) and the bytes kept for backward
(:class:`minipar.activations.SavedActivations`). Korthikanti et al. (2022, Table 4) measured +39%
(full) and +7% (selective) on 22B; the count here is smaller for selective because softmax and
dropout are memory-bound work that FLOPs do not see. ``ratio``: full / none time.
"""
from __future__ import annotations

import torch

from .. import cost
from ..activations import SavedActivations
from ..models import GPT, GPTConfig
from .common import backward_step, interleaved, median, parser, report


def main(argv=None) -> dict:
    p = parser("recompute", __doc__.splitlines()[0])
    a = p.parse_args(argv)
    c = (GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128) if a.quick
         else GPTConfig(vocab_size=512, block_size=512, n_layer=4, n_head=8, n_embd=256))
    B = 4 if a.quick else 8
    x = torch.randint(0, c.vocab_size, (B, c.block_size))
    models = {m: GPT(c, seed=0).set_recompute(m) for m in ("none", "selective", "full")}
    steps = {m: backward_step(lambda model=model: model(x, x), module=model) for m, model in models.items()}
    t = {m: median(ts) for m, ts in interleaved(steps, 3 if a.quick else 10).items()}   # seconds per step
    base_flops = cost.training_flops(B, c.block_size, c.n_layer, c.n_embd, c.vocab_size, "none")
    rows = []
    for m, model in models.items():
        with SavedActivations(model) as saved:
            model(x, x)
        extra = cost.checkpoint_recompute_flops(B, c.block_size, c.n_embd, c.n_layer, m)
        rows.append({"recompute": m, "ms": 1e3 * t[m], "extra time": t[m] / t["none"] - 1,
                     "extra FLOPs": extra / base_flops, "saved MB": saved.bytes / 1e6})
    return report({"rows": rows, "baseline": "no recomputation", "ratio": t["full"] / t["none"]}, a)
