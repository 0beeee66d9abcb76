"""Challenge 04: a pipeline schedule with a small bubble and little memory.

Write ``schedule(p, m, rank)`` in ``exercises/challenges/ch04_schedule.py``: each rank's compute
order (F, B and optionally W actions) for p = 4 ranks and m = 8 micro-batches. The grader
adds the communication, checks the schedule is valid (``pipeline.check_schedule``) and
simulates it with F = B = W = 1: every rank must hold at most 4 micro-batches of
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
HINTS = {
    '': (
        'In 1F1B, what does the last rank do while rank 0 runs its cool-down backwards? And which'
        ' part of a backward does the previous stage actually wait for?',
        'Split the backward: B (input gradient) goes to the previous stage at once, W (weight '
        'gradient) can wait. Postpone Ws so that each rank has W work to fill its idle slots in '
        'the cool-down, but free them soon enough to stay within 4 held micro-batches.',
        "ZB-H1: 1F1B's warm-up (p - r - 1 forwards), then F, B pairs where rank r keeps its Ws r "
        'micro-batches behind; in the cool-down one deferred W after each B; the last Ws at the '
        'end. Or a greedy list scheduler: when free, run a ready B, else an F if fewer than 4 are'
        ' held, else a pending W.',
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

