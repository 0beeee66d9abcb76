"""Exercise 04: a pipeline, from the cut to the step: balance the stages, schedule 1F1B, and
walk one rank's schedule.

A. ``partition(costs, p)`` and its helper ``_min_max(prefix, p)``: cut L layers into p stages
   (a pipeline runs at the pace of its slowest stage; notebook 04, "Load balancing").
B. ``one_f_one_b(p, m, rank)``: the compute order of 1F1B (PipeDream-Flush, Narayanan et al.
   2021, §2.2) on ``rank`` of p for m micro-batches (notebook 04, "A schedule is data" and
   "Memory against theory"). Two bubble measures appear in the course, both with one
   definition each: relative to the ideal time, idle/busy = (p-1)/m (``pipeline.bubble`` and
   ``cost.bubble_fraction``, what the tests check), and as a fraction of the step,
   idle/(idle + busy) = (p-1)/(m+p-1); they describe the same idle time.
C. The schedule made runnable, and run: ``add_comms(order, p, n_stages)`` turns a rank's compute
   order into its actions, and ``Pipeline.step(inputs, targets)`` (with ``SEND_F``/``RECV_F``)
   walks them for one batch.

Each function's docstring below is its contract: clauses ``ex04.P.word`` that must hold (the
grader names the clause a failure breaks). The last tests train the GPT on 2 ranks
(interleaved, 2 virtual stages each, your add_comms and step) and on 4 ranks with the
library's pipeline, cut by your partition and scheduled by your 1F1B, equal to one process.
Grade it with ``python -m minipar.grade ex04``; stuck? ``minipar.hint("ex04", "A")`` (parts A,
B, C).
"""
import itertools
import random

import pytest
import torch

import minipar
from minipar import cost
from minipar import data, reference, strategy
from minipar import pipeline as pp
from minipar.course.grading import diagnose, expect, expect_close, expect_equal, expect_same_training, expect_schedule, observes
from minipar.pipeline.schedules import Action
from minipar.models import GPT, GPTConfig

