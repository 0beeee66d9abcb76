"""The process mesh: ranks laid out on a dp × pp × cp × tp grid, one process group per line,
with expert parallelism (``ep``) carved out of the dp · cp ranks.

Megatron-LM's layout (Narayanan et al. 2021, §3.3) puts the fastest links where the most bytes
go: the ranks of one tensor-parallel group, whose all-reduces run inside every layer, are
neighbours (one node, NVLink); a pipeline stage's ranks are together too, since stages exchange
only activations at their boundaries and may cross nodes. Context parallelism (``cp``,
:mod:`minipar.context_parallel`) is as in Megatron-LM, gradients of replicated parameters
averaged over the combined ``dp_cp`` group (the ranks that differ only in d and c).

Every rank belongs to one group per dimension: the ranks that differ from it only in that
coordinate. Expert parallelism (``ep``, :mod:`minipar.expert_parallel`) adds no ranks: as in
Megatron-Core, each ``dp_cp`` group is cut into **ep groups** of ``ep`` ranks (each holds all E
experts once, E/ep per rank), and the **expert-data-parallel group** (``expert_dp``, dp·cp/ep
ranks) of a rank holds the ranks that hold its experts: the only ranks an expert's gradient is
reduced over. ``ep`` must divide dp · cp. Notebook 07 draws the grid and its groups."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .comm import name_group

DIMS = ("dp", "pp", "tp")  # the dims of a 3D mesh, by name (not their order in the layout)
MESH_DIMS = ("cp", "dp", "pp", "tp")  # with context parallelism, by name
GROUP_DIMS = MESH_DIMS + ("dp_cp", "ep", "expert_dp")  # every group a rank can ask for


# Contract:
# ex07.A.bijection: returns ``{"pp": p, "dp": d, "tp": t}`` with 0 ≤ p < pp, 0 ≤ d < dp,
#     0 ≤ t < tp: the coordinates of global ``rank`` in a dp × pp × tp job; the dp·pp·tp ranks get
#     the dp·pp·tp coordinates, each exactly once.
# ex07.A.order: the layout of Narayanan et al. 2021, §3.3: the ranks of every tensor-parallel
#     group (equal p and d) are consecutive (so a tp group crosses no node when tp divides the
#     ranks per node, nor when the whole job fits in one); the ranks of every pipeline stage
#     (equal p) are consecutive; and in every group, a higher coordinate along the group's dim is
#     a higher rank.
# ex07.A.range: a rank outside the mesh is a ``ValueError``.
def mesh_coordinates(rank: int, dp: int, pp: int, tp: int) -> dict[str, int]:
    """``{"pp": p, "dp": d, "tp": t}`` of global ``rank`` on a dp × pp × tp mesh (Megatron-LM's layout)."""
    # >>> ex07 A
    # tp varies fastest, then dp, then pp: rank = p·(dp·tp) + d·tp + t
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp * pp * tp} ranks")
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}
    # <<< ex07 A


