"""Activation recomputation: time and memory of none/selective/full: ``python -m minipar.bench recompute``.

Trains steps (forward + backward) of one GPT under each ``recompute`` mode and each attention path
(``sdpa``: PyTorch's fused kernel; ``materialized``: written out, :mod:`minipar.models.attention`),
calls interleaved, and reports per row the median seconds, the extra time over no recomputation on
the same path, the extra FLOPs counted (:func:`minipar.cost.checkpoint_recompute_flops` over
3×forward) and the bytes kept for backward (:class:`minipar.activations.SavedActivations`).
Korthikanti et al. (2022, Table 4) measured +39% (full) and +7% (selective) on 22B, with the
scores written out; the count here is smaller for selective because softmax and dropout are
memory-bound work that FLOPs do not see. Fused, the scores are never stored and the kernel's
backward recomputes them (FlashAttention): that is selective recomputation already, and
``"selective"`` adds no checkpoint (:mod:`minipar.models.recompute`). Goal: selective at most +10%
time. ``ratio``: full / none time, fused.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .. import cost
from ..activations import SavedActivations
from ..models import GPT, GPTConfig
from .common import backward_step, interleaved, median, placement, parser, report, row, size

PATHS = ("sdpa", "materialized")


def main(argv=None) -> dict:
    p = parser("recompute", __doc__.splitlines()[0])
    a = p.parse_args(argv)
    placement(p, a.device, 1)   # one rank: its own GPU
    c = size(a, GPTConfig(vocab_size=512, block_size=512, n_layer=4, n_head=8, n_embd=256),
             GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128),
             GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    B, repeats = size(a, 8, 4, 2), size(a, 10, 3, 1)
    x = torch.randint(0, c.vocab_size, (B, c.block_size))
    models = {(path, m): GPT(replace(c, attention=path), seed=0).set_recompute(m)
              for path in PATHS for m in ("none", "selective", "full")}
    steps = {k: backward_step(lambda model=model: model(x, x), module=model) for k, model in models.items()}
    t = {k: median(ts) for k, ts in interleaved(steps, repeats).items()}   # seconds per step
    base_flops = cost.training_flops(B, c.block_size, c.n_layer, c.n_embd, c.vocab_size, "none")
    rows = []
    for (path, m), model in models.items():
        with SavedActivations(model) as saved:
            model(x, x)
        # fused, "selective" is the kernel's own recomputation of the scores (models.recompute)
        extra = 0 if (path, m) == ("sdpa", "selective") else cost.checkpoint_recompute_flops(
            B, c.block_size, c.n_embd, c.n_layer, m)
        rows.append({**row(t[path, m], t[path, "none"], attention=path, recompute=m),   # against none, same path
                     "extra FLOPs": extra / base_flops, "saved MB": saved.bytes / 1e6})
    selective = t["sdpa", "selective"] / t["sdpa", "none"] - 1
    result = {"rows": rows, "baseline": "no recomputation", "ratio": t["sdpa", "full"] / t["sdpa", "none"],
              "selective_extra_time": selective, "goal_met": selective <= 0.10}
    verdict = "met" if selective <= 0.10 else "NOT met"
    return report(result, a, intro=[f"GPT {c.n_layer} layers, h={c.n_embd}, {c.n_head} heads, B={B} "
                                    f"T={c.block_size}; forward+backward, median of {repeats}; baseline: no recomputation, same path"],
                  notes=[f"goal selective (sdpa) at most +10% time: {verdict} ({selective:+.1%})"])
