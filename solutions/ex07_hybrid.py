"""Exercise 07, solved: mesh coordinates, group members, and the choice of a configuration.

See ``exercises/ex07_hybrid.py`` for the statement, ``minipar/mesh.py`` and
``minipar/hybrid/config.py`` for the library's versions.
"""
from minipar.cost import hybrid_memory_per_rank
from minipar.hybrid import check_config, num_params

DIMS = ("pp", "dp", "tp")


def mesh_coordinates(rank: int, dp: int, pp: int, tp: int) -> dict[str, int]:
    """``{"pp": p, "dp": d, "tp": t}`` of global ``rank`` on a dp × pp × tp mesh."""
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} is not on a mesh of {dp * pp * tp} ranks")
    p, rest = divmod(rank, dp * tp)      # rank = p·(dp·tp) + rest
    d, t = divmod(rest, tp)              # rest = d·tp + t
    return {"pp": p, "dp": d, "tp": t}


def group_members(rank: int, dim: str, dp: int, pp: int, tp: int) -> list[int]:
    """Global ranks of ``rank``'s group along ``dim`` ("dp", "pp" or "tp"), in group order."""
    if dim not in DIMS:
        raise ValueError(f"dim must be 'dp', 'pp' or 'tp', got {dim!r}")
    c = mesh_coordinates(rank, dp, pp, tp)
    size = {"dp": dp, "pp": pp, "tp": tp}[dim]
    members = []
    for i in range(size):
        q = {**c, dim: i}
        members.append(q["pp"] * dp * tp + q["dp"] * tp + q["tp"])
    return members


def choose_config(config, world_size: int, batch_size: int, microbatches: int = 1,
                  memory_per_rank: float | None = None, ranks_per_node: int = 8,
                  zero1: bool = False) -> dict[str, int]:
    """The configuration ``{"dp", "pp", "tp"}`` to train ``config`` on ``world_size`` ranks."""
    best = None
    for tp in range(1, world_size + 1):
        for pp in range(1, world_size + 1):
            if world_size % (tp * pp):
                continue
            dp = world_size // (tp * pp)
            try:
                check_config(config, dp, pp, tp, world_size, microbatches, batch_size)
            except ValueError:
                continue
            need = hybrid_memory_per_rank(num_params(config), dp, pp, tp, zero1=zero1)["total"]
            if memory_per_rank is not None and need > memory_per_rank:
                continue
            key = (tp * pp, tp > ranks_per_node, pp)
            if best is None or key < best[0]:
                best = (key, {"dp": dp, "pp": pp, "tp": tp})
    if best is None:
        raise ValueError(f"no configuration of {world_size} ranks fits")
    return best[1]
