"""Data parallelism: replicate the model, split the batch, average the gradients.

* :func:`allreduce_gradients` — naive: one all-reduce per parameter after backward.
* :func:`assign_buckets`, :class:`Bucket`, :class:`Reducer` — buckets all-reduced as they fill.
* :class:`DistributedDataParallel` — the wrapper (naive, bucketed or overlapped: :data:`VERSIONS`).
* :class:`ShardedBatchSampler`, :func:`shard_batch` — each rank's slice of the global batch.
* :func:`check`, :func:`train`, :func:`run` — the strategy's API (:mod:`minipar.strategy`).
* :func:`parameter_server` — asynchronous SGD with a parameter server and bounded staleness; its
  module speaks the strategy's API too (``from minipar.data_parallel.parameter_server import run``).
* :func:`linear_scaled_lr`, :func:`warmup_lr` — large-batch learning-rate rules.
"""
from .batch_size import linear_scaled_lr, warmup_lr
from .buckets import Bucket, assign_buckets
from .ddp import VERSIONS, DistributedDataParallel
from .naive import allreduce_gradients, broadcast_module, trainable
from .parameter_server import parameter_server
from .reducer import Reducer
from .sampler import ShardedBatchSampler, shard_batch
from ..strategy import average_loss
from .train import check, run, train

__all__ = ["allreduce_gradients", "broadcast_module", "trainable", "assign_buckets", "Bucket", "Reducer",
           "DistributedDataParallel", "VERSIONS", "ShardedBatchSampler", "shard_batch", "train", "run",
           "check", "average_loss", "parameter_server", "linear_scaled_lr", "warmup_lr"]
