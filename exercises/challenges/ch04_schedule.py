"""Challenge 04: a pipeline schedule with a small bubble and little memory.

Write ``schedule(p, m, rank)``: the compute order of ``rank`` for one training step on p
ranks and m micro-batches, a list of ``minipar.pipeline.Action`` (``Action("F", i,
rank)``, ``Action("B", i, rank)``, and, if you split the backward as zero-bubble schedules do,
``Action("W", i, rank)``). One stage per rank. The grader inserts the sends and receives
(``schedules.add_comms``), checks the schedule (``pipeline.check_schedule``: every F, B (and
W) once, F before B before W, no deadlock) for every p and m, m < p included, and measures
it with the library's simulator, in the manner of LLM-Training-Puzzles. Goals for p = 4,
m = 8, with F = B = W = 1 time unit (an unsplit backward costs B + W = 2):

* **memory**: every rank holds at most 4 micro-batches of activations at once
  (``pipeline.peak_stash``; an activation is freed by the B, or by the W if split);
* **bubble**: every rank idles at most 0.22 of its busy time (``pipeline.bubble``: idle
  over busy in the simulated step, (T - c)/c).

For scale: GPipe holds 8 and idles 0.375; 1F1B holds 4 and idles 0.375; splitting the
backward and running each W right after its B gets to 0.25. Notebook 04 ("Zero bubble:
split the backward") has the idea to go further.

The library's own schedules are the course's answers, so this file may not import
``minipar.pipeline.schedules`` nor ``make_schedule`` and the generators ``minipar.pipeline``
re-exports (the grader refuses the file, naming the line); the simulator is yours to use.

Grade it with ``python -m minipar.grade ch04`` (``minipar.hint("ch04")`` if stuck).
"""
from minipar.pipeline import Action


def schedule(p: int, m: int, rank: int) -> list[Action]:
    raise NotImplementedError("Challenge 04: schedule")
