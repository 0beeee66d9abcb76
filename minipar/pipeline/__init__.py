"""Pipeline parallelism: partition a model into stages, schedule micro-batches, run them.

* :mod:`minipar.model_parallel.partition` — balanced cuts of a model's layers into stages, and
  :mod:`minipar.model_parallel.stage_comm` — activations forward, gradients back, across ranks:
  chapter 03's cut, re-exported here.
* :mod:`.schedules` — GPipe, 1F1B, interleaved 1F1B, ZB-H1 as lists of actions per rank.
* :mod:`minipar.autograd.split_backward` — the backward split into B (input gradients) and W
  (weight gradients), re-exported here: the pipeline's zero-bubble schedules use it.
* :mod:`.executor` — :class:`Pipeline` runs one rank's actions on real stages.
* :mod:`.posting` — under NCCL, receives posted by rounds of a lock-step play, so that the
  batches of sends and receives cannot wait on each other in a cycle.
* :mod:`.apply` — ``apply_pp``, the pipeline's step of :func:`minipar.hybrid.parallelize`.
* :mod:`.simulate` — the same schedules on paper: ideal timeline, deadlocks, stash, bubble.
* :mod:`.train` — ``check`` / ``train`` / ``run``, the shape of every strategy (:mod:`minipar.strategy`);
  ``probe_steps=k`` re-partitions by measured time after k steps (:mod:`.adaptive`).
"""
from .apply import apply_pp
from .executor import Pipeline
from ..model_parallel.partition import (balance, boundary_shapes, build_stages, explain, layer_costs, owned_parameters, partition,
                        stage_costs)
from .schedules import (SCHEDULES, Action, Schedule, add_comms, check_config, gpipe,
                        interleaved_1f1b, make_schedule, one_f_one_b, zb_h1)
from .simulate import Deadlock, bubble, check_schedule, compute_only, peak_stash, simulate
from ..autograd.split_backward import WeightGrads, deferred
from ..model_parallel.stage_comm import recv_activation, recv_grad, send_activation, send_grad
from .adaptive import train_adaptive
from .train import check, run, train

__all__ = ["apply_pp", "Pipeline", "partition", "balance", "explain", "layer_costs", "stage_costs", "build_stages",
           "owned_parameters", "SCHEDULES", "Action", "Schedule", "add_comms", "check_config",
           "make_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "Deadlock", "simulate",
           "check_schedule", "peak_stash", "bubble", "compute_only", "WeightGrads", "deferred",
           "send_activation", "recv_activation", "send_grad", "recv_grad", "boundary_shapes", "train_adaptive", "check",
           "train", "run"]
