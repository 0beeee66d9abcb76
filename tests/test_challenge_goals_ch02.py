"""Challenge 02's goals can fail: synchronisers that miss one goal each are rejected, with a
message that names what was measured against the goal; minipar's own DDP is refused. One
misses the exposed goal by a small margin, so a goal loosened by half would be noticed."""
import types

import pytest
import torch

from minipar import comm
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch02_overlap as ch02
from minipar.data_parallel import DistributedDataParallel


def _module(cls):
    return types.SimpleNamespace(__name__="planted", GradSync=cls)


class _AfterBackward:
    """One flat all-reduce of every gradient, after the backward: nothing overlaps."""

    def __init__(self, model, group=None):
        self.params, self.group = list(model.parameters()), group

    def finish(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        comm.all_reduce(flat, op="avg", group=self.group, name="planted_flat")
        for p, g in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.grad = g.view_as(p).clone()


class _PerParameter:
    """Each gradient's own async all-reduce as soon as it is final, except those in ``held``,
    all-reduced in ``finish``; ``op`` "avg" or "sum"."""
    held: frozenset = frozenset()
    op = "avg"

    def __init__(self, model, group=None):
        self.group, self.handles, self.params = group, [], list(model.parameters())
        order = {id(p): i for i, p in enumerate(self.params)}
        self.keep = {id(p) for p in self.params if order[id(p)] in self.held}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        if id(p) not in self.keep:
            self.handles.append(comm.all_reduce(p.grad, op=self.op, group=self.group, async_op=True,
                                                name="planted_param"))

    def finish(self):
        for p in self.params:
            if id(p) in self.keep:
                self.handles.append(comm.all_reduce(p.grad, op=self.op, group=self.group, async_op=True,
                                                    name="planted_param"))
        for h in self.handles:
            h.wait()
        self.handles = []


def _held_share(fraction):
    """Indices of parameters, largest first, holding as much as fits in ``fraction`` of the bytes."""
    from minipar.models import GPT
    sizes = [p.numel() for p in GPT(ch02.CFG, seed=1).parameters()]
    held, total = [], 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if total + sizes[i] <= fraction * sum(sizes):
            held.append(i)
            total += sizes[i]
    return frozenset(held)


class _HeldBack(_PerParameter):
    held = _held_share(0.3)


class _Summed(_PerParameter):
    op = "sum"


class _Library:
    """minipar's own DDP (the library's answer to exercise 02), which syncs in its own hooks."""

    def __init__(self, model, group=None):
        self.ddp = DistributedDataParallel(model, group=group, bucket_cap_mb=0.004)

    def finish(self):
        pass


def test_all_reduce_after_backward_misses_the_exposed_goal():
    with pytest.raises(GradeFailure, match=r"exposed: rank \d, step \d: .*\(100%\)"):
        ch02.test_exposed_communication_goal(_module(_AfterBackward))


def test_holding_back_a_third_misses_the_exposed_goal_narrowly():
    shares = [s["exposed"] / s["sent"] for got in ch02._launch(_module(_HeldBack)) for s in got["steps"]]
    assert all(ch02.EXPOSED_GOAL < x < 1.5 * ch02.EXPOSED_GOAL for x in shares), shares
    with pytest.raises(GradeFailure, match=r"exposed: rank \d, step \d: .*\((2[6-9]|3[0-7])%\)"):
        ch02.test_exposed_communication_goal(_module(_HeldBack))


def test_one_call_per_parameter_meets_exposed_but_misses_the_calls_goal():
    ch02.test_exposed_communication_goal(_module(_PerParameter))
    with pytest.raises(GradeFailure, match=r"calls: rank \d made \[\d\d"):
        ch02.test_calls_goal(_module(_PerParameter))


def test_a_sum_misses_training_like_one_process():
    with pytest.raises((GradeFailure, AssertionError), match=r"gradient bytes|loss|step"):
        ch02.test_trains_like_one_process(_module(_Summed))


def test_the_library_answer_is_refused():
    with pytest.raises(GradeFailure, match=r"minipar's own reducer or DDP \(events named broadcast, grad_all_reduce\)"):
        ch02.test_trains_like_one_process(_module(_Library))
