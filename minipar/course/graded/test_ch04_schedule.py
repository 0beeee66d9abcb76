"""Challenge 04: a pipeline schedule with a small bubble and little memory.

Write ``schedule(p, m, rank)`` in ``exercises/challenges/ch04_schedule.py``: each rank's compute
order (F, B and optionally W actions) for p ranks and m micro-batches. The grader adds the
communication and checks the schedule is valid (``pipeline.check_schedule``) for every p and
m it tries, m < p included; for p = 4 ranks and m = 8 micro-batches it simulates it with
F = B = W = 1: every rank must hold at most 4 micro-batches of
activations (``pipeline.peak_stash``) and idle at most 0.22 of its busy time
(``pipeline.bubble``; 1F1B: 0.375). The file may not import the library's schedules
(``FORBIDDEN``: ``minipar.pipeline.schedules``, and ``make_schedule`` and the generators that
``minipar.pipeline`` re-exports); ``Action`` comes from ``minipar.pipeline``. Grade it with
``python -m minipar.grade ch04``; stuck? ``minipar.hint("ch04")``.
"""
from minipar import pipeline as pp
from minipar.course.grading import GradeFailure, fail_if, observes
from minipar.pipeline.schedules import COMPUTE, Schedule, add_comms

CHALLENGE = "ch04_schedule"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNpFjFEKwjAQRK8yB1CwJyj6IXiMMUlNaMiW3Y3B21sR9PPNG96tYbpOlwNGpiNKMnhOqDSHsq37t'
        'KtS05dO0N4MxQ1BpB6jjIY7wzqo0WacW/zcQ8ZGdcgC/vS/vml6FukGcz4SGLyz1hcGi2MRnd8uPTT6',
        'sealed:eNpNjrGOAjEMRH9lSpCAiupKvuCkK6i9iUmsDfYq8RLx95dQ0VkjvzfztxVxeGYsFNZONf7ghoPot'
        'jtSpSisfkQybnD7PG6VX2J7Q3NKDHKYBj7hjkNnSfmbC6ToJH7BrzXfTBn3AU7R4JhCRiVdkakNvltdZ8tDS'
        'oF4g8TCaMXmqZ/yYFbO0bqesIyFj8o88+dwmoLV9pSnYmx7o4vnwV2RuUQ8JVQ7L+Qhc7v8A982WBY=',
        'sealed:eNo1j7FuwzAMRH/ltraAHcBAp2TzEHTraKAbY50iIYokUDKM/n3pAB04HO+Bx/uZx6/pjOk6zW8Nu'
        '+hz3CreK0aozQRf1LaufQzogRnXATOqRDU6UAmV/DD2QdaG2BuWZvIZVy3jTfoa2HBjiNldEPNxBGspaXRlz'
        'yiZcPRUpcMC8Z0KyhowX15oktaPi9Jfktmd8K0Q3JV0v0jR/GYhbkvU8/FThjdvgG7ZOKUYNg9gaoRYAUQPz'
        '92CejD9CbEWgcn9M6gWE/Mdy+kPYr1eqQ==',
    ),
}
FORBIDDEN = ("minipar.pipeline.schedules", "minipar.pipeline.make_schedule", "minipar.pipeline.zb_h1",
             "minipar.pipeline.one_f_one_b", "minipar.pipeline.gpipe", "minipar.pipeline.interleaved_1f1b",
             "minipar.pipeline.SCHEDULES", "minipar.course.graded.alternatives", "solutions")
P, M = 4, 8
MEMORY_GOAL = 4        # micro-batches of activations per rank
BUBBLE_GOAL = 0.22     # idle / busy on every rank


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


VALID_ON = [(p, m) for p in range(1, 7) for m in range(1, 11)]   # m < p too


@observes('ch04.*.valid')
def test_is_a_valid_schedule(challenge):
    """Every F, B (and W) once per micro-batch, in order, without deadlock, on every p = 1..6 and
    m = 1..10 (m < p too), not only the goals' p=4, m=8."""
    for p, m in VALID_ON:
        _valid(_build(challenge, p, m))


@observes('ch04.*.memory')
def test_memory_goal(challenge):
    """No rank holds more than 4 micro-batches of activations at once (p=4, m=8)."""
    s = _build(challenge)
    _valid(s)
    peak = pp.peak_stash(s)
    over = [r for r in range(P) if peak[r] > MEMORY_GOAL]
    fail_if(bool(over), f"memory: peak micro-batches held per rank {peak}; the goal is at most "
             f"{MEMORY_GOAL} on every rank (rank {over[0] if over else ''} holds "
             f"{peak[over[0]] if over else ''}). An activation is held from its F until its B "
             "(its W when the backward is split)\n" + s.table())


@observes('ch04.*.bubble')
def test_bubble_goal(challenge):
    """Every rank idles at most 0.22 of its busy time in the simulated step (F = B = W = 1)."""
    s = _build(challenge)
    _valid(s)
    bubble = pp.bubble(s, f=1.0, b=1.0, w=1.0)
    worst = max(range(P), key=lambda r: bubble[r])
    fail_if(bubble[worst] > BUBBLE_GOAL + 1e-9,
             f"bubble: rank {worst} idles {bubble[worst]:.3f} of its busy time (per rank: "
             f"{[round(b, 3) for b in bubble]}); the goal is at most {BUBBLE_GOAL} "
             f"(1F1B: {pp.bubble(pp.make_schedule('1f1b', P, M))[0]:.3f})\n" + s.table())