EXERCISE = "ex04_pipeline"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNo9jd0NwjAMhFe5AToBLxUzMEFxXGI1xBF2ZNieNEg83s93d+utqTE+2nFUDnhmkJqjyFMcBN3/X'
        'hEegfn24AuyBkJ7SZOlzHQskAqtjLaZLYjMg3yh/RBDiOfRIPBbzFdca5ozSefGLkOfX/fzhtYvVJI3qw==',
        'sealed:eNpVkEEOwjAMBL+yx1aCSlw58wQ+YFq3NTQOcgKovyduC4hLlHh3Z62cZqUgLe4WB6MQRAfEJxuql'
        'GnghEfiboeJZraE1iXu6iPyyLhwymVUjtjjhi2wpF3uxYp0/WQl/UJfz0SOeGSIM3zyipbYH9Vtf/hjykaqQ'
        'dqh+mCb5lqMoojKq79ucB5ZF+5gzJ1MM3qLYV3LouYdlJ159/5lEQlSphPT07+Asl99U+W1Fn00MLUjjAOJu'
        'mtpa95yLnH9',
        'sealed:eNo1UMtugzAQ/JU5UokguDbJsbeee0EWMunSOCw28poS/r5raCTL+/Ds7Ix7ktTWRg+uqM/ocz2a9'
        'pHryXmEX4pwuOCBMGCyz+KAnBrTOlNijjS4Z8afXrkzb2d0OtwpHJHSEr0czLNpP02F2cbkkgv+HV+WF/qIM'
        'UQsnkkEDS5XzPli8sUtSBLlYze5pJpevMWxDLJMoioUsVoeke4EthtFbd44CMFCkv0h3T+EmMv9GWtY+BvJj'
        'gTlna2kY3ZfU6ia9U7q3vMGK+rbb/+8amiy+jHa3YlzcMxIAYNGFXI4RluX6LumRFVVJdT2H5YyfAs=',
    ),
    'B': (
        'sealed:eNolzEEOwyAMRNGrzAFyh2x7g6ydAAFF2NLYFeL2pe326+kfNSu6TFD0AcG3ooWjNHrglOsZwrTjZ'
        'WMxnSjGb3FU8SXhIYyccE7Eem0QTRhVAsnyT9zSFIXW/7bpjW7M+weymSxU',
        'sealed:eNpNjlEOwjAMQ6/iT5AoB9gOwnfWpmzamlRtprHb0w2B+IriPNt5UEluzR2oIpHsiFo2KqEego2MQ'
        'jK3JRoX7Lri4ilnDiBDuvaoxhT2Nsi4gwp/A6Dx9Au/Gjn5om4g8+PtUOUkB/LzP6pL4GpYJU4y1bGVNKqHV'
        '11c0E26z0OcqN3l+fPX+xtn9kcb',
        'sealed:eNpNzsEKgzAMBuBX+Y8tatHrxg7u4HsUiRpGo9RO2dsvVRBPCX8+wr/7GL4LXggsZkGF6OWjoykR7'
        'BNdDefQmf1gVaPRMEcwWLIcyQTF59U+LliwLfE2rDxNJLreWP6owfGMNoo/tH3iWTD5FWvyI2mdXMP9AU4CL'
        'yQ=',
    ),
    'C': (
        'sealed:eNptjcERgzAMBFu5AtKDJ1Xw1uADexJbjCWgfQSTZ7572tVU6lwgs1fthk5mCJzddMCLOKSrFw6Yy'
        '0o0yXwFyzgfscmH0M5/t3fMEqYgRFbajxu+9WDC+6mE1nYLN1ZuWHSsdOgSRWIbPKrudr9IF6slPWQ=',
        'sealed:eNo1UMtOAzEM/JU5ggiVeoUbUI49gMTdm3hJtLvJKvaW9u9x0vYSOWPPQ/OJMkKUfhmCyp7TiQVjL'
        'QvkeQ/KAcI5CLRAnvYOb9DIKPZU/NEFtWw5OPDZ86og7esxVdFOnsmGrv/aNysbL5lcpBuOpYRtLlh39uf1B'
        'T6yn/rxQOojQjqlwOLgN0VS12jV1C0lS8RcRDom0SHloZy7cdnURiPRPHexhTWWgEwLBwwXMJk2eU0lGw2lB'
        'q4O47yZZr+nNHcFa8WWt/Q0tcLa3B13+D4cP6A0sXRUOUupzf1+dw/ydXj/wbrp9e5WteXM3Owb1sM7DFYur'
        'FQr6mFKrdzkrlU97v4BQhGVqQ==',
        'sealed:eNqFUMtuwjAQ/JW9VIqFccM1gQsUjj0UiUsURYvjkIgktmynoqr67107UI6VvFrteGb2gXVdST0ML'
        'oNGWzi8bjkkzkoOtfMMNlQsVxzcYsVmQvheBGR5R7Y5fOx3p0qbpCOYnpXwAobBWdG/gq6BFNabiK9hrJzHi'
        'yLecf/+9lRRu1mFjVf2TxTgp0iA88pkcMJ+UntrdSR2o5m8E65Fo4q0JJshhxt5flH02jlaQ7bTeKXykVOR5'
        'mSGruWkP+sbBz15ysQ9BjhhHL5/QuRxTSQaoPSdHl1hcbyWGVyUR+9t4lTfcEChDUuQ5TBg14umn4JLDkbht'
        'YqtyDtmESAxH+CQzXSnxjrBxxTC0GGS4FgsV2XwHjpp9Rm9bEMVz8EYu9+eTOISxT+KkiaI3aySnzSq+AWCj'
        'aHI',
    ),
}
TIMEOUT = 60


def _best(costs, p):
    L, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, L), p - 1):
        b = [0, *cuts, L]
        best = min(best, max(sum(costs[x:y]) for x, y in zip(b[:-1], b[1:])))
    return best


@observes("ex04.A.valid")
def test_partition_is_valid(impl):
    """partition returns p+1 increasing boundaries from 0 to L (no empty stage)."""
    for costs, p in [([1, 1, 1, 1], 2), ([5], 1), ([3, 1, 4, 1, 5], 5), ([1, 2, 3], 1)]:
        b = list(pp.partition(costs, p))
        case = f"partition({costs}, p={p})"
        expect_equal(len(b), p + 1, f"{case}: number of boundaries (p + 1) in {b} (p contiguous, non-empty stages)")
        expect_equal((b[0], b[-1]), (0, len(costs)), f"{case}: first and last boundary (0 and L) of {b} "
                     "(p contiguous, non-empty stages)")
        empty = [s for s, (x, y) in enumerate(zip(b[:-1], b[1:])) if x >= y]
        expect(not empty, f"{case} = {b}: stage {empty[0] if empty else ''} holds no layer "
                          "(p contiguous, non-empty stages)")


@observes("ex04.A.optimal")
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
                     f"partition({costs}, p={p}) = {b}, stage costs {stages}: the costliest stage, the best "
                     "split's being the expected (the most expensive stage is as cheap as possible)")


