"""Challenge 04: a pipeline schedule with a small bubble in little memory.

Write ``schedule(p, m, rank)``: the compute order of ``rank`` for one training step on p
ranks and m micro-batches, a list of ``minipar.pipeline.Action`` (``Action("F", i,
rank)``, ``Action("B", i, rank)``, and, if you split the backward as zero-bubble schedules do,
``Action("W", i, rank)``). One stage per rank. The grader inserts the sends and receives
(``schedules.add_comms``), checks the schedule (``pipeline.check_schedule``: every F, B (and
W) once, F before B before W, no deadlock) and measures it with the library's simulator, in
the manner of LLM-Training-Puzzles, with F = B = W = 1 time unit (an unsplit backward costs
B + W = 2):

* **memory**: on every p = 1..8 and m = 1..16 (m < p too), every rank holds at most 4
  micro-batches of activations at once (``pipeline.peak_stash``; an activation is freed by
  the B, or by the W if split);
* **bubble**: for p = 8 ranks and m = 16 micro-batches, every rank idles at most 0.7 of its
  busy time (``pipeline.bubble``: idle over busy in the simulated step, (T - c)/c).

For scale, at p = 8, m = 16: GPipe holds 16 and 1F1B 8 on rank 0 (both idle 0.44); ZB-H1
idles 0.15 but holds 8 on every rank; 1F1B with its warm-up cut so that no rank holds more
than 4 idles 3.4. With p larger than the memory allows, rank 0 cannot keep the pipeline
full: the question is what each rank does while it waits. Notebook 04 ("Zero bubble: split
the backward") has an idea to use.

The library's own schedules are the course's answers, so this file may not import
``minipar.pipeline.schedules`` nor ``make_schedule`` and the generators ``minipar.pipeline``
re-exports (the grader refuses the file, naming the line); the simulator is yours to use.

Grade it with ``python -m minipar.grade ch04`` (``minipar.hint("ch04")`` if stuck).
"""
from minipar.pipeline import Action


def schedule(p: int, m: int, rank: int) -> list[Action]:
    raise NotImplementedError("Challenge 04: schedule")
