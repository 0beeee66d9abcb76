"""Exercise 06: ZeRO: a sharded optimizer step, and stage 3's gather, compute, free
(Rajbhandari et al. 2020).

Every stage shares one layout: a unit's (a layer's) parameters are one flat vector,
zero-padded to N·k elements for the N ranks of the data-parallel ``group`` (``None``: the
world), and rank r of the group owns the r-th of N equal slices: on a non-world group, ranks
count within it. Data moves only through ``minipar.comm.reduce_scatter`` and
``minipar.comm.all_gather`` (flat tensors; they record the bytes the grader counts).

A. The reduce path, P_g: ``reduce_shard(flat_grad, group=None, **labels)`` and
   ``reduce_unit_grads(flat_unit, dtype=None, **labels)``.
   ``reduce_shard`` returns this rank's slice holding the mean over the group's ranks of that
   slice, as a view of ``flat_grad`` (reduced in place, no copy); each rank sends (N-1)/N of
   the unit's bytes; ``**labels`` reach the collective.
   ``reduce_unit_grads`` reduces a ``FlatUnit``'s gradients that way: a parameter without a
   gradient on this rank takes part as zeros; the result is in the dtype asked for (the
   parameters' by default), a new tensor of k elements (the full flat gradient is not kept);
   afterwards every parameter's ``.grad`` is None.
B. The ZeRO-1 optimizer, P_os: ``sharded_step(flat_params, grad_shards, shards, optimizer,
   group=None)`` and ``ZeroOptimizer``'s flat layout (in ``__init__``), ``step`` and ``_step``.
   After ``sharded_step`` every rank's ``flat_params`` hold the parameters of one full
   optimizer step on the mean gradient, while the optimizer only ever saw (and kept state for)
   this rank's slices. Dtypes may differ between the gradient, the shard and the flat
   parameters (mixed precision): each tensor keeps its own dtype.
   ``ZeroOptimizer(units, optimizer_cls, group, param_dtype, max_grad_norm, **kwargs)``: the
   model's parameters become views into the flat parameters, in ``param_dtype``; the
   optimizer's shards are fp32 (this rank's slices of the flat parameters, or their own master
   copies under ``param_dtype=torch.bfloat16``); ``step()`` equals the wrapped optimizer's
   step on the mean gradient over the group, clipped by its global norm with
   ``max_grad_norm``; after a bf16 step no fp32 gradient copy is left on the shards; a second
   step after the first (another gradient) is as exact as the first.
C. Stage 3's gather, compute, free, P_p: ``gather_unit(full, shard, group=None,
   async_op=False, **labels)``, ``free_unit(full)``, ``ShardedFlatUnit.__init__`` and
   ``FlatStorage.gather``, ``.free``, ``.reduce``.
   ``free_unit`` releases the memory of ``full`` but keeps the tensor, its shape and every
   view into it (the model's parameters are such views). ``gather_unit`` makes ``full`` hold
   every rank's ``shard`` in rank order again, in ``full``'s dtype, whether or not its memory
   was released; with ``async_op`` it returns the collective's Handle, else None.
   A ``ShardedFlatUnit`` keeps a leaf fp32 shard (this rank's slice of the unit's flattened
   parameters) and a ``full`` buffer of N·k elements in ``dtype`` that the parameters are
   views of, its memory freed from the start. ``FlatStorage.gather(i)`` returns the Handle of
   unit i's gather, ``free(i)`` releases it, and ``reduce(i)`` adds this rank's mean gradient
   slice, in fp32, to the shard's ``.grad``: a second backward before the step accumulates.
D. Stage 3's schedule: when a unit is gathered, freed and reduce-scattered.
   ``UnitSchedule.pre_forward(i)``, ``.post_forward(i, out)`` (returns what the forward returns),
   ``.pre_backward(i)``, ``.reduce(i)``, ``.grad_ready(i, p)`` and ``.end_backward()`` in
   ``minipar.zero.stage3``: unit i's module's forward hooks call the first two, its parameters'
   post-accumulate-grad hooks ``grad_ready``, the first ``pre_backward`` of a backward queues
   ``end_backward`` for its end, and ``self.reduction`` (an ``OrderedReduction`` over
   ``self.order`` reversed, emptied by each forward of the model: ``reached(i)``,
   ``grad_ready(i, p)``) calls ``reduce(i)``. They act through ``self.gather(i, wait=True,
   **labels)`` and ``self.free(i)`` (which count ``peak_gathered_bytes``), ``self.storage.use(i,
   gathered)`` and ``self.storage.reduce(i)``, with ``self.bw`` (a flag per unit),
   ``self.prefetch`` and ``self.reshard``; ``finish_step`` (the library's) frees and
   reduce-scatters every unit last of all. Over any ``Storage``:

   * **a unit's forward runs only with its parameters gathered and in use (its shards again
     once it returns), its backward only with them gathered**;
   * **with ``prefetch``, the gather of the unit that computes next (the next one in a
     forward, the one before in a backward) starts before this one computes, without waiting
     for it**; **without it, a unit is gathered only when it computes**;
   * **with ``reshard_after_forward``, a unit is freed when its forward returns** **and again
     when its gradients are reduce-scattered**, so that **at most two units are gathered at once
     (one without prefetch)**, **as ``peak_gathered_bytes`` counts**; **without it, a unit is
     gathered once per step, at its first forward, and freed only by ``finish_step``**;
   * **with resharding, each backward reduce-scatters every unit's gradients once, after they
     are all in, in the reverse of this forward's order**; **without, none is reduce-scattered
     before ``finish_step``**;
   * **every later micro-batch and step runs the schedule of the first**.

Derived in notebook 06, "Each stage removes one redundancy", "What it costs in
communication" and "Stage 3 in time" (the paper's §5.1-5.3 and Figure 1). The last tests
train the GPT with the library's ZeRO stages 1, 2 and 3 running your code and compare with
one process. Stuck? ``minipar.hint("ex06", "A")`` (or "B", "C", "D"). Grade it with
``python -m minipar.grade ex06``.
"""
# Generated by `python -m minipar.course.exercise --write` from minipar's marked code.
# Replace each `raise NotImplementedError` with your code; `with minipar.exercise("ex06"):`
# runs the library with the functions below in place of its own (in every rank too).
# How to read around this exercise: each docstring below is a contract, clauses ex06.P.word that
# must hold (the grader names the clause a failure breaks); the steps are yours to design. Read
# the notebook, this file and, for each library name this file imports, its signature and
# docstring (help(name)): they say what it does, not how you use it. The library's own source of
# the functions below is their solution: do not open it. Stuck? minipar.hint("ex06") lists the
# parts; each call shows one more tier (a nudge, the idea, the steps).
from __future__ import annotations


