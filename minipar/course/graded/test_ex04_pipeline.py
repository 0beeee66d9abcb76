"""Exercise 04: balance a model's layers across stages, and write the 1F1B schedule.

A. ``partition(costs, p)`` and its helper ``_min_max(prefix, p)``: cut L layers with costs
   ``costs`` into p contiguous, non-empty stages so that the most expensive stage is as cheap
   as possible (a pipeline runs at the pace of its slowest stage; notebook 04, "Load
   balancing"). ``partition`` returns the boundaries ``[0, b_1, ..., b_{p-1}, L]`` (stage s holds
   layers ``b_s`` to ``b_{s+1} - 1``) and raises ``ValueError`` unless 1 <= p <= L; any optimal
   split is accepted. ``_min_max`` gets the prefix sums (``prefix[j]``: the cost of the first j
   layers) and returns that optimal cost of the costliest stage, exactly (tested against brute
   force on random costs).

B. ``one_f_one_b(p, m, rank)``: the compute order of 1F1B (PipeDream-Flush, Narayanan et al.
   2021, §2.2) on ``rank`` of p for m micro-batches, a list of ``Action("F", i, rank)`` /
   ``Action("B", i, rank)``. It must be a valid schedule (no deadlock, each F before its B),
   keep GPipe's bubble, and let rank r hold at most min(p - r, m) micro-batches' activations
   at once, the least that keeps the pipeline full (notebook 04, "A schedule is data" and
   "Memory against theory"). Two bubble measures appear in the course, both with one
   definition each: relative to the ideal time, idle/busy = (p-1)/m (``pipeline.bubble`` and
   ``cost.bubble_fraction``, what the tests check), and as a fraction of the step,
   idle/(idle + busy) = (p-1)/(m+p-1); they describe the same idle time.

The last test trains the GPT on 4 ranks with the library's pipeline, cut by your partition
and scheduled by your 1F1B. Grade it with ``python -m minipar.grade ex04``; stuck?
``minipar.hint("ex04", "A")`` (parts A, B).
"""
import itertools
import random

import pytest

import minipar
from minipar.analysis import cost
from minipar import data, reference, strategy
from minipar import pipeline as pp
from minipar.course.grading import diagnose, expect, expect_equal, expect_same_training, expect_schedule
from minipar.models import GPT, GPTConfig

EXERCISE = "ex04_pipeline"
HINTS = {
    'A': (
        'Suppose you knew the cost limit c of the costliest stage: how would you check, in one '
        'pass, whether p stages within c exist? And how do you find the best c?',
        'Dynamic programming over (stages used, layers covered): the best cost of k stages over '
        'the first j layers is the best over the last cut i of the worse of (k-1 stages over i '
        'layers) and (layers i..j-1 in one stage). Then cut greedily from the front, never past '
        'the limit, leaving at least one layer for each remaining stage.',
        'best[0][0] = 0; best[k][j] = min over i < j of max(best[k-1][i], prefix[j] - prefix[i]);'
        ' _min_max returns best[p][L]. partition: ValueError unless 1 <= p <= len(costs); limit ='
        ' _min_max(prefix sums, p); walk the layers, close a stage before a layer would take it '
        'past the limit (or when only as many layers remain as stages still to fill); return [0, '
        'b_1, ..., L].',
    ),
    'B': (
        'When may rank r run its first backward? How many forwards has it started by then, and '
        'what does it gain from starting more?',
        'Warm-up: as many forwards as the ranks after you (capped at m); steady state: one '
        'forward of the next micro-batch, then one backward of the oldest unfinished one; '
        'cool-down: the remaining backwards.',
        'warmup = min(p - rank - 1, m); F0 .. F(warmup-1); for i in range(m - warmup): '
        'F(warmup+i), B(i); then B(m - warmup) .. B(m-1); every Action has stage = rank.',
    ),
}
TIMEOUT = 60


def _best(costs, p):
    L, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, L), p - 1):
        b = [0, *cuts, L]
        best = min(best, max(sum(costs[x:y]) for x, y in zip(b[:-1], b[1:])))
    return best


def test_partition_is_valid(impl):
    """partition returns p+1 increasing boundaries from 0 to L (no empty stage)."""
    for costs, p in [([1, 1, 1, 1], 2), ([5], 1), ([3, 1, 4, 1, 5], 5), ([1, 2, 3], 1)]:
        b = list(pp.partition(costs, p))
        case = f"partition({costs}, p={p})"
        expect_equal(len(b), p + 1, f"{case}: number of boundaries (p + 1) in {b}")
        expect_equal((b[0], b[-1]), (0, len(costs)), f"{case}: first and last boundary (0 and L) of {b}")
        empty = [s for s, (x, y) in enumerate(zip(b[:-1], b[1:])) if x >= y]
        expect(not empty, f"{case} = {b}: stage {empty[0] if empty else ''} is empty "
                          "(boundaries must increase strictly: every stage holds a layer)")


