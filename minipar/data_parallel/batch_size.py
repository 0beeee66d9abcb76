"""Large global batches: the linear scaling rule and gradual warm-up.

More replicas at a fixed per-rank batch b make the global batch B = n·b larger. A step on batch
kB averages k times more samples, so it can be k times larger and cover the ground of k small
steps (Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017, §2.1):
η(kB) = k · η(B), the linear scaling rule. It fails at the start, where the weights change fast,
so the rate ramps up from η(B) to k·η(B) over the first T steps (§2.2, gradual warm-up):

    η_t = η(B) + (k·η(B) - η(B)) · t / T    for t < T,    k·η(B) afterwards.
"""
from __future__ import annotations


def linear_scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """η(batch) = base_lr · batch / base_batch."""
    if base_batch <= 0 or batch <= 0:
        raise ValueError("batch sizes must be positive")
    return base_lr * batch / base_batch


def warmup_lr(step: int, base_lr: float, peak_lr: float, warmup_steps: int) -> float:
    """Learning rate at ``step``: linear from ``base_lr`` to ``peak_lr`` over ``warmup_steps``."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return peak_lr
    return base_lr + (peak_lr - base_lr) * step / warmup_steps
