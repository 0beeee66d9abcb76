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
from minipar.course import grading
from minipar.course.grading import (GradeFailure, breaks, diagnose, expect, expect_close, expect_equal,
                                    expect_same_training, hang_breaks, observes)
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
TIMEOUT = grading.LAUNCH_TIMEOUT


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


def _random_cases(seed: int, n: int, most_layers: int):
    """``n`` random (layer costs, p) pairs, p between 1 and the number of layers."""
    rng = random.Random(seed)
    for _ in range(n):
        costs = [rng.choice([1, 2, 3, 5, 8, 13, 40]) for _ in range(rng.randint(1, most_layers))]
        yield costs, rng.randint(1, len(costs))


@observes("ex04.A.optimal")
def test_partition_is_balanced(impl):
    """The costliest stage is as cheap as possible (checked against brute force)."""
    for costs, p in _random_cases(seed=1, n=60, most_layers=9):
        b = pp.partition(costs, p)
        stages = [sum(costs[x:y]) for x, y in zip(b[:-1], b[1:])]
        expect_equal(max(stages), _best(costs, p),
                     f"partition({costs}, p={p}) = {b}, stage costs {stages}: the costliest stage, the best "
                     "split's being the expected (the most expensive stage is as cheap as possible)")


@observes("ex04.A.optimal")
def test_min_max_is_the_best_costliest_stage(impl):
    """_min_max(prefix, p) on its own: the cost of the costliest stage of the best split (brute force)."""
    from minipar.model_parallel.partition import _min_max
    for costs, p in _random_cases(seed=2, n=40, most_layers=8):
        prefix = [sum(costs[:j]) for j in range(len(costs) + 1)]
        got = _min_max([float(x) for x in prefix], p)
        expect_equal(got, float(_best(costs, p)),
                     f"_min_max({prefix}, p={p}) (the prefix sums of costs {costs}): the cost of the costliest stage "
                     "of the best split, by brute force (the most expensive stage is as cheap as possible)")


@observes("ex04.A.range")
def test_partition_rejects_too_many_stages(impl):
    """More stages than layers, or none, is a ValueError."""
    for p in (3, 0):
        try:
            got = pp.partition([1.0, 2.0], p)
        except ValueError:
            continue
        expect(False, f"partition([1.0, 2.0], p={p}) returned {got}, expected a ValueError (raises ``ValueError`` "
                      "unless 1 <= p <= L)")


GRID = [(p, m) for p in range(1, 7) for m in range(1, 11)]   # m < p too


def _order_fault(order, p, m, r):
    """The first action of rank r's compute order that breaks ex04.B.valid, as text, or None."""
    done, want = {"F": 0, "B": 0}, 2 * m
    for k, a in enumerate(order):
        where = f"p = {p}, m = {m}, rank {r}, action {k} ({a!r})"
        if getattr(a, "op", None) not in ("F", "B") or a.stage != r:
            return f"{where}: not an F or B of stage {r}"
        if a.microbatch != done[a.op] or a.microbatch >= m:
            return (f"{where}: the {a.op}s so far ran micro-batches 0..{done[a.op] - 1}, this one is "
                    f"micro-batch {a.microbatch} (m = {m})")
        if a.op == "B" and done["F"] <= a.microbatch:
            return f"{where}: B{a.microbatch} before F{a.microbatch}"
        done[a.op] += 1
    if len(order) != want:
        return f"p = {p}, m = {m}, rank {r}: {len(order)} actions, expected 2m = {want}"
    return None


def _held_fault(order, p, m, r):
    """The first action after which rank r holds more than min(p - r, m) micro-batches, or None."""
    held, bound = 0, min(p - r, m)
    for k, a in enumerate(order):
        held += (a.op == "F") - (a.op == "B")
        if held > bound:
            return (f"p = {p}, m = {m}, rank {r}, action {k} ({a!r}): {held} micro-batches held after it, "
                    f"the bound is min(p - r, m) = {bound}")
    return None


