"""Exercise 07: the process mesh, and choosing a configuration.

Implement three of minipar's own functions (same names and signatures as
``minipar.mesh`` and ``minipar.hybrid``); the grader then trains the GPT in 3D on a mesh
built from *your* functions and compares with one process.

1. ``mesh_coordinates(rank, dp, pp, tp)`` — the ranks of a dp × pp × tp job are laid out
   as Megatron-LM does: tensor-parallel ranks vary fastest (adjacent ranks, one node),
   then data-parallel, then pipeline stages::

       rank = p · (dp · tp) + d · tp + t

   Return ``{"pp": p, "dp": d, "tp": t}``. A rank outside ``0 .. dp·pp·tp - 1`` is a
   ``ValueError``.
2. ``group_members(rank, dim, dp, pp, tp)`` — the global ranks of ``rank``'s group along
   ``dim`` (``"dp"``, ``"pp"`` or ``"tp"``): the ranks whose coordinates equal ``rank``'s
   in the two other dimensions, ordered by their coordinate along ``dim`` (so a rank's
   index in the list is its group-local rank). An unknown ``dim`` is a ``ValueError``.
   Example: dp = pp = tp = 2, rank 5 = (p=1, d=0, t=1): tp [4, 5], dp [5, 7], pp [1, 5].
3. ``choose_config(config, world_size, batch_size, microbatches=1, memory_per_rank=None,
   ranks_per_node=8, zero1=False)`` — Narayanan et al. 2021's advice as a rule:

   a. candidates: every (dp, pp, tp) of positive ints with dp·pp·tp = world_size for which
      ``check_config(config, dp, pp, tp, world_size, microbatches, batch_size)`` does not
      raise ``ValueError``;
   b. keep those whose model states fit: ``hybrid_memory_per_rank(num_params(config), dp,
      pp, tp, zero1=zero1)["total"] <= memory_per_rank`` (no limit when it is ``None``);
   c. pick the smallest model-parallel size tp·pp (data parallelism for the rest); among
      equals prefer ``tp <= ranks_per_node``, then the fewest pipeline stages pp;
   d. return ``{"dp": dp, "pp": pp, "tp": tp}``, or raise ``ValueError`` if nothing is left.

Grade with ``python -m minipar.grade ex07``.
"""
from minipar.cost import hybrid_memory_per_rank  # noqa: F401 - for your code
from minipar.hybrid import check_config, num_params  # noqa: F401


def mesh_coordinates(rank: int, dp: int, pp: int, tp: int) -> dict[str, int]:
    """``{"pp": p, "dp": d, "tp": t}`` of global ``rank`` on a dp × pp × tp mesh."""
    raise NotImplementedError("Exercise 07: implement mesh_coordinates (see the module docstring)")


def group_members(rank: int, dim: str, dp: int, pp: int, tp: int) -> list[int]:
    """Global ranks of ``rank``'s group along ``dim`` ("dp", "pp" or "tp"), in group order."""
    raise NotImplementedError("Exercise 07: implement group_members (see the module docstring)")


def choose_config(config, world_size: int, batch_size: int, microbatches: int = 1,
                  memory_per_rank: float | None = None, ranks_per_node: int = 8,
                  zero1: bool = False) -> dict[str, int]:
    """The configuration ``{"dp", "pp", "tp"}`` to train ``config`` on ``world_size`` ranks."""
    raise NotImplementedError("Exercise 07: implement choose_config (see the module docstring)")
