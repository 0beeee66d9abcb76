"""Challenge 07: a 3D layout that fits, keeps the bubble small and sends the fewest bytes.

Exercise 07 C follows a fixed rule (least model parallelism). Here the costs decide. Each
dimension costs something different (notebook 07, "Why combine"):

* memory: ``cost.hybrid_memory_per_rank(Ψ, dp, pp, tp)["total"]``, the model states per rank
  (fp32 Adam): tp and pp divide them, dp does not;
* bytes: ``cost.hybrid_comm_bytes(Ψ, n_layer, dp, pp, tp, batch_size, seq_len, hidden,
  microbatches)["total"]``, what one rank sends per step: dp all-reduces the gradients of its
  share, tp all-reduces activations in every layer, pp sends one activation per micro-batch;
* the bubble: ``cost.bubble_fraction("1f1b", pp, microbatches)``, the idle fraction of a
  pipeline step over its ideal time, (p-1)/m.

Write ``layout(config, world_size, batch_size, microbatches, memory_per_rank)``: a
configuration ``{"dp", "pp", "tp"}`` with dp·pp·tp = world_size that the library can train
(one of ``hybrid.valid_configs(config, world_size, batch_size, microbatches)``; Ψ is
``hybrid.num_params(config)``, the sequence ``config.block_size``, the hidden size
``config.n_embd``). The graded tests, on four GPTs and budgets on 8 ranks, measure:

* **memory**: the model states per rank within ``memory_per_rank``;
* **bubble**: at most **0.5** of the ideal step;
* **bytes**: at most **1.25 ×** the fewest bytes per rank of any valid configuration that
  meets the two goals above.

Grade it with ``python -m minipar.grade ch07`` (this challenge alone; ``grade ex07`` grades the core
exercise, then this challenge). Stuck? ``minipar.hint("ch07")``.
"""


def layout(config, world_size: int, batch_size: int, microbatches: int, memory_per_rank: float) -> dict:
    """``{"dp": ..., "pp": ..., "tp": ...}`` for ``config`` on ``world_size`` ranks."""
    raise NotImplementedError("Challenge 07: layout")
