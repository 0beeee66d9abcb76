"""ch09's goals can fail: a routing missing any one of them (balance, drops, fidelity, a valid
assignment) is rejected with a message naming the measured value against the goal, and the
library's own routing (plain top-k, with or without its capacity) does not pass the challenge."""
import types

import pytest
import torch

from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch09_routing as ch09
from minipar.course.graded.alternatives import ch09_routing as alternative
from minipar.models.moe import capacity, keep_within_capacity, route


def _module(fn):
    return types.SimpleNamespace(__name__="planted", route=fn)


def _top_k(logits, k):
    return route(logits, k)[2]


def _top_k_within(factor):
    def fn(logits, k):
        experts = _top_k(logits, k)
        S, E = logits.shape
        keep = keep_within_capacity(experts.reshape(-1), E, capacity(S, E, k, factor)).view(S, k)
        return torch.where(keep, experts, -1)
    return fn


def _round_robin(logits, k):    # every expert the same load, whatever the router says
    S, E = logits.shape
    return (torch.arange(S).unsqueeze(1) * k + torch.arange(k)) % E


GOALS = (ch09.test_busiest_expert, ch09.test_dropped_assignments, ch09.test_router_fidelity)


def test_a_valid_answer_passes():
    m = _module(alternative.route)
    for goal in GOALS:
        goal(m)


def test_plain_top_k_misses_the_balance_goal():
    m = _module(_top_k)
    with pytest.raises(GradeFailure, match=r"busiest: 1\.[5-9]\d\d on S=4096, E=8, k=2, the goal is at most 1\.3"):
        ch09.test_busiest_expert(m)
    ch09.test_dropped_assignments(m)
    ch09.test_router_fidelity(m)


def test_a_capacity_misses_the_drops_goal():
    m = _module(_top_k_within(1.25))
    ch09.test_busiest_expert(m)
    with pytest.raises(GradeFailure, match=r"dropped: 0\.0[5-9]\d on S=4096, E=8, k=2, the goal is under 5%"):
        ch09.test_dropped_assignments(m)


def test_ignoring_the_router_misses_the_fidelity_goal():
    m = _module(_round_robin)
    ch09.test_busiest_expert(m)
    ch09.test_dropped_assignments(m)
    with pytest.raises(GradeFailure, match=r"fidelity: 0\.[3-6]\d\d on S=4096, E=8, k=2, the goal is at least 0\.95"):
        ch09.test_router_fidelity(m)


@pytest.mark.parametrize("bad, match", [
    (lambda logits, k: _top_k(logits, k)[:, :1].repeat(1, k), r"E=8, k=2: token 0 is sent twice to expert \d"),
    (lambda logits, k: _top_k(logits, k) + 1, r"E=8, k=2: experts must be 0 \.\. 7 or -1"),
    (lambda logits, k: _top_k(logits, 1), r"route's output shape for S=4096, k=2")])
def test_an_invalid_assignment_is_refused(bad, match):
    with pytest.raises(GradeFailure, match=match):
        ch09.test_busiest_expert(_module(bad))


def test_the_librarys_routing_does_not_pass():
    """minipar.models.moe.route (plain top-k) and its capacity at 1.25 or 1.3 each miss a goal."""
    for fn in (_top_k, _top_k_within(1.25), _top_k_within(1.3)):
        m = _module(fn)
        missed = []
        for goal in GOALS:
            try:
                goal(m)
            except GradeFailure:
                missed.append(goal.__name__)
        assert missed, fn