# ------------------------------------------------------------------------------------------------
# from minipar/zero/reduce.py: these run as module minipar.zero.reduce's own
# ------------------------------------------------------------------------------------------------
import torch
from minipar.comm import group_rank, group_size, reduce_scatter


def reduce_shard(flat_grad: torch.Tensor, group=None, **labels) -> torch.Tensor:
    raise NotImplementedError("Exercise 06 A: reduce_shard")


def reduce_unit_grads(flat_unit, dtype=None, **labels) -> torch.Tensor:
    raise NotImplementedError("Exercise 06 A: reduce_unit_grads")


# ------------------------------------------------------------------------------------------------
# from minipar/zero/stage1.py: these run as module minipar.zero.stage1's own
# ------------------------------------------------------------------------------------------------
import torch
from minipar.comm import all_gather
from minipar.zero.clip import clip_grad_norm_
from minipar.zero.flat import FlatUnit, split_units


def sharded_step(flat_params, grad_shards, shards, optimizer, group=None) -> None:
    raise NotImplementedError("Exercise 06 B: sharded_step")


class ZeroOptimizer:
    """Only the marked methods of ``minipar.zero.stage1.ZeroOptimizer``; the rest of the class is
    the library's."""

    def __init__(self, params, optimizer_cls, group=None, param_dtype=None, max_grad_norm=None, **kwargs):
        self.group, self.max_grad_norm, self.grad_norm = group, max_grad_norm, None
        units = split_units(params)
        dtypes = {p.dtype for u in units for p in u}
        if dtypes != {torch.float32}:
            raise ValueError(f"{type(self).__name__} expects fp32 parameters (they become the "
                             f"master weights), got {dtypes}")
        raise NotImplementedError("Exercise 06 B: ZeroOptimizer.__init__")
        self._setup_grads()
        self.optim = optimizer_cls(self.shards, **kwargs)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def step(self) -> None:
        raise NotImplementedError("Exercise 06 B: ZeroOptimizer.step")

    def _step(self, grad_shards) -> None:
        raise NotImplementedError("Exercise 06 B: ZeroOptimizer._step")


