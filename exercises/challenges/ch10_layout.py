"""Challenge 10: choose a layout as good as the planner's, without the planner's search.

``minipar.plan.search`` tries every combination of the knobs (dp, tp, pp, v, cp, ZeRO stage,
micro-batch, recomputation) and ranks what fits. You know what each knob costs: use it.

Write ``choose(model, cluster, nodes, global_batch, seq_len)``: a ``minipar.plan.Layout``
that uses all ``nodes × gpus_per_node`` GPUs of ``cluster`` for ``model`` (catalogue names,
``plan.MODELS`` and ``plan.CLUSTERS``). You may call ``plan.predict`` and
``plan.memory_per_gpu`` to compare candidates, but not ``plan.search`` (the grader disables
it while ``choose`` runs, and refuses a file that imports its module or its enumerator
``plan.layouts``). The graded tests, for Llama 3 8B on 2 DGX H100 nodes (global batch
64, sequence 8192), Llama 3 70B on 8 of them (512, 8192) and GPT-3 13B on 4 Selene nodes
(256, 2048), measure with ``plan.predict``:

* **it runs and fits**: a valid layout on all the GPUs, its memory within the GPU's;
* **step time** within **10%** of the best layout ``plan.search`` finds for the same job,
  computed when the test runs (the planner's model of the step may improve; the goal
  follows it).

Grade it with ``python -m minipar.grade ch10`` (this challenge alone; ``grade ex10`` grades the core
exercise, then this challenge). Stuck? ``minipar.hint("ch10")``.
"""
from minipar import plan


def choose(model: str, cluster: str, nodes: int, global_batch: int, seq_len: int) -> "plan.Layout":
    """The layout to train ``model`` on ``nodes`` nodes of ``cluster``."""
    raise NotImplementedError("Challenge 10: choose")