@observes("ex04.A.range")
def test_partition_rejects_too_many_stages(impl):
    """More stages than layers is a ValueError."""
    try:
        got = pp.partition([1.0, 2.0], 3)
    except ValueError:
        return
    expect(False, f"partition([1.0, 2.0], p=3) returned {got}, expected a ValueError (raises ``ValueError`` "
                  "unless 1 <= p <= L)")


@observes("ex04.B.valid")
def test_one_f_one_b_order(impl):
    """The 1F1B order on the first and last of 4 ranks, 6 micro-batches."""
    fmt = lambda acts: [f"{a.op}{a.microbatch}" for a in acts]  # noqa: E731
    expect_schedule({r: fmt(pp.one_f_one_b(4, 6, r)) for r in (0, 3)},
                    {0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split(), 3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()},
                    "1F1B schedule, p = 4, m = 6 (a valid schedule (no deadlock, each F before its B))")
    expect_schedule({1: fmt(pp.one_f_one_b(4, 2, 1))}, {1: "F0 F1 B0 B1".split()},
                    "1F1B schedule, p = 4, m = 2 (a valid schedule (no deadlock, each F before its B))")
    stages = [a.stage for a in pp.one_f_one_b(4, 5, 2)]
    expect_equal(stages, [2] * len(stages), "the stage of each action one_f_one_b(4, 5, rank=2) returns", keys="action")


@observes("ex04.B.valid", "ex04.B.bubble", "ex04.B.memory")
def test_one_f_one_b_is_a_valid_schedule(impl):
    """For p = 1..5 and m = 1..9: no deadlock, F before B, 1F1B's bubble and memory."""
    for p in range(1, 6):
        for m in range(1, 10):
            s = pp.make_schedule("1f1b", p, m)
            try:
                pp.check_schedule(s)
            except (AssertionError, pp.Deadlock) as e:
                expect(False, f"p = {p}, m = {m}: check_schedule says {e} (a valid schedule (no deadlock, each F "
                              f"before its B))\n{s.table()}")
            bubble = max(pp.bubble(s))
            expect(bubble == pytest.approx(cost.bubble_fraction("1f1b", p, m)),
                   f"p = {p}, m = {m}: bubble {bubble:.4f}, expected GPipe's (p-1)/m = "
                   f"{cost.bubble_fraction('1f1b', p, m):.4f} (keep GPipe's bubble)\n{s.table()}")
            expect_equal(pp.peak_stash(s), [min(p - r, m) for r in range(p)],
                         f"p = {p}, m = {m}: peak micro-batches held, per rank (rank r hold at most min(p - r, m) "
                         "micro-batches)", keys="rank")
            fmt = {r: [f"{a.op}{a.microbatch}" for a in pp.one_f_one_b(p, m, r)] for r in range(p)}
            want = {r: [f"{a.op}{a.microbatch}" for a in _one_f_one_b(p, m, r)] for r in range(p)}
            with diagnose(m < p, f"m = {m} < p = {p}"):
                expect_schedule(fmt, want, f"1F1B schedule, p = {p}, m = {m}")


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


@observes("ex04.B.memory", "ex04.C.peak")
def test_trains_the_gpt(impl):
    """Your partition and 1F1B train the GPT on 4 ranks like one process (1e-5)."""
    results = minipar.launch(_train, 4, args=(4, 4), timeout=TIMEOUT)
    want = reference.train_reference(GPT(CFG, seed=0), data.batches(data.synthetic_tokens(1000), 3, 8, 8),
                                     reference.sgd(0.5))
    got = strategy.TrainResult.merge(results)
    expect_same_training(got, want, "the GPT on 4 pipeline stages", rtol=1e-5, atol=1e-6)
    expect_equal([m["peak_stash"] for m in got.measured], [4, 3, 2, 1],
                 "peak micro-batches held, per rank, measured while training (rank r hold at most min(p - r, m) "
                 "micro-batches; the most micro-batches held at once)", keys="rank")


def _add_comms(order, p, n_stages):
    """The expected actions, written independently: each F/B with its receive before and its send after."""
    out = []
    for a in order:
        if a.op == "W":
            out.append(a)
            continue
        src, dst = (a.stage - 1, a.stage + 1) if a.op == "F" else (a.stage + 1, a.stage - 1)
        if 0 <= src < n_stages:
            out.append(Action("RECV_" + a.op, a.microbatch, a.stage, src % p))
        out.append(a)
        if 0 <= dst < n_stages:
            out.append(Action("SEND_" + a.op, a.microbatch, a.stage, dst % p))
    return out


