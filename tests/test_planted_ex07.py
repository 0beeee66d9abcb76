"""ex07's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""
import pytest

from minipar.course.graded import test_ex07_hybrid as g
from tests.planted import fails, planted

PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex07.A.order": (
        [('return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}',
          'return {"pp": rank // (dp * tp), "dp": rank % dp, "tp": rank // dp % tp}')],
        g.test_coordinates, r"mesh_coordinates on dp = \d, pp = \d, tp = \d.*expected"),
    "ex07.A.range": (
        [("    if not 0 <= rank < dp * pp * tp:\n        raise", "    if False:\n        raise")],
        g.test_coordinates_off_the_grid, r"off the 8-rank grid: a ValueError"),
    "ex07.B.order": (
        [("    for i in range(sizes[dim]):", "    for i in reversed(range(sizes[dim])):")],
        g.test_group_members_every_mesh, r"(?s)group_members\(\d+, '\w+'\).*in another order than their coordinate"),
    "ex07.B.dim": (
        [("    if dim not in DIMS:\n        raise ValueError(f\"dim must be one of {DIMS}, got {dim!r}\")",
          "    if dim not in DIMS:\n        return []")],
        g.test_group_members_example, r"'xp'.*an unknown dim is a ValueError"),
    "ex07.C.fit": (
        [("        if memory_per_rank is not None and need > memory_per_rank:", "        if False:")],
        g.test_choose_config, r"choose_config\(world_size=8, batch_size=8, memory_per_rank"),
    "ex07.C.prefer": (
        [('key = (c["tp"] * c["pp"], c["tp"] > ranks_per_node, c["pp"])', 'key = (c["tp"] * c["pp"], c["pp"])')],
        g.test_choose_config, r"ranks_per_node=2"),
    "ex07.C.none": (
        [("    if best is None:\n        raise", "    if best is None:\n        return {'dp': world_size, 'pp': 1, 'tp': 1}\n        raise")],
        g.test_choose_config_respects_the_model, r"nothing fits in 1000 bytes"),
    "ex07.D.layout": (
        [('"cp": out["tp"] // self.tp, "tp": out["tp"] % self.tp}', '"cp": out["tp"] % self.cp, "tp": out["tp"] // self.cp}')],
        g.test_mesh_coordinates_with_cp, r"ProcessMesh\(dp=2, pp=1, cp=2, tp=2, ep=2\)\.coordinates"),
    "ex07.D.inverse": (
        [('* self.cp + coords.get("cp", 0)) * self.tp + coords["tp"]', '* self.cp + coords["tp"]) * self.tp + coords.get("cp", 0)')],
        g.test_mesh_coordinates_with_cp, r"rank_of\(coordinates of rank\)"),
    "ex07.D.dp_cp": (
        [("for d in range(self.dp) for k in range(self.cp)]", "for k in range(self.cp) for d in range(self.dp)]")],
        g.test_mesh_members_every_dim, r"members\(rank, 'dp_cp'\)"),
    "ex07.D.partition": (
        [("dict.fromkeys(tuple(self.members(r, dim)) for r in range(self.size))",
          "[tuple(self.members(r, dim)) for r in range(self.size)]")],
        g.test_mesh_members_every_dim, r"all_groups\('\w+'\)"),
    "ex07.D.ep_blocks": (
        [("            i = dc.index(rank)", "            i = rank % len(dc)")],
        g.test_mesh_members_every_dim, r"members\(rank, '(ep|expert_dp)'\)"),
    "ex07.D.dim": (
        [('            raise ValueError(f"dim must be one of {GROUP_DIMS}, got {dim!r}")', "            return []")],
        g.test_mesh_members_every_dim, r"members\(0, 'xp'\) returned \[\]; an unknown dim is a ValueError"),
    "ex07.E.reach": (
        [("                if dist.get_rank() in ranks:\n", "                if True:\n")],
        g.test_mesh_build_reaches_the_members, r"the ranks an all-reduce over self.groups\['\w+'\] reached"),
    "ex07.E.cp1": (
        [('            self.groups["dp_cp"] = self.groups["dp"]', "            pass")],
        g.test_3d_training_on_your_mesh, r"KeyError: 'dp_cp'"),
    "ex07.E.ep1": (
        [('            self.groups["expert_dp"] = self.groups["dp_cp"]', '            self.groups["expert_dp"] = self.groups["tp"]')],
        g.test_mesh_build_reaches_the_members, r"self.groups\['expert_dp'\] reached, ProcessMesh\(dp=2, pp=2, cp=1"),
}


def test_every_clause_is_planted_or_excused():
    """Every CONTRACT clause has a plant here, except the one no plant can show without a hang
    (a rank that skips a group's creation leaves the others waiting in it until the timeout)."""
    from minipar.course.markers import clauses
    excused = {"ex07.E.order"}
    from minipar.course.grading import observed
    assert set(observed(g)) - excused == set(PLANTS)
    for clause in observed(g):
        assert clause in clauses("ex07")


@pytest.mark.parametrize("clause", list(PLANTS))
def test_planted_answer_fails(clause, tmp_path):
    edits, test, match = PLANTS[clause]
    from minipar.course.grading import observed
    assert test.__name__ in observed(g)[clause]
    with planted("ex07", tmp_path, *edits):
        fails(test, match=match)
