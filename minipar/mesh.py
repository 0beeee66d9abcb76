"""The process mesh: ranks laid out as a (pp, dp, cp, tp) grid, one process group per line.

Megatron-LM's layout (Narayanan et al. 2021, §3.3): tensor-parallel ranks vary fastest, so
the ``tp`` ranks of one layer are adjacent (one node, NVLink), then data-parallel ranks,
then pipeline stages (which need the least bandwidth, so they may cross nodes):

    rank = p · (dp · tp) + d · tp + t          (p, d, t) = the rank's coordinates

Context parallelism (``cp``, :mod:`minipar.context_parallel`) sits between tp and dp, as in
Megatron-LM: rank = p · (dp · cp · tp) + d · (cp · tp) + c · tp + t (the formula above when
cp = 1). Gradients of replicated parameters are averaged over the combined ``dp_cp`` group
(the ranks that differ only in d and c).

Every rank belongs to one group per dimension: the ranks that differ from it only in that
coordinate. With dp=2, pp=2, tp=2 rank 5 = (p=1, d=0, t=1) has tp group [4, 5], dp group
[5, 7] and pp group [1, 5]."""
from __future__ import annotations

from dataclasses import dataclass, field

DIMS = ("pp", "dp", "tp")  # slowest to fastest
MESH_DIMS = ("pp", "dp", "cp", "tp")  # with context parallelism, slowest to fastest


def mesh_coordinates(rank: int, dp: int, pp: int, tp: int) -> dict[str, int]:
    """``{"pp": p, "dp": d, "tp": t}`` of global ``rank`` on a dp × pp × tp mesh."""
    # >>> ex07 A
    # Hint: a rank outside 0 .. dp·pp·tp - 1 is a ValueError.
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp * pp * tp} ranks")
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}
    # <<< ex07 A


def group_members(rank: int, dim: str, dp: int, pp: int, tp: int) -> list[int]:
    """Global ranks of ``rank``'s group along ``dim`` ("dp", "pp" or "tp"), in group order."""
    # >>> ex07 B
    # Hint: an unknown dim is a ValueError.
    if dim not in DIMS:
        raise ValueError(f"dim must be one of {DIMS}, got {dim!r}")
    c = mesh_coordinates(rank, dp, pp, tp)
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    out = []
    for i in range(sizes[dim]):
        q = dict(c, **{dim: i})
        out.append(q["pp"] * dp * tp + q["dp"] * tp + q["tp"])
    return out
    # <<< ex07 B


@dataclass
class ProcessMesh:
    """A dp × pp × tp layout of ``world_size`` ranks. Construct it in the driver to validate a
    configuration before any process starts (``ProcessMesh(dp=2, pp=2, tp=2, world_size=8)``), then
    inside every rank call :meth:`build` to create the process groups (all ranks must, in the same order)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    world_size: int | None = None
    groups: dict = field(default_factory=dict, repr=False)
    cp: int = 1

    def __post_init__(self):
        for dim in MESH_DIMS:
            v = getattr(self, dim)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{dim} must be a positive int, got {v!r}")
        if self.world_size is not None and self.size != self.world_size:
            cp = f"·{self.cp}" if self.cp > 1 else ""
            raise ValueError(f"dp·pp·{'cp·' if cp else ''}tp = {self.dp}·{self.pp}{cp}·{self.tp} = "
                             f"{self.size} but world_size is {self.world_size}")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def shape(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp", "dp", "cp", "tp"}`` of global ``rank`` (tp fastest, then cp, dp, pp)."""
        out = mesh_coordinates(rank, self.dp, self.pp, self.tp * self.cp)  # cp·tp as one fast dimension
        if self.cp == 1:
            return {**out, "cp": 0}
        return {"pp": out["pp"], "dp": out["dp"], "cp": out["tp"] // self.tp, "tp": out["tp"] % self.tp}

    def rank_of(self, coords: dict[str, int]) -> int:
        """The global rank at ``coords`` (the inverse of :meth:`coordinates`)."""
        return ((coords["pp"] * self.dp + coords["dp"]) * self.cp + coords.get("cp", 0)) * self.tp + coords["tp"]

    def members(self, rank: int, dim: str) -> list[int]:
        """Global ranks of ``rank``'s group along ``dim`` (one of ``MESH_DIMS``, or
        ``"dp_cp"``: the ranks that differ from it only in d and c), in group order."""
        if self.cp == 1 and dim in DIMS:
            return group_members(rank, dim, self.dp, self.pp, self.tp)
        if dim not in MESH_DIMS + ("dp_cp",):
            raise ValueError(f"dim must be one of {MESH_DIMS + ('dp_cp',)}, got {dim!r}")
        c = self.coordinates(rank)
        if dim == "dp_cp":
            return [self.rank_of(dict(c, dp=d, cp=k)) for d in range(self.dp) for k in range(self.cp)]
        return [self.rank_of(dict(c, **{dim: i})) for i in range(self.shape[dim])]

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, each a list of global ranks, without repeats."""
        return [list(g) for g in dict.fromkeys(tuple(self.members(r, dim)) for r in range(self.size))]

    def build(self) -> "ProcessMesh":
        """Inside a rank: create this rank's dp, pp and tp process groups (and cp, dp_cp when cp > 1)."""
        import torch.distributed as dist

        from .comm import name_group
        if dist.get_world_size() != self.size:
            raise ValueError(f"the mesh has {self.size} ranks but the job has {dist.get_world_size()}")
        for dim in DIMS + (("cp", "dp_cp") if self.cp > 1 else ()):
            for ranks in self.all_groups(dim):  # every rank creates every group, same order
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    self.groups[dim] = g
                    name_group(g, dim)  # its communication events are labelled dim
        if self.cp == 1:        # no cp groups (a None group would mean the world)
            self.groups["dp_cp"] = self.groups["dp"]
        return self

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (after :meth:`build`)."""
        import torch.distributed as dist
        return self.coordinates(dist.get_rank())[dim]

    def group(self, dim: str):
        """This rank's process group along ``dim`` (after :meth:`build`)."""
        return self.groups[dim]
