"""The process mesh: coordinates, groups, and their process groups inside real ranks.

Layout (Megatron-LM): rank = p·(dp·tp) + d·tp + t, tensor-parallel ranks adjacent."""
import pytest
import torch
import torch.distributed as dist

import minipar
from minipar.mesh import DIMS, ProcessMesh, group_members, mesh_coordinates

SHAPES = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (2, 1, 4), (3, 2, 2), (1, 1, 1)]


def test_documented_example():
    """Rank 5 of dp=pp=tp=2 is (p=1, d=0, t=1) with groups tp [4, 5], dp [5, 7], pp [1, 5]."""
    assert mesh_coordinates(5, 2, 2, 2) == {"pp": 1, "dp": 0, "tp": 1}
    assert group_members(5, "tp", 2, 2, 2) == [4, 5]
    assert group_members(5, "dp", 2, 2, 2) == [5, 7]
    assert group_members(5, "pp", 2, 2, 2) == [1, 5]


@pytest.mark.parametrize("dp, pp, tp", SHAPES)
def test_coordinates_and_groups_tile_the_grid(dp, pp, tp):
    """Coordinates are a bijection; each dim's groups partition the ranks; members differ
    from the rank in that coordinate only, in coordinate order; tp groups are adjacent."""
    n = dp * pp * tp
    mesh = ProcessMesh(dp=dp, pp=pp, tp=tp, world_size=n)
    coords = [mesh_coordinates(r, dp, pp, tp) for r in range(n)]
    assert len({tuple(c.values()) for c in coords}) == n
    assert all(c["pp"] * dp * tp + c["dp"] * tp + c["tp"] == r for r, c in enumerate(coords))
    size = {"dp": dp, "pp": pp, "tp": tp}
    for dim in DIMS:
        groups = mesh.all_groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(n))
        assert len(groups) == n // size[dim]
        for r in range(n):
            g = group_members(r, dim, dp, pp, tp)
            assert r in g and len(g) == size[dim]
            assert [coords[q][dim] for q in g] == list(range(size[dim]))
            others = [d for d in DIMS if d != dim]
            assert all(coords[q][o] == coords[r][o] for q in g for o in others)
    for r in range(n):
        g = group_members(r, "tp", dp, pp, tp)
        assert g == list(range(g[0], g[0] + tp))


def test_bad_meshes_are_plain_errors():
    """A product that is not the world size, a zero size, an unknown dim, a rank off the grid."""
    with pytest.raises(ValueError, match="world_size is 6"):
        ProcessMesh(dp=2, pp=2, tp=2, world_size=6)
    with pytest.raises(ValueError, match="positive"):
        ProcessMesh(dp=0, pp=1, tp=1)
    with pytest.raises(ValueError, match="dim"):
        group_members(0, "ep", 2, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        mesh_coordinates(8, 2, 2, 2)


def _groups_in_ranks(dp, pp, tp):
    """Rank function: build the mesh; sum the global ranks over each group."""
    mesh = ProcessMesh(dp=dp, pp=pp, tp=tp).build()
    out = {}
    for dim in DIMS:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(dim))
        out[dim] = (mesh.rank(dim), dist.get_world_size(mesh.group(dim)), t.item(),
                    dist.get_rank(mesh.group(dim)))
    return out


def test_process_groups_inside_ranks():
    """On 8 ranks (2, 2, 2): each group reduces over exactly its members, with the rank's
    coordinate as its group-local rank."""
    results = minipar.launch(_groups_in_ranks, 8, args=(2, 2, 2), timeout=60)
    for r, out in enumerate(results):
        for dim in DIMS:
            coord, size, total, local = out[dim]
            members = group_members(r, dim, 2, 2, 2)
            assert coord == mesh_coordinates(r, 2, 2, 2)[dim] == local
            assert size == 2 and total == sum(members)


def test_context_parallel_sits_between_tp_and_dp():
    """rank = p·(dp·cp·tp) + d·(cp·tp) + c·tp + t (Megatron-LM's order, module docstring), with
    cp and tp of different sizes so that swapping them shows: dp=2, cp=2, tp=3, pp=2 (24 ranks)."""
    mesh = ProcessMesh(dp=2, pp=2, tp=3, cp=2)
    for rank in range(mesh.size):
        p, d, c, t = rank // 12, rank // 6 % 2, rank // 3 % 2, rank % 3
        assert mesh.coordinates(rank) == {"pp": p, "dp": d, "cp": c, "tp": t}, rank
        assert mesh.rank_of(mesh.coordinates(rank)) == rank
    # rank 10 = (p=0, d=1, c=1, t=1): tp neighbours adjacent, cp ones tp apart, dp ones cp·tp apart
    assert mesh.members(10, "tp") == [9, 10, 11]
    assert mesh.members(10, "cp") == [7, 10]
    assert mesh.members(10, "dp") == [4, 10]
    assert mesh.members(10, "pp") == [10, 22]
    assert mesh.members(10, "dp_cp") == [1, 4, 7, 10]
