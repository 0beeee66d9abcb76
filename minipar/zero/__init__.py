"""ZeRO (Rajbhandari et al. 2020): data parallelism without the redundant copies.

* :class:`ReplicatedOptimizer` — stage 0, plain data parallelism (the baseline);
* :class:`ZeroOptimizer` — stage 1, P_os: optimizer state sharded;
* :class:`Zero2Optimizer` — stage 2, P_os+g: gradients sharded too;
* :class:`FullyShardedDataParallel` — stage 3, P_os+g+p: parameters sharded and
  gathered one unit at a time;
* :mod:`minipar.zero.memory` — the bytes per component one rank holds;
  :func:`minipar.cost.zero_bytes_per_rank` — the same from the paper's formulas.
"""
from .flat import FlatUnit, padded_size, shard_size, split_units
from .memory import SavedActivations, model_state_bytes, state_tensors, storage_bytes
from .stage0 import ReplicatedOptimizer
from .stage1 import ZeroOptimizer, sharded_step
from .stage2 import Zero2Optimizer
from .stage3 import FullyShardedDataParallel, free_unit, gather_unit
from .train import train, wrap

__all__ = ["ReplicatedOptimizer", "ZeroOptimizer", "Zero2Optimizer", "FullyShardedDataParallel",
           "sharded_step", "gather_unit", "free_unit", "FlatUnit", "shard_size", "padded_size",
           "split_units", "train", "wrap", "model_state_bytes", "state_tensors", "storage_bytes", "SavedActivations"]
