"""Challenge 04: a pipeline schedule with a small bubble in little memory.

Write ``schedule(p, m, rank)`` in ``exercises/challenges/ch04_schedule.py``: each rank's compute
order (F, B and optionally W actions) for p ranks and m micro-batches. The grader adds the
communication and checks the schedule is valid (``pipeline.check_schedule``) and holds at most
4 micro-batches of activations on every rank (``pipeline.peak_stash``) for every p = 1..8 and
m = 1..16 it tries, m < p included; for p = 8 ranks and m = 16 micro-batches it simulates it
with F = B = W = 1: every rank must idle at most 0.7 of its busy time (``pipeline.bubble``).
For scale, at p = 8, m = 16: 1F1B holds 8 on rank 0 (bubble 0.44), ZB-H1 holds 8 on every
rank (0.15), and 1F1B with its warm-up cut to stay within 4 idles 3.4. The file may not import
the library's schedules (``FORBIDDEN``: ``minipar.pipeline.schedules``, and ``make_schedule``
and the generators that ``minipar.pipeline`` re-exports); ``Action`` comes from
``minipar.pipeline``. Grade it with ``python -m minipar.grade ch04``; stuck?
``minipar.hint("ch04")``.
"""
from minipar import pipeline as pp
from minipar.course.grading import GradeFailure, fail_if, observes
from minipar.pipeline.schedules import COMPUTE, Schedule, add_comms

CHALLENGE = "ch04_schedule"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNodjksOwjAMRK8yByiIBQuEhBAbrsDaTdwman5KXCJuj5udPdLMey9BwQM3dC8OJIi5Ca5wHOyES'
        'mnDBYZSyoKNuUAco/jCwSfGsodwByF6U/NpJjEOTejXRh9LzRFeGt7Yk/gw7pnM1qlaOGowOfJIdLfmfVWFE'
        'NRGR1ZuZ3ycKileGcPFZnTnA+sSOuncBEr2yJRMRnxOSmVuODr6f+nInn+4kVBV',
        'sealed:eNpNjzGOwzAMBL+yZQIEeUBSXYr7QIrUtMRIhA1KkGnr+0fLzZUkd5a777qIwTJjojB3avGBFy7HQ'
        'rRuhtQoCqtdkQqvQwUrg6iNdynbitUoMchQNPANn5PvLCn/N/g2dofjRMFkJ5OiII0IpGibomdW3rkNTSOdI'
        'eug7vg5Qwaqt7HxV4wLobJG0YTPFRN/S3NvKHf8Pn1eSoe3m5nroP1+NHRPvzj1xPluYXPshU6unjiLZ+qle'
        'dHspULZljjyLWTc7n+7mGt6',
        'sealed:eNptj7FOA0EMRH9lSpBWqaigIgVfgETtu51kLfa8J+9eovt7HCVCFDS25Jknz7zj7GTeUbUP9Lkwb'
        '5We0HXZqgxmqGEzHRi68BXXQoPAxb6hHaegEaJv1hOmHatrcx17CtMx3K0zXkhW2kCRDnHXC3MCa0hPE2u74'
        'gWFNT9DDB8PSG3d/iMEKy2rnfH1BhkP9O8Zc1vYMfHUnBiFOB7wGat5poMyl3v+GLcOOvpv84SAwAs9qkScj'
        'OXwA1SJZMc=',
    ),
}
FORBIDDEN = ("minipar.pipeline.schedules", "minipar.pipeline.make_schedule", "minipar.pipeline.zb_h1",
             "minipar.pipeline.one_f_one_b", "minipar.pipeline.gpipe", "minipar.pipeline.interleaved_1f1b",
             "minipar.pipeline.SCHEDULES", "minipar.course.graded.alternatives", "solutions")
P, M = 8, 16
MEMORY_GOAL = 4        # micro-batches of activations per rank, on every (p, m) tried
BUBBLE_GOAL = 0.7      # idle / busy on every rank, at p = 8, m = 16


def _build(challenge, p=P, m=M) -> Schedule:
    orders = [list(challenge.schedule(p, m, r)) for r in range(p)]
    for r, order in enumerate(orders):
        bad = [a for a in order if getattr(a, "op", None) not in COMPUTE]
        fail_if(bool(bad), f"rank {r}: the order holds {bad[:3]}, expected only compute actions (F, B, W)")
    return Schedule("challenge", p, m, 1, [add_comms(o, p, p) for o in orders])


def _valid(s: Schedule) -> None:
    try:
        pp.check_schedule(s)
    except (AssertionError, pp.Deadlock) as e:
        raise GradeFailure(f"not a valid schedule for p={s.p}, m={s.m}: {e}\n{s.table()}") from None


VALID_ON = [(p, m) for p in range(1, 9) for m in range(1, 17)]   # m < p too


@observes('ch04.*.valid')
def test_is_a_valid_schedule(challenge):
    """Every F, B (and W) once per micro-batch, in order, without deadlock, on every p = 1..8 and
    m = 1..16 (m < p too), not only the goal's p = 8, m = 16."""
    for p, m in VALID_ON:
        _valid(_build(challenge, p, m))


@observes('ch04.*.memory')
def test_memory_goal(challenge):
    """No rank holds more than 4 micro-batches of activations at once, on every p = 1..8 and
    m = 1..16."""
    for p, m in VALID_ON:
        s = _build(challenge, p, m)
        _valid(s)
        peak = pp.peak_stash(s)
        over = next((r for r in range(p) if peak[r] > MEMORY_GOAL), None)
        fail_if(over is not None, f"memory: p = {p}, m = {m}: rank {over} holds {peak[over] if over is not None else ''} "
                 f"micro-batches at once (per rank: {peak}); the goal is at most {MEMORY_GOAL} on every rank, "
                 "for every p and m. An activation is held from its F until its B (its W when the backward is "
                 "split)")


@observes('ch04.*.bubble')
def test_bubble_goal(challenge):
    """Every rank idles at most 0.7 of its busy time in the simulated step, p = 8, m = 16
    (F = B = W = 1)."""
    s = _build(challenge)
    _valid(s)
    bubble = pp.bubble(s, f=1.0, b=1.0, w=1.0)
    worst = max(range(P), key=lambda r: bubble[r])
    fail_if(bubble[worst] > BUBBLE_GOAL + 1e-9,
             f"bubble: rank {worst} idles {bubble[worst]:.3f} of its busy time (per rank: "
             f"{[round(b, 3) for b in bubble]}); the goal is at most {BUBBLE_GOAL} "
             f"(1F1B, holding 8: {pp.bubble(pp.make_schedule('1f1b', P, M))[0]:.3f})\n" + s.table())

