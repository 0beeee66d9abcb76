"""ZeRO (Rajbhandari et al. 2020): data parallelism without the redundant copies.

* :class:`ReplicatedOptimizer` — stage 0, plain data parallelism (the baseline);
* :class:`ZeroOptimizer` — stage 1, P_os: optimizer state sharded;
* :class:`Zero2Optimizer` — stage 2, P_os+g: gradients sharded too;
* :class:`FullyShardedDataParallel` — stage 3, P_os+g+p: parameters sharded too, gathered
  one flat unit at a time; :func:`fully_shard` — stage 3 per parameter (PyTorch's FSDP2);
  both keep small parameters whole with ``persist_below=``/``persist=`` (:mod:`.persist`);
* :mod:`minipar.zero.reduce` — the gradient reduce path all stages share;
  :func:`clip_grad_norm_` — clipping by the global norm under any stage;
* :func:`check`, :func:`train`, :func:`run` (:mod:`.training`) — the strategy's API
  (:mod:`minipar.strategy`), :func:`wrap` — a model and optimizer under any stage;
* :mod:`minipar.memory` — the bytes per component one rank holds
  (:func:`minipar.cost.zero_bytes_per_rank`: the same from the paper's formulas).
"""
from .clip import clip_grad_norm_
from .flat import FlatUnit, free_unit, gather_unit, padded_size, shard_size, split_units
from .per_parameter import full_state, fully_shard, padded_unit_sizes
from .persist import persistent_parameters
from ..memory import SavedActivations, held_state_bytes, state_tensors, storage_bytes
from .stage0 import ReplicatedOptimizer
from .stage1 import ZeroOptimizer, sharded_step
from .stage2 import Zero2Optimizer
from .reduce import OrderedReduction, reduce_shard, reduce_unit_grads
from .fsdp import FullyShardedDataParallel
from .stages import shard_module, stage_optimizer
from .training import check, run, train, wrap

__all__ = ["ReplicatedOptimizer", "ZeroOptimizer", "Zero2Optimizer", "FullyShardedDataParallel", "stage_optimizer",
           "shard_module",
           "sharded_step", "gather_unit", "free_unit", "fully_shard", "full_state", "padded_unit_sizes",
           "clip_grad_norm_", "persistent_parameters", "reduce_shard", "reduce_unit_grads", "OrderedReduction", "FlatUnit",
           "shard_size", "padded_size", "split_units", "check", "train", "run", "wrap", "held_state_bytes", "state_tensors",
           "storage_bytes", "SavedActivations"]
