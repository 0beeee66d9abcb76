"""Autograd tools below the models and the strategies.

* :mod:`.split_backward` — the backward split into B (input gradients) and W (weight
  gradients), Qi et al. 2023: zero-bubble pipeline schedules run W later, and the models'
  activation recomputation keeps X where recomputation can drop it.
"""
from .split_backward import DeferredLinear, WeightGrads, current, deferred

__all__ = ["WeightGrads", "DeferredLinear", "deferred", "current"]