@observes("ex04.C.comms", "ex04.C.peer")
def test_add_comms(impl):
    """add_comms on GPipe (3 ranks), ZB-H1 (3 ranks, with W) and interleaved 1F1B (2 ranks, 2 virtual
    stages each): every rank's actions, sends and receives in place, peers the ranks of the stages."""
    cases = [("GPipe, p = 3, m = 2", 3, 1, lambda r: pp.gpipe(3, 2, r)),
             ("ZB-H1, p = 3, m = 3", 3, 1, lambda r: pp.zb_h1(3, 3, r)),
             ("interleaved 1F1B, p = 2, m = 2, v = 2", 2, 2, lambda r: pp.interleaved_1f1b(2, 2, r, 2))]
    for name, p, v, order in cases:
        for r in range(p):
            got = [repr(a) for a in pp.add_comms(order(r), p, p * v)]
            want = [repr(a) for a in _add_comms(order(r), p, p * v)]
            expect_equal(got, want, f"{name}: rank {r}'s actions, printed op, micro-batch, s, stage, ->/<- peer "
                         "(a receive right before every F or B that needs a tensor from another stage, a send "
                         "right after every F or B that produced one; the peer of a message is the rank holding "
                         "the other stage)", keys="action")


CUT = [0, 2, 3, 4, 6]      # the GPT's 6 layers in 4 stages, fixed (part A not needed here)


def _step_case():
    from minipar.comm import group_rank
    batches = data.batches(data.synthetic_tokens(1000), 3, 8, 8)
    trained = pp.train(GPT(CFG, seed=0), batches, reference.sgd(0.5), schedule="interleaved", microbatches=4,
                       virtual_stages=2, bounds=CUT)
    layers, r, bounds = GPT(CFG, seed=0).layers(), group_rank(), [0, 3, 6]
    x, y = batches[0]
    pipe = pp.Pipeline(pp.build_stages(layers, bounds, r, 2), pp.make_schedule("gpipe", 2, 4),
                       pp.boundary_shapes(layers, bounds, x.chunk(4)[0]).__getitem__)
    returned = pipe.step(x, y)
    import torch.distributed as dist
    alone = [dist.new_group([q]) for q in range(2)][r]      # a one-rank pipeline: no message to wait for
    whole = pp.Pipeline(pp.build_stages(layers, [0, 6], 0, 1), pp.make_schedule("gpipe", 1, 4),
                        pp.boundary_shapes(layers, [0, 6], x.chunk(4)[0]).__getitem__, alone)
    try:
        whole.step(x[:7], y[:7])
        refused = False
    except ValueError:
        refused = True
    except Exception as e:     # a step that ran on the uneven micro-batches and broke
        refused = type(e).__name__
    return {"trained": trained, "returned": returned, "refused": refused}


@observes("ex04.C.peer", "ex04.C.divide", "ex04.C.loss", "ex04.C.clean")
def test_pipeline_step(impl):
    """On 2 ranks: your step and add_comms train the GPT interleaved (2 virtual stages per rank, 3
    steps) like one process; a GPipe step returns the mean loss on rank 1 only; a batch of 7 for
    m = 4 is a ValueError (on a one-rank pipeline)."""
    results = minipar.launch(_step_case, 2, timeout=TIMEOUT)
    batches = data.batches(data.synthetic_tokens(1000), 3, 8, 8)
    want = reference.train_reference(GPT(CFG, seed=0), batches, reference.sgd(0.5))
    returned = [res["returned"] for res in results]
    expect(returned[0] is None and isinstance(returned[1], float),
           f"Pipeline.step returned {returned} on ranks 0, 1 (GPipe on 2 ranks), expected [None, a float] (returns "
           "the batch's mean loss on the rank holding the last stage, None elsewhere)")
    expect_close(torch.tensor(returned[1]), torch.tensor(want["losses"][0]), "rank 1's Pipeline.step return, the "
                 "batch's mean loss", where="GPipe on 2 ranks, m = 4, first step", rtol=1e-5, atol=1e-6)
    expect_equal([res["refused"] for res in results], [True, True], "a ValueError for a batch of 7 with m = 4, "
                 "per rank (a batch m does not divide is a ValueError)", keys="rank")
    got = strategy.TrainResult.merge([res["trained"] for res in results])
    with diagnose(lambda f: "step 0" not in str(f) and "parameter" not in str(f),
                  "step 0's loss equals one process's, a later step's does not"):
        expect_same_training(got, want, "the GPT interleaved on 2 ranks, 2 virtual stages each (the peer of a "
                             "message is the rank holding the other stage; a second step starts from a clean state)",
                             rtol=1e-5, atol=1e-6)