# Contract:
# Given: ``mesh_coordinates`` (part A) places the ranks.
# ex07.B.members: returns ``rank``'s group along ``dim`` ("dp", "pp" or "tp"): every rank whose
#     coordinates equal ``rank``'s in the two other dims, and no other rank, listed by their
#     coordinate along ``dim`` (a rank's index in the list is its group-local rank).
# ex07.B.dim: an unknown ``dim`` is a ``ValueError``.
def group_members(rank: int, dim: str, dp: int, pp: int, tp: int) -> list[int]:
    """Global ranks of ``rank``'s group along ``dim`` ("dp", "pp" or "tp"), in group order."""
    # >>> ex07 B
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
    """A dp × cp × pp × tp layout of ``world_size`` ranks, with ``ep`` carved out of dp · cp.
    Construct it in the driver to validate a configuration before any process starts
    (``ProcessMesh(dp=2, cp=2, pp=2, tp=1, ep=2, world_size=8)``), then inside every rank call
    :meth:`build` to create the process groups (all ranks must, in the same order). The first
    three positional fields stay ``(dp, pp, tp)``; ``cp`` and ``ep`` are keywords."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    world_size: int | None = None
    groups: dict = field(default_factory=dict, repr=False)
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for dim in MESH_DIMS + ("ep",):
            v = getattr(self, dim)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{dim} must be a positive int, got {v!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp·cp = {self.dp}·{self.cp} = {self.dp * self.cp}: "
                             "the expert-parallel groups are carved out of the data (and context) ranks")
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

    @property
    def expert_dp(self) -> int:
        """Size of the expert-data-parallel group: dp·cp/ep."""
        return self.dp * self.cp // self.ep

    # Contract:
    # Given: ``GROUP_DIMS``; ``self.dp``, ``self.pp``, ``self.tp``, ``self.cp``, ``self.ep``.
    # ex07.D.layout: ``coordinates(rank)`` gives ``{"pp", "dp", "cp", "tp"}`` of every rank, each
    #     coordinate in range and every rank a different point of the grid; the ranks of every tp
    #     group are consecutive, so are those of every (p, d) (a cp × tp block: context
    #     parallelism's ring stays nearer than data parallelism's reduction) and those of every
    #     pipeline stage; in every group a higher coordinate is a higher rank. With cp = 1 it is
    #     part A's layout.
    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp", "dp", "cp", "tp"}`` of global ``rank``."""
        # >>> ex07 D
        # tp fastest, then cp, dp, pp: rank = ((p·dp + d)·cp + c)·tp + t
        out = mesh_coordinates(rank, self.dp, self.pp, self.tp * self.cp)  # cp·tp as one fast dimension
        if self.cp == 1:
            return {**out, "cp": 0}
        return {"pp": out["pp"], "dp": out["dp"], "cp": out["tp"] // self.tp, "tp": out["tp"] % self.tp}
        # <<< ex07 D

    # Contract:
    # Given: ``coordinates`` (above); ``coords`` a dict ``{"pp", "dp", "cp", "tp"}``.
    # ex07.D.inverse: ``rank_of(coordinates(r)) == r`` for every rank, ``coordinates(rank_of(c)) == c``
    #     for every point c of the grid.
    def rank_of(self, coords: dict[str, int]) -> int:
        """The global rank at ``coords`` (the inverse of :meth:`coordinates`)."""
        # >>> ex07 D
        return ((coords["pp"] * self.dp + coords["dp"]) * self.cp + coords.get("cp", 0)) * self.tp + coords["tp"]
        # <<< ex07 D

    # Contract:
    # Given: ``GROUP_DIMS``: "pp", "dp", "cp", "tp", "dp_cp", "ep", "expert_dp".
    # ex07.D.dp_cp: ``members(rank, dim)`` is a list of global ranks. Along "pp", "dp", "cp" or
    #     "tp": the ranks equal to ``rank`` in every other coordinate, listed by their coordinate
    #     along dim. Along "dp_cp": the dp·cp ranks equal to ``rank`` in p and t, in increasing rank.
    # ex07.D.ep_blocks: along "ep": ``ep`` ranks of ``rank``'s dp_cp group, ``rank`` among them,
    #     neighbours in it (no rank of another ep group between two of theirs), in increasing rank;
    #     the ep groups of a dp_cp group's ranks cut it into dp·cp/ep such groups. Along
    #     "expert_dp": dp·cp/ep ranks of ``rank``'s dp_cp group, one from each of its ep groups, each
    #     at the same index in its ep group as ``rank`` in its own, in increasing rank. Both hold
    #     for every (p, t), not only the world's first dp_cp group.
    # ex07.D.dim: a dim outside ``GROUP_DIMS`` is a ``ValueError`` (as in part B).
    def members(self, rank: int, dim: str) -> list[int]:
        """Global ranks of ``rank``'s group along ``dim`` (one of ``MESH_DIMS``, or
        ``"dp_cp"``: the ranks that differ from it only in d and c; ``"ep"``, ``"expert_dp"``:
        the expert groups carved out of ``dp_cp``), in group order."""
        # >>> ex07 D
        if self.cp == 1 and dim in DIMS:
            return group_members(rank, dim, self.dp, self.pp, self.tp)
        if dim not in GROUP_DIMS:
            raise ValueError(f"dim must be one of {GROUP_DIMS}, got {dim!r}")
        c = self.coordinates(rank)
        if dim in ("dp_cp", "ep", "expert_dp"):
            dc = [self.rank_of(dict(c, dp=d, cp=k)) for d in range(self.dp) for k in range(self.cp)]
            if dim == "dp_cp":
                return dc
            i = dc.index(rank)
            if dim == "ep":                       # consecutive blocks of ep
                return dc[i - i % self.ep:i - i % self.ep + self.ep]
            return dc[i % self.ep::self.ep]        # the same place in every block
        return [self.rank_of(dict(c, **{dim: i})) for i in range(self.shape[dim])]
        # <<< ex07 D

    # Contract:
    # ex07.D.partition: ``all_groups(dim)`` is a list of every group along ``dim`` (each a list,
    #     as ``members`` gives it), each once: the groups along any dim partition the ranks, and
    #     each is ``members(r, dim)`` of every rank r in it.
    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, each a list of global ranks, without repeats."""
        # >>> ex07 D
        return [list(g) for g in dict.fromkeys(tuple(self.members(r, dim)) for r in range(self.size))]
        # <<< ex07 D

    # Contract:
    # Given: ``build()`` runs inside every rank; ``dist.new_group`` and ``name_group(group, dim)``.
    # ex07.E.order: it creates the process group of every group along each dimension in use (dp,
    #     pp, tp; cp and dp_cp when cp > 1; ep and expert_dp when ep > 1), and no other group;
    #     every rank creates every group, in the same order (a group's creation is collective
    #     over the world).
    # ex07.E.reach: ``self.groups[dim]`` is this rank's own group, a collective on it reaches
    #     exactly ``members(rank, dim)``, and this rank's rank in it is its index in that list.
    # ex07.E.keys: afterwards the keys of ``self.groups`` are exactly "dp", "pp", "tp", "dp_cp"
    #     and "expert_dp", with "cp" added when cp > 1 and "ep" added when ep > 1 (with ep = 1 a
    #     rank alone is its own expert group; whoever needs one makes it).
    # ex07.E.cp1: with cp = 1 the dp_cp group is the dp group: the same object, and no group is
    #     created for it.
    # ex07.E.ep1: with ep = 1 the expert_dp group is the dp_cp group: the same object, and no
    #     group is created for it, for any cp.
    # ex07.E.named: every group it creates is named after its dim (``name_group``), so
    #     ``group_name(self.groups[dim])`` is dim for every dim it created a group for, and the
    #     bytes a rank sends are counted per dim. A group is named on the ranks in it; the
    #     placeholder ``new_group`` returns to a rank outside the group need not be named.
    def build(self) -> "ProcessMesh":
        """Inside a rank: create this rank's dp, pp and tp process groups (and cp, dp_cp when
        cp > 1; ep and expert_dp when ep > 1)."""
        if dist.get_world_size() != self.size:
            raise ValueError(f"the mesh has {self.size} ranks but the job has {dist.get_world_size()}")
        # >>> ex07 E
        dims = DIMS + (("cp", "dp_cp") if self.cp > 1 else ()) + (("ep", "expert_dp") if self.ep > 1 else ())
        for dim in dims:
            for ranks in self.all_groups(dim):  # every rank creates every group, same order
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    self.groups[dim] = g
                    name_group(g, dim)  # its communication events are labelled dim
        if self.cp == 1:        # no cp groups (a None group would mean the world)
            self.groups["dp_cp"] = self.groups["dp"]
        if self.ep == 1:        # every rank its own ep group; expert_dp is all of dp·cp
            self.groups["expert_dp"] = self.groups["dp_cp"]
        return self
        # <<< ex07 E

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (after :meth:`build`)."""
        return self.coordinates(dist.get_rank())[dim]

    def group(self, dim: str):
        """This rank's process group along ``dim`` (after :meth:`build`)."""
        return self.groups[dim]