def test_partition_is_balanced(impl):
    """The costliest stage is as cheap as possible (checked against brute force)."""
    rng = random.Random(1)
    for _ in range(60):
        L = rng.randint(1, 9)
        costs = [rng.choice([1, 2, 3, 5, 8, 13, 40]) for _ in range(L)]
        p = rng.randint(1, L)
        b = pp.partition(costs, p)
        stages = [sum(costs[x:y]) for x, y in zip(b[:-1], b[1:])]
        expect_equal(max(stages), _best(costs, p),
                     f"partition({costs}, p={p}) = {b}, stage costs {stages}: the costliest stage "
                     "(the best split's costliest is the expected)")


def test_partition_rejects_too_many_stages(impl):
    """More stages than layers is a ValueError."""
    try:
        got = pp.partition([1.0, 2.0], 3)
    except ValueError:
        return
    expect(False, f"partition([1.0, 2.0], p=3) returned {got}; 3 stages of 2 layers is a ValueError")


def test_one_f_one_b_order(impl):
    """The 1F1B order on the first and last of 4 ranks, 6 micro-batches."""
    fmt = lambda acts: [f"{a.op}{a.microbatch}" for a in acts]  # noqa: E731
    expect_schedule({r: fmt(pp.one_f_one_b(4, 6, r)) for r in (0, 3)},
                    {0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split(), 3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()},
                    "1F1B schedule, p = 4, m = 6")
    expect_schedule({1: fmt(pp.one_f_one_b(4, 2, 1))}, {1: "F0 F1 B0 B1".split()}, "1F1B schedule, p = 4, m = 2")
    stages = [a.stage for a in pp.one_f_one_b(4, 5, 2)]
    expect_equal(stages, [2] * len(stages), "the stage of each action one_f_one_b(4, 5, rank=2) returns", keys="action")


def test_one_f_one_b_is_a_valid_schedule(impl):
    """For p = 1..5 and m = 1..9: no deadlock, F before B, 1F1B's bubble and memory."""
    for p in range(1, 6):
        for m in range(1, 10):
            fmt = {r: [f"{a.op}{a.microbatch}" for a in pp.one_f_one_b(p, m, r)] for r in range(p)}
            want = {r: [f"{a.op}{a.microbatch}" for a in _one_f_one_b(p, m, r)] for r in range(p)}
            with diagnose(m < p, f"m = {m} < p = {p}: the warm-up can only be m forwards"):
                expect_schedule(fmt, want, f"1F1B schedule, p = {p}, m = {m}")
            s = pp.make_schedule("1f1b", p, m)
            pp.check_schedule(s)
            expect_equal(pp.peak_stash(s), [min(p - r, m) for r in range(p)],
                         f"p = {p}, m = {m}: peak micro-batches held, per rank", keys="rank")
            bubble = max(pp.bubble(s))
            expect(bubble == pytest.approx(cost.bubble_fraction("1f1b", p, m)),
                   f"p = {p}, m = {m}: bubble {bubble:.4f}, expected 1F1B's (p-1)/(m+p-1) = "
                   f"{cost.bubble_fraction('1f1b', p, m):.4f}")


def _one_f_one_b(p, m, rank):
    """The expected order, written independently: warm-up, alternate, cool-down."""
    from collections import namedtuple
    Act = namedtuple("Act", "op microbatch")
    warm = min(p - rank - 1, m)
    out = [Act("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out += [Act("F", f), Act("B", b)]
        f, b = f + 1, b + 1
    return out + [Act("B", i) for i in range(b, m)]


CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def _train(p, m):
    model = GPT(CFG, seed=0)
    bounds = pp.partition(pp.layer_costs(model.layers()), p)
    return pp.train(model, data.batches(data.synthetic_tokens(1000), 3, 8, 8), reference.sgd(0.5),
                    schedule="1f1b", microbatches=m, bounds=bounds)


def test_trains_the_gpt(impl):
    """Your partition and 1F1B train the GPT on 4 ranks like one process (1e-5)."""
    results = minipar.launch(_train, 4, args=(4, 4), timeout=TIMEOUT)
    want = reference.train_reference(GPT(CFG, seed=0), data.batches(data.synthetic_tokens(1000), 3, 8, 8),
                                     reference.sgd(0.5))
    got = strategy.TrainResult.merge(results)
    expect_same_training(got, want, "the GPT on 4 pipeline stages", rtol=1e-5, atol=1e-6)
    expect_equal([m["peak_stash"] for m in got.measured], [4, 3, 2, 1],
                 "peak micro-batches held, per rank (measured while training)", keys="rank")