def _run(orders, p):
    """Unit-time run of p compute orders (F = B = 1): an F of micro-batch i waits for stage s-1's F
    of i, a B for stage s+1's B of i. Returns (the step's span, busy time per rank), or the text of
    where it stops (a deadlock)."""
    done, clock, at = {}, [0] * p, [0] * p
    while any(at[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while at[r] < len(orders[r]):
                a = orders[r][at[r]]
                dep = (("F", a.microbatch, r - 1) if a.op == "F" and r > 0 else
                       ("B", a.microbatch, r + 1) if a.op == "B" and r < p - 1 else None)
                if dep is not None and dep not in done:
                    break
                clock[r] = max(clock[r], done.get(dep, 0)) + 1
                done[a.op, a.microbatch, r] = clock[r]
                at[r], moved = at[r] + 1, True
        if not moved:
            stuck = ", ".join(f"rank {r} at action {at[r]} ({orders[r][at[r]]!r})" for r in range(p)
                              if at[r] < len(orders[r]))
            return f"every unfinished rank waits: {stuck}"
    return max(clock), [sum(1 for _ in o) for o in orders]


def _refused(*args, **kwargs):
    raise LookupError("a library schedule called inside one_f_one_b")


class _OwnOrder:
    """Inside: the library's other schedules raise when called (their code swapped, so every path
    to them, ``make_schedule`` included, is caught)."""

    def __enter__(self):
        from minipar.pipeline import schedules
        self.saved = [(f, f.__code__) for f in (schedules.gpipe, schedules.zb_h1, schedules.interleaved_1f1b)]
        for f, _ in self.saved:
            f.__code__ = _refused.__code__
        return self

    def __exit__(self, *exc):
        for f, code in self.saved:
            f.__code__ = code
        return False


@observes("ex04.B.own")
def test_one_f_one_b_builds_its_own_order(impl):
    """one_f_one_b(p, m, rank) runs with the library's other schedules (GPipe, ZB-H1, interleaved)
    switched off, for p = 1..6 and m = 1..10."""
    for p, m in GRID:
        for r in range(p):
            try:
                with _OwnOrder():
                    pp.one_f_one_b(p, m, r)
            except LookupError:
                expect(False, f"one_f_one_b({p}, {m}, {r}) called one of the library's schedules (the order is "
                              "built here, without calling the library's other schedules)")


@observes("ex04.B.valid")
def test_one_f_one_b_is_valid(impl):
    """For p = 1..6 and m = 1..10 (m < p too): every rank's order holds 2m actions, each micro-batch's
    F and B once on its stage, in micro-batch order, F before B; together the ranks run without
    deadlock. A failure names the first wrong action and its index."""
    for p, m in GRID:
        orders = [list(pp.one_f_one_b(p, m, r)) for r in range(p)]
        for r, order in enumerate(orders):
            fault = _order_fault(order, p, m, r)
            expect(fault is None, f"{fault} (every rank's order has exactly 2m actions, one F and one B of each "
                                  "micro-batch on its own stage, in micro-batch order, each F before its B)")
        ran = _run(orders, p)
        expect(not isinstance(ran, str), f"p = {p}, m = {m}: {ran} (the p ranks' orders run without deadlock)")


@observes("ex04.B.memory")
def test_one_f_one_b_memory(impl):
    """For p = 1..6 and m = 1..10: rank r never holds more than min(p - r, m) micro-batches (from a
    micro-batch's F to its B). A failure names the first action past the bound."""
    for p, m in GRID:
        for r in range(p):
            fault = _held_fault(list(pp.one_f_one_b(p, m, r)), p, m, r)
            expect(fault is None, f"{fault} (rank r holds the activations of at most min(p - r, m) micro-batches)")


@observes("ex04.B.bubble")
def test_one_f_one_b_bubble(impl):
    """For p = 1..6 and m = 1..10, run in unit time (F = B = 1, each waiting for the stage it needs):
    the worst rank idles (p-1)/m of its busy time, GPipe's bubble."""
    for p, m in GRID:
        orders = [list(pp.one_f_one_b(p, m, r)) for r in range(p)]
        if any(_order_fault(o, p, m, r) for r, o in enumerate(orders)):
            continue                                    # test_one_f_one_b_is_valid names it
        ran = _run(orders, p)
        if isinstance(ran, str):
            continue                                    # a deadlock: test_one_f_one_b_is_valid names it
        span, busy = ran
        bubble = [(span - c) / c for c in busy]
        want = cost.bubble_fraction("1f1b", p, m)
        worst = max(range(p), key=lambda r: bubble[r])
        expect(bubble[worst] == pytest.approx(want),
               f"p = {p}, m = {m}: rank {worst} idles {bubble[worst]:.4f} of its busy time, expected GPipe's "
               f"(p-1)/m = {want:.4f} (keep GPipe's bubble)")


CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def _train(p, m):
    model = GPT(CFG, seed=0)
    bounds = pp.partition(pp.layer_costs(model.layers()), p)
    return pp.train(model, data.batches(data.synthetic_tokens(1000), 3, 8, 8), reference.sgd(0.5),
                    schedule="1f1b", microbatches=m, bounds=bounds)


def _launch(fn, n, schedules, args=()):
    """``minipar.launch``. Ranks that hang although every schedule they ran (``(name, p, m, v)``)
    runs to the end in the simulator with your sends and receives fail naming ex04.C.sent and
    ex04.C.deadlock: the messages were right, so a send was left unwaited (Gloo delivers such a send
    or not, by timing: when it does, the record lacks it and the step's test says so), or waited on
    at once, where the checked model never waits on a send."""
    def unwaited(text):
        try:
            for name, p, m, v in schedules:
                pp.check_schedule(pp.make_schedule(name, p, m, v))
        except Exception:       # noqa: BLE001 - the schedule's own messages deadlock: not this clause
            return None
        return text + ("\n  every schedule run here finishes in the simulator with these sends and receives, "
                       "so the hang is in how the step waits on them: a send waited on before the step went on "
                       "(in the model the orders are checked in, a send never waits: ex04.C.deadlock), or one "
                       "never waited on (ex04.C.sent)")
    with hang_breaks("ex04.C.sent", unwaited):
        return minipar.launch(fn, n, args=args, timeout=TIMEOUT)


@observes("ex04.B.memory", "ex04.B.bubble", "ex04.C.loss", "ex04.C.clean", "ex04.C.peak", "ex04.C.sent")
def test_trains_the_gpt(impl):
    """Your partition and 1F1B train the GPT on 4 ranks like one process (1e-5)."""
    results = _launch(_train, 4, [("1f1b", 4, 4, 1)], args=(4, 4))
    want = reference.train_reference(GPT(CFG, seed=0), data.batches(data.synthetic_tokens(1000), 3, 8, 8),
                                     reference.sgd(0.5))
    got = strategy.TrainResult.merge(results)
    first = bool(got["losses"]) and abs(got["losses"][0] - want["losses"][0]) <= 1e-6 + 1e-5 * abs(want["losses"][0])
    with breaks("ex04.C.clean" if first else "ex04.C.loss"):   # the first step's loss, else a later step's
        expect_same_training(got, want, "the GPT on 4 pipeline stages", rtol=1e-5, atol=1e-6)
    from itertools import accumulate
    held = [max(accumulate((a.op == "F") - (a.op == "B") for a in pp.one_f_one_b(4, 4, r))) for r in range(4)]
    order = ("ex04.C.peak" if held == [4, 3, 2, 1] else        # the order's, else what step measured
             "ex04.B.memory" if any(h > w for h, w in zip(held, [4, 3, 2, 1])) else "ex04.B.bubble")
    with breaks(order):             # more held than 1F1B: its memory; fewer: the ranks wait longer, its bubble
        expect_equal([m["peak_stash"] for m in got.measured], [4, 3, 2, 1],
                     "peak micro-batches held, per rank, measured while training (1F1B: rank r holds min(p - r, m) "
                     "micro-batches at its peak: no more, and, with GPipe's bubble, no fewer)", keys="rank")


def _gpipe_split(p, m, r):
    """GPipe with each backward split into B and W, every W one B late (a W between two Bs, and
    the last ones at the end): a compute order with Ws that does not go through part B's 1F1B."""
    out, waiting = [], []
    for a in pp.gpipe(p, m, r):
        out.append(a)
        if a.op == "B":
            waiting.append(a.microbatch)
            if len(waiting) > 1:
                out.append(Action("W", waiting.pop(0), a.stage))
    return out + [Action("W", i, r) for i in waiting]


def _interleaved_gpipe(p, m, r, v=2):
    """Forwards through the rank's v chunks in order, then backwards through them in reverse, each
    chunk's micro-batches in order: an order over virtual stages that does not go through part B's
    1F1B (the library's interleaved 1F1B does)."""
    return ([Action("F", i, c * p + r) for c in range(v) for i in range(m)]
            + [Action("B", i, c * p + r) for c in reversed(range(v)) for i in range(m)])


ORDERS = {    # schedule -> (v, a rank's compute order): the inputs given to add_comms
    "GPipe": (1, lambda p, m, r: pp.gpipe(p, m, r)),
    "GPipe with split backwards": (1, _gpipe_split),
    "interleaved GPipe": (2, _interleaved_gpipe),
}
COMMS_ON = [(2, 2), (3, 2), (3, 6), (4, 4), (4, 8)]


def _library_orders(name, p, m):
    v, fn = ORDERS[name]
    return v, [list(fn(p, m, r)) for r in range(p)]


def _comms_fault(order, acts, p, S, r):
    """The first action of rank r's ``acts`` = add_comms(order) that breaks keep, comms or peer."""
    computes = [a for a in acts if a.op in ("F", "B", "W")]
    others = [(k, a) for k, a in enumerate(acts) if a.op not in ("F", "B", "W")]
    for k, (g, w) in enumerate(zip(computes, order)):
        if g != w:
            return "keep", f"rank {r}, compute action {k}: expected {w!r}, got {g!r}"
    if len(computes) != len(order):
        return "keep", f"rank {r}: {len(computes)} compute actions, expected {len(order)}"
    bad = [(k, a) for k, a in others if a.op not in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")]
    if bad:
        return "keep", f"rank {r}, action {bad[0][0]} ({bad[0][1]!r}): neither a compute nor a send or receive"
    needed = {}                   # (op, i, stage) -> (the index its compute must be placed next to, peer)
    pos = [k for k, a in enumerate(acts) if a.op in ("F", "B", "W")]
    for n, k in enumerate(pos):
        a = acts[k]
        if a.op == "W":
            continue
        src, dst = (a.stage - 1, a.stage + 1) if a.op == "F" else (a.stage + 1, a.stage - 1)
        lo, hi = (pos[n - 1] if n else -1), k
        if 0 <= src < S:
            needed["RECV_" + a.op, a.microbatch, a.stage] = (lo, hi, src % p)
        lo, hi = k, (pos[n + 1] if n + 1 < len(pos) else len(acts))
        if 0 <= dst < S:
            needed["SEND_" + a.op, a.microbatch, a.stage] = (lo, hi, dst % p)
    seen = set()
    for k, a in others:
        key = (a.op, a.microbatch, a.stage)
        if key not in needed:
            return "comms", f"rank {r}, action {k} ({a!r}): no compute of this rank needs it"
        if key in seen:
            return "comms", f"rank {r}, action {k} ({a!r}): a second one"
        seen.add(key)
        lo, hi, peer = needed[key]
        if not lo < k < hi:
            return "comms", (f"rank {r}, action {k} ({a!r}): outside the span between its compute and the "
                             f"rank's {'previous' if a.op.startswith('RECV') else 'next'} compute "
                             f"(actions {lo + 1}..{hi - 1})")
        if a.peer != peer:
            return "peer", f"rank {r}, action {k} ({a!r}): peer {a.peer}, stage's rank {peer}"
    missing = [key for key in needed if key not in seen]
    if missing:
        op, i, s = missing[0]
        return "comms", f"rank {r}: no {op} for micro-batch {i}, stage {s}"
    return None


WHY = {"keep": "the result holds order's compute actions unchanged and in their order, and otherwise only sends "
               "and receives",
       "comms": "every tensor that crosses a stage boundary has exactly one send, after the compute that produced "
                "it and before the rank's next compute, and exactly one receive, after the receiving rank's "
                "previous compute and before the compute that reads it",
       "peer": "the peer of a message is the rank holding the other stage"}


@observes("ex04.C.keep", "ex04.C.comms", "ex04.C.peer")
def test_add_comms(impl):
    """add_comms on GPipe, GPipe with split backwards (with W) and interleaved GPipe (2 virtual stages)
    orders, p = 2..4: the computes kept in order, one send and one receive per boundary crossing, each
    next to its compute, peers the ranks of the stages. A failure names the first wrong action."""
    for name in ORDERS:
        for p, m in COMMS_ON:
            v, orders = _library_orders(name, p, m)
            if name.startswith("interleaved") and m % p:
                continue
            for r, order in enumerate(orders):
                fault = _comms_fault(order, list(pp.add_comms(list(order), p, p * v)), p, p * v, r)
                with breaks(f"ex04.C.{fault[0] if fault else 'keep'}"):
                    expect(fault is None, f"{name}, p = {p}, m = {m}, {fault[1] if fault else ''} "
                                          f"({WHY[fault[0]] if fault else ''})")


@observes("ex04.C.deadlock")
def test_add_comms_cannot_deadlock(impl):
    """The same orders with your sends and receives run to the end in the simulator (a send never
    waits, a receive waits for its message): ``pipeline.check_schedule``."""
    for name in ORDERS:
        for p, m in COMMS_ON:
            v, orders = _library_orders(name, p, m)
            if name.startswith("interleaved") and m % p:
                continue
            acts = [list(pp.add_comms(list(o), p, p * v)) for o in orders]
            try:
                pp.check_schedule(pp.Schedule(name, p, m, v, acts))
            except pp.Deadlock as e:
                expect(False, f"{name}, p = {p}, m = {m}: the simulation stops: {e} (in that model the p ranks' "
                              "actions finish for every schedule's orders)")
            except AssertionError as e:
                expect(False, f"{name}, p = {p}, m = {m}: check_schedule says {e} (every tensor that crosses a "
                              "stage boundary has exactly one send ... and exactly one receive)")


CUT = [0, 2, 3, 4, 6]      # the GPT's 6 layers in 4 stages, fixed (part A not needed here)


def _step_case():
    from minipar.comm import group_rank, p2p
    batches = data.batches(data.synthetic_tokens(1000), 3, 8, 8)
    trained = pp.train(GPT(CFG, seed=0), batches, reference.sgd(0.5), schedule="interleaved", microbatches=4,
                       virtual_stages=2, bounds=CUT)
    layers, r, bounds = GPT(CFG, seed=0).layers(), group_rank(), [0, 3, 6]
    x, y = batches[0]
    pipe = pp.Pipeline(pp.build_stages(layers, bounds, r, 2), pp.make_schedule("gpipe", 2, 4),
                       pp.boundary_shapes(layers, bounds, x.chunk(4)[0]).__getitem__)
    posted = []                          # per message the batched() block it was posted in (None: outside)
    for name in ("send", "recv"):
        def wrapped(a, *rest, fn=getattr(pipe.mail, name)):
            posted.append(p2p._BATCH)
            return fn(a, *rest)
        setattr(pipe.mail, name, wrapped)
    from minipar.runtime import trace
    mark = trace.mark()
    returned = pipe.step(x, y)
    sent = (sum(1 for e in trace.since(mark) if e["kind"] == "comm" and e["bytes_sent"] > 0),
            sum(1 for a in pipe.schedule.actions[r] if a.op.startswith("SEND")))
    runs, run, after_compute = [], -1, True    # per message of the schedule: its run between two computes
    for a in pipe.schedule.actions[r]:
        if a.op in ("F", "B", "W"):
            after_compute = True
        else:
            run, after_compute = run + (1 if after_compute else 0), False
            runs.append(run)
    blocks = [None if b is None else next(k for k, c in enumerate(posted) if c is b) for b in posted]
    unbatched = next((k for k, b in enumerate(blocks) if b is None), None)
    split = next((k for k in range(1, len(blocks)) if (blocks[k] == blocks[k - 1]) != (runs[k] == runs[k - 1])),
                 None) if len(blocks) == len(runs) else 0
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
    return {"trained": trained, "returned": returned, "refused": refused,
            "batched": (len(posted), len(runs), unbatched, split), "sent": sent}


def _interleaved_built_from_your_1f1b_is_valid(p, m, v):
    """The library's interleaved 1F1B is one_f_one_b's order over its units: before the step's
    test trains it, its compute orders must hold each unit's F and B once, the F first; otherwise
    the failure is part B's, and named so (not the step's)."""
    for r in range(p):
        order = [(a.op, a.microbatch, a.stage) for a in pp.interleaved_1f1b(p, m, r, v)]
        units = [(i, c * p + r) for c in range(v) for i in range(m)]
        bad = sorted(order) != sorted((op, i, s) for op in "FB" for i, s in units) or any(
            order.index(("B", i, s)) < order.index(("F", i, s)) for i, s in units)
        with breaks("ex04.B.valid"):
            expect(not bad, f"the library's interleaved 1F1B (p = {p}, m = {m}, v = {v}) is your one_f_one_b's order "
                   f"over the rank's m·v units; on rank {r} it is {order} (each unit's F once, then its B once): "
                   "part B's order, not the step, is the one to look at")


@observes("ex04.C.peer", "ex04.C.divide", "ex04.C.loss", "ex04.C.clean", "ex04.C.batched", "ex04.C.sent",
          "ex04.B.valid")
def test_pipeline_step(impl):
    """On 2 ranks: your step and add_comms train the GPT interleaved (2 virtual stages per rank, 3
    steps) like one process; a GPipe step returns the mean loss on rank 1 only; a batch of 7 for
    m = 4 is a ValueError (on a one-rank pipeline)."""
    _interleaved_built_from_your_1f1b_is_valid(p=2, m=4, v=2)
    results = _launch(_step_case, 2, [("interleaved", 2, 4, 2), ("gpipe", 2, 4, 1)])
    batches = data.batches(data.synthetic_tokens(1000), 3, 8, 8)
    want = reference.train_reference(GPT(CFG, seed=0), batches, reference.sgd(0.5))
    returned = [res["returned"] for res in results]
    with breaks("ex04.C.loss"):
        expect(returned[0] is None and isinstance(returned[1], float),
               f"Pipeline.step returned {returned} on ranks 0, 1 (GPipe on 2 ranks), expected [None, a float] (returns "
               "the batch's mean loss on the rank holding the last stage, None elsewhere)")
        expect_close(torch.tensor(returned[1]), torch.tensor(want["losses"][0]), "rank 1's Pipeline.step return, the "
                     "batch's mean loss", where="GPipe on 2 ranks, m = 4, first step", rtol=1e-5, atol=1e-6)
    for rank, res in enumerate(results):
        n, want_n, unbatched, split = res["batched"]
        with breaks("ex04.C.batched"):
            expect(unbatched is None and split is None and n == want_n,
                   f"GPipe on 2 ranks, rank {rank}: {n} messages posted for the schedule's {want_n}; "
                   + (f"message {unbatched} posted outside any batched() block" if unbatched is not None else
                      f"message {split} in a different block from its run's" if split is not None else "")
                   + " (every send and receive is posted inside a ``batched()`` block, one block per run of "
                   "messages between two computes)")
    with breaks("ex04.C.sent"):
        expect_equal([res["sent"][0] for res in results], [res["sent"][1] for res in results],
                     "sends completed and recorded by the time Pipeline.step returned (GPipe on 2 ranks, m = 4; "
                     "expected: the schedule's sends)", keys="rank")
    with breaks("ex04.C.divide"):
        expect_equal([res["refused"] for res in results], [True, True], "a ValueError for a batch of 7 with m = 4, "
                     "per rank (a batch m does not divide is a ValueError)", keys="rank")
    got = strategy.TrainResult.merge([res["trained"] for res in results])
    later = lambda f: "step 0" not in str(f) and "parameter" not in str(f)  # noqa: E731
    try:
        with diagnose(later, "step 0's loss equals one process's, a later step's does not"):
            expect_same_training(got, want, "the GPT interleaved on 2 ranks, 2 virtual stages each (the peer of a "
                                 "message is the rank holding the other stage; a second step starts from a clean "
                                 "state)", rtol=1e-5, atol=1e-6)
    except GradeFailure as f:
        with breaks("ex04.C.clean" if "seen: step 0's loss equals" in str(f) else "ex04.C.peer"):
            raise
