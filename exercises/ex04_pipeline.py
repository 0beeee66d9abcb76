"""Exercise 04: balance a model's layers across stages, and write the 1F1B schedule.

Implement two functions of ``minipar.pipeline`` (same names and signatures).

1. ``partition(costs, p)``: cut L layers with costs ``costs`` into p contiguous,
   non-empty stages so that the **most expensive stage is as cheap as possible** (a
   pipeline runs at the pace of its slowest stage). Return the boundaries
   ``[0, b_1, ..., b_{p-1}, L]``: stage s holds layers ``b_s`` to ``b_{s+1} - 1``.
   Raise ``ValueError`` when p > L (a stage would be empty). Any optimal split is
   accepted. One way: dynamic programming over best[k][j] = the smallest possible
   max-stage cost for the first j layers in k stages; another: binary search on the
   answer with a greedy check.

2. ``one_f_one_b(p, m, rank)``: the compute order of 1F1B (PipeDream-Flush) on ``rank``
   of p for m micro-batches, as a list of ``Action("F", i, rank)`` / ``Action("B", i, rank)``:
   warm-up: ``min(p - rank - 1, m)`` forwards; steady state: alternate one forward (the next
   micro-batch) and one backward (the oldest micro-batch not yet done); cool-down: the
   remaining backwards. Rank r then never holds more than min(p - r, m) micro-batches.
   ``make_schedule("1f1b", p, m, order_fn=one_f_one_b)`` adds the sends and receives.

Grade it with ``python -m minipar.grade ex04``.
"""
from minipar.pipeline.schedules import Action  # noqa: F401 - for your code


def partition(costs: list[float], p: int) -> list[int]:
    """Stage boundaries ``[0, b_1, ..., L]`` (stage s = layers ``b_s : b_{s+1}``, none empty)
    minimising the cost of the most expensive stage."""
    raise NotImplementedError("Exercise 04: implement partition (see the module docstring)")


def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """1F1B on ``rank``: warm-up ``min(p - rank - 1, m)`` forwards, steady F,B pairs, cool-down Bs."""
    raise NotImplementedError("Exercise 04: implement one_f_one_b (see the module docstring)")
