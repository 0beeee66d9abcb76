"""ex07's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""
import pytest

from minipar.course.graded import test_ex07_hybrid as g
from tests.planted import fails, more_tests, names_its_clause, planted

KEY = 'key = (c["tp"] * c["pp"], crosses, c["pp"])'
CROSSES = ('        crosses = any(len({q // ranks_per_node for q in group_members(r, "tp", c["dp"], c["pp"], c["tp"])}) > 1\n'
           '                      for r in range(world_size))\n')
DC = "for d in range(self.dp) for k in range(self.cp)]"
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex07.A.bijection": (
        [('"dp": rank // tp % dp', '"dp": rank // tp')],
        g.test_coordinates_are_a_bijection, r"ex07\.A\.bijection mesh_coordinates on .*dp = \d+, outside 0 \.\. \d"),
    "ex07.A.order": (   # dp fastest: the same groups as the contract's when dp = 1 or tp = 1, not otherwise
        [('return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}',
          'return {"pp": rank // (dp * tp), "dp": rank % dp, "tp": rank // dp % tp}')],
        g.test_coordinates_keep_groups_together, r"ex07\.A\.order .*the ranks of one tp group .* not consecutive"),
    "ex07.A.range": (
        [("    if not 0 <= rank < dp * pp * tp:\n        raise", "    if False:\n        raise")],
        g.test_coordinates_off_the_grid, r"off the 8-rank grid: a ValueError"),
    "ex07.B.members": (
        [("    for i in range(sizes[dim]):", "    for i in reversed(range(sizes[dim])):")],
        g.test_group_members_every_mesh, r"ex07\.B\.members group_members\(\d+, '\w+'\).*group-local rank"),
    "ex07.B.dim": (
        [("    if dim not in DIMS:\n        raise ValueError(f\"dim must be one of {DIMS}, got {dim!r}\")",
          "    if dim not in DIMS:\n        return []")],
        g.test_group_members_unknown_dim, r"'xp'.*an unknown dim is a ValueError"),
    "ex07.C.fit": (
        [("        if memory_per_rank is not None and need > memory_per_rank:", "        if False:")],
        g.test_choose_config, r"ex07\.C\.fit choose_config\(world_size=8, batch_size=8, memory_per_rank.*do not fit"),
    "ex07.C.prefer": (  # the sort key of the rule as often written: tp ≤ ranks per node
        [(KEY, 'key = (c["tp"] * c["pp"], c["tp"] > ranks_per_node, c["pp"])')],
        g.test_choose_config, r"ex07\.C\.prefer choose_config\(6 heads, world_size=12.*ranks_per_node=4\) chose "
                              r"\{'dp': 2, 'pp': 2, 'tp': 3\}: a tp group spans nodes \[0, 1\]"),
    "ex07.C.none": (
        [("    if best is None:\n        raise", "    if best is None:\n        return {'dp': world_size, 'pp': 1, 'tp': 1}\n        raise")],
        g.test_choose_config_nothing_fits, r"nothing fits in 1000 bytes"),
    "ex07.D.layout": (
        [('"cp": out["tp"] // self.tp, "tp": out["tp"] % self.tp}', '"cp": out["tp"] % self.cp, "tp": out["tp"] // self.cp}')],
        g.test_mesh_coordinates_with_cp, r"ex07\.D\.layout ProcessMesh\(dp=2, pp=1, cp=2, tp=2, ep=2\)\.coordinates: "
                                         r"the ranks of one tp group .* not consecutive"),
    "ex07.D.inverse": (
        [('* self.cp + coords.get("cp", 0)) * self.tp + coords["tp"]', '* self.cp + coords["tp"]) * self.tp + coords.get("cp", 0)')],
        g.test_mesh_rank_of_inverts, r"ex07\.D\.inverse .*rank_of\(coordinates\(rank\)\)"),
    "ex07.D.dp_cp": (
        [(DC, "for k in range(self.cp) for d in range(self.dp)]")],
        g.test_mesh_members_every_dim, r"ex07\.D\.dp_cp .*members\(\d+, 'dp_cp'\)"),
    "ex07.D.partition": (
        [("dict.fromkeys(tuple(self.members(r, dim)) for r in range(self.size))",
          "[tuple(self.members(r, dim)) for r in range(self.size)]")],
        g.test_mesh_members_every_dim, r"ex07\.D\.partition .*all_groups\('\w+'\) lists a group twice"),
    "ex07.D.ep_blocks": (
        [("            i = dc.index(rank)", "            i = rank % len(dc)")],
        g.test_mesh_members_every_dim, r"ex07\.D\.ep_blocks ProcessMesh\(.*\): rank \d+'s (ep|expert_dp) group"),
    "ex07.D.dim": (
        [('            raise ValueError(f"dim must be one of {GROUP_DIMS}, got {dim!r}")', "            return []")],
        g.test_mesh_members_every_dim, r"members\(0, 'xp'\) returned \[\]; an unknown dim is a ValueError"),
    "ex07.E.reach": (
        [("                if dist.get_rank() in ranks:\n", "                if True:\n")],
        g.test_mesh_build_reaches_the_members, r"the ranks an all-reduce over self.groups\['\w+'\] reached"),
    "ex07.E.cp1": (   # an unused group made for dp_cp with cp = 1, the alias kept
        [('            self.groups["dp_cp"] = self.groups["dp"]',
          '            [dist.new_group(r) for r in self.all_groups("dp")]\n'
          '            self.groups["dp_cp"] = self.groups["dp"]')],
        g.test_mesh_build_reaches_the_members, r"ex07\.E\.cp1.* the groups build\(\) created \(new_group calls\), "
                                               r"ProcessMesh\(dp=2, pp=2, cp=1"),
    "ex07.E.ep1": (   # expert_dp the dp group: right with cp = 1, wrong with cp > 1
        [('            self.groups["expert_dp"] = self.groups["dp_cp"]', '            self.groups["expert_dp"] = self.groups["dp"]')],
        g.test_mesh_build_reaches_the_members, r"ex07\.E\.ep1 ProcessMesh\(dp=2, pp=1, cp=2, tp=2, ep=1\): "
                                               r"self.groups\['expert_dp'\] is not self.groups\['dp_cp'\]"),
    "ex07.E.keys": (   # the cp and dp_cp groups made whatever cp
        [('(("cp", "dp_cp") if self.cp > 1 else ())', '("cp", "dp_cp")')],
        g.test_mesh_build_reaches_the_members, r"ex07\.E\.keys the keys of self.groups after build\(\), "
                                               r"ProcessMesh\(dp=2, pp=2, cp=1"),
    "ex07.E.named": (
        [("                    name_group(g, dim)  # its communication events are labelled dim", "")],
        g.test_mesh_build_reaches_the_members, r"ex07\.E\.named group_name\(self.groups\[dim\]\)"),
}
MORE = [  # further wrong answers: (clause, edits, graded test, what the message must name)
    ("ex07.E.cp1", [('            self.groups["dp_cp"] = self.groups["dp"]', "            pass")],   # no dp_cp at all
     g.test_3d_training_on_your_mesh, r"KeyError: 'dp_cp'"),
    ("ex07.E.ep1", [('            self.groups["expert_dp"] = self.groups["dp_cp"]',   # one made for expert_dp too
                     '            [dist.new_group(r) for r in self.all_groups("dp_cp")]\n'
                     '            self.groups["expert_dp"] = self.groups["dp_cp"]')],
     g.test_mesh_build_reaches_the_members, r"ex07\.E\.(cp1, ex07\.E\.)?ep1 the groups build\(\) created "
                                            r"\(new_group calls\), ProcessMesh\(dp=2, pp=2, cp=1"),
    ("ex07.A.order", [('"tp": rank % tp}', '"tp": tp - 1 - rank % tp}')],        # a tp group's order reversed
     g.test_coordinates_keep_groups_together, r"ex07\.A\.order .*differ only in tp, and the lower rank"),
    ("ex07.A.order", [('return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}',   # pp fastest
                       'return {"pp": rank % pp, "dp": rank // pp % dp, "tp": rank // (pp * dp)}')],
     g.test_coordinates_keep_groups_together, r"ex07\.A\.order .*not consecutive"),
    ("ex07.C.prefer", [(KEY, 'key = (c["tp"] * c["pp"], c["pp"])')],                  # nodes ignored
     g.test_choose_config, r"ex07\.C\.prefer .*a tp group spans nodes"),
    ("ex07.C.prefer", [(KEY, 'key = (c["tp"] * c["pp"], crosses, c["tp"])')],          # fewest tp, not fewest stages
     g.test_choose_config, r"ex07\.C\.prefer .*pipeline stages, while .* smaller bubble"),
    ("ex07.C.prefer", [(KEY, 'key = (crosses, c["pp"], c["tp"] * c["pp"])')],          # the bubble before the dp
     g.test_choose_config, r"ex07\.C\.prefer .*more data parallelism"),
    ("ex07.C.prefer", [(KEY, 'key = (crosses, c["tp"] * c["pp"], c["pp"])')],          # aims 1 and 2 swapped
     g.test_choose_config, r"ex07\.C\.prefer choose_config\(10 heads, world_size=60.*more data parallelism"),
    ("ex07.C.fit", [("need > memory_per_rank:", "need >= memory_per_rank:")],            # equal refused
     g.test_choose_config, r"ex07\.C\.fit choose_config\(world_size=8, .*needs exactly memory_per_rank"),
    ("ex07.C.prefer", [(CROSSES, '        crosses = ranks_per_node % c["tp"] != 0\n')],     # "inside a node" as tp | n
     g.test_choose_config, r"ex07\.C\.prefer choose_config\(6 heads, world_size=6, .*chose \{'dp': 2, 'pp': 3, "
                           r"'tp': 1\}: 3 pipeline stages"),
    ("ex07.C.none", [("    if best is None:\n        raise", "    if best is None:\n        max([])\n        raise")],
     g.test_choose_config_nothing_fits, r"raised ValueError\('max\(\) .*does not give the budget, 1000"),  # max() over nothing
]
REVERSED = [("                g = dist.new_group(ranks)", "                g = dist.new_group(ranks[::-1], sort_ranks=False)")]


def test_every_clause_is_planted_or_excused():
    """Every CONTRACT clause has a plant here; ex07.E.order's (a hang) runs under a short launch
    timeout in its own test, below."""
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
        message = fails(test, match=match)
    names_its_clause(message, test, clause)


test_more_wrong_answers_fail = more_tests("ex07", g, MORE)


def test_groups_created_in_another_order_hang_naming_the_clause(tmp_path, monkeypatch):
    """Rank 0 creates the groups of each dim in the reverse order: its peers wait inside
    new_group for a group rank 0 is not creating then; the hang fails naming ex07.E.order and
    the ranks inside new_group (a short launch timeout: a hang is all this shows)."""
    monkeypatch.setattr(g, "BUILD_TIMEOUT", 30)
    edits = [("            for ranks in self.all_groups(dim):",
              "            for ranks in self.all_groups(dim)[::-1 if dist.get_rank() == 0 else 1]:")]
    with planted("ex07", tmp_path, *edits):
        message = fails(g.test_mesh_build_reaches_the_members,
                        match=r"(?s)ex07\.E\.order.*the ranks hung in build\(\).*inside new_group\(")
    names_its_clause(message, g.test_mesh_build_reaches_the_members, "ex07.E.order")


def test_groups_whose_ranks_are_not_in_members_order_fail_reach(tmp_path):
    """Each group created with its ranks in reverse (``sort_ranks=False``, torch 2.10 and later): an
    all-reduce still reaches the right ranks, but a rank's group rank is no longer its index in
    members(rank, dim), which the pipeline and tensor parallelism read as its coordinate; the
    failure names ex07.E.reach."""
    import inspect
    import torch.distributed as dist
    if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
        pytest.skip("this torch's new_group always sorts the ranks: the group rank is the index")
    with planted("ex07", tmp_path, *REVERSED):
        message = fails(g.test_mesh_build_reaches_the_members,
                        match=r"ex07\.E\.reach each rank's rank in self\.groups\['(dp|pp|tp|cp|dp_cp|ep|expert_dp)'\]")
    names_its_clause(message, g.test_mesh_build_reaches_the_members, "ex07.E.reach")
