"""Schedules as data, checked on paper: validity, deadlock-freedom, bubble and memory
against the formulas, balanced partitions, and clear errors for bad configurations."""
import itertools
import random

import pytest

from minipar import cost
from minipar import pipeline as pp
from minipar.pipeline.schedules import Action, Schedule, add_comms
from minipar.pipeline.simulate import UNIT

CONFIGS = [(name, p, m, v)
           for name in pp.SCHEDULES for p in range(1, 6) for m in range(1, 10)
           for v in ((2, 3) if name == "interleaved" else (1,))
           if not (name == "interleaved" and m % p)]


def test_every_schedule_is_valid_and_deadlock_free():
    """Each F before its B (before its W), every send received in order, no deadlock."""
    for name, p, m, v in CONFIGS:
        s = pp.make_schedule(name, p, m, v)
        pp.check_schedule(s)
        for r in range(p):  # one F and one B (and W) per micro-batch and owned stage
            ops = [a.op for a in s.compute(r)]
            assert ops.count("F") == ops.count("B") == m * v, (name, p, m, v, r)
            assert ops.count("W") == (m if name == "zb-h1" else 0)


def test_simulated_bubble_and_stash_match_theory():
    """The simulator's bubble and peak stash equal cost.bubble_fraction / peak_activations."""
    for name, p, m, v in CONFIGS:
        s = pp.make_schedule(name, p, m, v)
        got = pp.bubble(s)
        want = cost.bubble_fraction(name, p, m, v)
        assert max(got) == pytest.approx(want, abs=1e-9), (name, p, m, v, got, want)
        assert pp.peak_stash(s) == [cost.peak_activations(name, p, m, r, v) for r in range(p)], \
            (name, p, m, v)


def test_theory_values():
    """Spot values of the formulas: (p-1)/m, (p-1)/(vm), a third for ZB-H1; stashes."""
    assert cost.bubble_fraction("gpipe", 4, 8) == cost.bubble_fraction("1f1b", 4, 8) == 3 / 8
    assert cost.bubble_fraction("interleaved", 4, 8, v=2) == 3 / 16
    assert cost.bubble_fraction("zb-h1", 4, 8) == pytest.approx(3 / 24)
    assert [cost.peak_activations("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [cost.peak_activations("gpipe", 4, 8, r) for r in range(4)] == [8] * 4
    s = pp.make_schedule("zb-h1", 4, 8)
    t = pp.simulate(s, f=1, b=1, w=1)
    span = max(e["end"] for e in t.events()) / UNIT
    assert span == pytest.approx(8 * 3 + 3 * (1 + 1 - 1))  # ideal + (p-1)(F+B-W)


def test_one_f_one_b_order():
    """1F1B on rank 0 of 4 with 6 micro-batches: 3 warm-up Fs, F/B pairs, cool-down Bs."""
    got = [f"{a.op}{a.microbatch}" for a in pp.one_f_one_b(4, 6, 0)]
    assert got == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert [f"{a.op}{a.microbatch}" for a in pp.one_f_one_b(4, 6, 3)] == \
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()


def test_checker_catches_bad_schedules():
    """The checker rejects a deadlock, a B before its F and a lost message."""
    p, m = 2, 2
    # rank 0 waits for the gradient of micro-batch 0 before sending any activation
    bad = [[Action("B", 0, 0), Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
           pp.one_f_one_b(p, m, 1)]
    with pytest.raises(AssertionError, match="before"):
        pp.check_schedule(Schedule("1f1b", p, m, 1, [add_comms(o, p, p) for o in bad]))
    # receives in the wrong order: rank 1 reads micro-batch 1's activation first
    swapped = [pp.one_f_one_b(p, m, 0),
               [Action("F", 1, 1), Action("B", 1, 1), Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(AssertionError, match="channel"):
        pp.check_schedule(Schedule("1f1b", p, m, 1, [add_comms(o, p, p) for o in swapped]))
    # a true deadlock: both ranks receive before they send
    dead = Schedule("1f1b", 2, 1, 1, [[Action("RECV_B", 0, 0, 1), Action("SEND_F", 0, 0, 1)],
                                      [Action("RECV_F", 0, 1, 0), Action("SEND_B", 0, 1, 0)]])
    with pytest.raises(pp.Deadlock, match="rank 0 waits"):
        pp.simulate(dead)
    lost = pp.make_schedule("1f1b", 2, 2)
    lost.actions[1] = [a for a in lost.actions[1] if a.op != "RECV_F" or a.microbatch]
    with pytest.raises(AssertionError):
        pp.check_schedule(lost)


def _brute_force(costs, p):
    L = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, L), p - 1):
        b = [0, *cuts, L]
        best = min(best, max(sum(costs[x:y]) for x, y in zip(b[:-1], b[1:])))
    return best


def test_partition_is_optimal_and_explained():
    """partition() minimises the costliest stage (brute force agrees), stages non-empty."""
    rng = random.Random(0)
    for _ in range(40):
        L = rng.randint(1, 9)
        costs = [rng.choice([1, 2, 3, 5, 8, 13]) for _ in range(L)]
        for p in range(1, L + 1):
            b = pp.partition(costs, p)
            assert b[0] == 0 and b[-1] == L and len(b) == p + 1
            assert all(x < y for x, y in zip(b[:-1], b[1:])), b
            assert max(pp.stage_costs(costs, b)) == _brute_force(costs, p), (costs, p, b)
    costs = [10, 1, 1, 1, 1, 10]
    b = pp.partition(costs, 3)
    assert pp.stage_costs(costs, b) == [10, 4, 10] and pp.balance(costs, b) == pytest.approx(0.8)
    assert "balance 0.80" in pp.explain(costs, b)


def test_layer_costs_of_the_gpt():
    """Parameter counts per layer add up to the model's; timed costs are positive."""
    import torch
    from minipar.models import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=2, n_embd=16, block_size=8))
    c = pp.layer_costs(model.layers())
    assert sum(c) == sum(q.numel() for q in model.parameters()) and len(c) == 4
    t = pp.layer_costs(model.layers(), by="time", sample=torch.zeros(2, 8, dtype=torch.long), repeats=1)
    assert len(t) == 4 and all(x > 0 for x in t)


def test_bad_configurations_are_clear_errors():
    """More stages than layers, interleaving with m % p != 0 or v = 1, unknown names: ValueError."""
    with pytest.raises(ValueError, match="more stages than layers"):
        pp.partition([1.0] * 3, 4)
    with pytest.raises(ValueError, match="only 6 layers"):
        pp.make_schedule("1f1b", 8, 8, n_layers=6)
    with pytest.raises(ValueError, match="only 6 layers"):
        pp.make_schedule("interleaved", 4, 8, v=2, n_layers=6)
    with pytest.raises(ValueError, match="not a multiple of p"):
        pp.make_schedule("interleaved", 4, 6, v=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        pp.make_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="interleaved"):
        pp.make_schedule("1f1b", 2, 4, v=2)
    with pytest.raises(ValueError, match="v >= 2"):          # v=1 interleaved is not 1F1B
        pp.make_schedule("interleaved", 2, 4, v=1)
    with pytest.raises(TypeError, match="order_fn"):         # once ignored by all but 1F1B; exercises
        pp.make_schedule("gpipe", 2, 4, order_fn=pp.gpipe)   # plug in through minipar.course.exercise
    with pytest.raises(ValueError):
        cost.bubble_fraction("nope", 2, 2)
