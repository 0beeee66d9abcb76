"""Challenge 03: cut a model over 4 ranks so that they idle less, within their memory.

Naive model parallelism leaves each of n equal stages idle (n-1)/n of the step (notebook 03,
"The price: idle ranks"). Two levers reduce it: balance the stages, and cut the batch into
micro-batches that follow each other through the stages (GPipe, Huang et al. 2019: all
forwards, then all backwards).

The model has ten layers; ``COST[j]`` is layer j's forward time for the whole batch (its
backward costs twice that) and ``MEMORY[j]`` the memory its parameters, gradients and
optimizer state take (GiB). Every rank has ``BUDGET`` GiB.

Write ``plan(cost, memory, budget, n)`` returning ``(bounds, m)``: the stage boundaries
``[0, b_1, ..., b_{n-1}, len(cost)]`` (stage s = layers ``b_s`` to ``b_{s+1} - 1``, none empty)
and a number of micro-batches ``m`` (1 <= m <= 16). The grader simulates GPipe's schedule
(``pipeline.simulate``) with stage s's forward costing ``sum(cost[b_s:b_{s+1}]) / m`` per
micro-batch. Goals at n = 4:

* **memory**: every rank's layers fit in ``BUDGET``;
* **idle**: the idle fraction of the step, 1 - (busy time of all ranks) / (n · step time),
  is at most 0.40 (the whole batch on layer-count-balanced stages: 0.75).

Grade it with ``python -m minipar.grade ch03`` (``minipar.hint("ch03")`` if stuck).
"""
COST = [2, 6, 6, 6, 6, 6, 6, 6, 6, 10]     # embedding, 8 blocks, the vocabulary head
MEMORY = [8, 3, 3, 3, 3, 3, 3, 3, 3, 8]    # GiB of parameters + gradients + optimizer state
BUDGET = 12                                 # GiB per rank


def plan(cost: list[float], memory: list[float], budget: float, n: int) -> tuple[list[int], int]:
    raise NotImplementedError("Challenge 03: plan")