# ------------------------------------------------------------------------------------------------
# from minipar/zero/flat.py: these run as module minipar.zero.flat's own
# ------------------------------------------------------------------------------------------------
import torch
import torch.nn as nn
from minipar.comm import all_gather
from minipar.zero.flat import FlatUnit


def gather_unit(full: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False, **labels):
    raise NotImplementedError("Exercise 06 C: gather_unit")


def free_unit(full: torch.Tensor) -> None:
    raise NotImplementedError("Exercise 06 C: free_unit")


class ShardedFlatUnit:
    """Only the marked methods of ``minipar.zero.flat.ShardedFlatUnit``; the rest of the class is
    the library's."""

    def __init__(self, module: nn.Module, params, group, dtype):
        raise NotImplementedError("Exercise 06 C: ShardedFlatUnit.__init__")


class FlatStorage:
    """Only the marked methods of ``minipar.zero.flat.FlatStorage``; the rest of the class is the
    library's."""

    def gather(self, i: int, **labels):
        raise NotImplementedError("Exercise 06 C: FlatStorage.gather")

    def free(self, i: int) -> None:
        raise NotImplementedError("Exercise 06 C: FlatStorage.free")

    def reduce(self, i: int) -> None:
        raise NotImplementedError("Exercise 06 C: FlatStorage.reduce")


# ------------------------------------------------------------------------------------------------
# from minipar/zero/stage3.py: these run as module minipar.zero.stage3's own
# ------------------------------------------------------------------------------------------------
import torch
from minipar.runtime import trace


class UnitSchedule:
    """Only the marked methods of ``minipar.zero.stage3.UnitSchedule``; the rest of the class is
    the library's."""

    def pre_forward(self, i: int) -> None:
        raise NotImplementedError("Exercise 06 D: UnitSchedule.pre_forward")
        self.t0[i] = trace.now()

    def post_forward(self, i: int, out):
        trace.record("compute", "forward", self.t0[i], trace.now(), unit=i)
        raise NotImplementedError("Exercise 06 D: UnitSchedule.post_forward")

    def pre_backward(self, i: int) -> None:
        if not self.in_backward:                           # the first unit of this backward
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        raise NotImplementedError("Exercise 06 D: UnitSchedule.pre_backward")
        self.t0[i] = trace.now()

    def reduce(self, i: int) -> None:
        trace.record("compute", "backward", self.t0[i], trace.now(), unit=i)
        self.held()
        raise NotImplementedError("Exercise 06 D: UnitSchedule.reduce")

    def grad_ready(self, i: int, p) -> None:
        raise NotImplementedError("Exercise 06 D: UnitSchedule.grad_ready")

    def end_backward(self) -> None:
        raise NotImplementedError("Exercise 06 D: UnitSchedule.end_backward")
        self.in_backward = False


if __name__ == "__main__":  # python exercises/ex06_zero.py grades this file
    import minipar
    minipar.grade("ex06")
