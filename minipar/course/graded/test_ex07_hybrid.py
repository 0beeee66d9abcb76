"""Exercise 07: the process mesh, and choosing a configuration.

A. ``mesh_coordinates(rank, dp, pp, tp)``: the ranks of a dp × pp × tp job are laid out as
   Megatron-LM lays them out (Narayanan et al. 2021, §3.3): tensor-parallel ranks vary
   fastest (adjacent ranks share a node's fast links), then data-parallel ranks, and the
   pipeline stage slowest. Return ``{"pp": p, "dp": d, "tp": t}``, the coordinates of global
   ``rank``. Invariant: every rank 0 .. dp·pp·tp - 1 gets distinct coordinates within the
   mesh, in that order of variation; a rank outside the mesh is a ``ValueError``.
B. ``group_members(rank, dim, dp, pp, tp)``: the global ranks of ``rank``'s group along
   ``dim`` (``"dp"``, ``"pp"`` or ``"tp"``): the ranks that share ``rank``'s coordinates in
   the two other dimensions, ordered by their coordinate along ``dim`` (a rank's index in
   the list is its group-local rank). Example: dp = pp = tp = 2, rank 5 has tp group
   [4, 5], dp group [5, 7] and pp group [1, 5]. An unknown ``dim`` is a ``ValueError``.
C. ``choose_config(config, world_size, batch_size, microbatches=1, memory_per_rank=None,
   ranks_per_node=8, zero1=False)``: Narayanan et al.'s advice (§3, Takeaways #1 and #2) as a
   rule. Among the configurations ``valid_configs`` allows (every dp·pp·tp = world_size the
   model and the batch accept), keep those whose model states per rank
   (``hybrid_memory_per_rank``, fp32 Adam) fit in ``memory_per_rank`` (no limit when
   ``None``); among those take the least model parallelism tp·pp (data parallelism for the
   rest), then tensor parallelism that stays within a node, then the fewest pipeline
   stages. Return ``{"dp", "pp", "tp"}``; nothing left is a ``ValueError``.

D. ``ProcessMesh.coordinates``, ``rank_of``, ``members`` and ``all_groups``: the same layout
   with context parallelism and expert parallelism. The ranks form a (pp, dp, cp, tp) grid,
   tp fastest, then cp, dp, pp: rank = ((p·dp + d)·cp + c)·tp + t. ``members(rank, dim)``
   takes every dim of ``GROUP_DIMS``: along "pp", "dp", "cp" or "tp" the ranks that differ
   only in that coordinate; "dp_cp" the dp·cp ranks that differ only in (d, c),
   in (d, c) order; "ep" its block of ``ep`` consecutive members of that dp_cp list, and
   "expert_dp" the members at the same place of every block (dp·cp/ep ranks).
   ``all_groups(dim)`` lists every group along dim once.
   Invariant: coordinates and rank_of are inverse;
   the groups along any dim partition the ranks;
   the ep groups of every (p, t) are carved out of their own dp_cp list,
   not only those of rank 0 (a non-world group);
   an unknown dim is a ``ValueError`` here too.
E. ``ProcessMesh.build()``, inside every rank: create the process group of every group along
   each dimension in use (dp, pp, tp; cp and dp_cp when cp > 1; ep and expert_dp when
   ep > 1) and keep this rank's own in ``self.groups[dim]``;
   with cp = 1 the dp_cp group is the dp group,
   with ep = 1 the expert_dp group is the dp_cp group.
   Invariant: every rank creates every group in the same order (a group's creation is
   collective over the world), and
   a collective on ``self.groups[dim]`` reaches exactly ``members(rank, dim)``.

Derived in notebook 07, "Why combine" and "3D training is still the same training". The
last tests build a mesh with cp and ep on 8 ranks and reduce over each of its groups, and
train the GPT in 3D (dp = pp = tp = 2) with the library's hybrid training, whose process mesh
then comes from your functions, and compare with one process. Stuck?
``minipar.hint("ex07", "A")`` (or "B" .. "E"). Grade it with ``python -m minipar.grade ex07``.
"""
import dataclasses


import minipar
from minipar import data, hybrid, mesh, reference
from minipar.course.grading import diagnose, expect, expect_equal, expect_same_training, observes
from minipar.models import GPT, GPTConfig

EXERCISE = "ex07_hybrid"
HINTS = {
    "A": ("Think of a mixed-radix number: the fastest-varying coordinate is the last digit.",
          "A block of dp·tp consecutive ranks shares one pipeline stage; inside it, blocks of tp "
          "consecutive ranks share one data-parallel index. Check the range first.",
          "rank = p·(dp·tp) + d·tp + t: p, rest = divmod(rank, dp * tp); d, t = divmod(rest, tp)."),
    "B": ("Start from the rank's own coordinates: the other members differ from it in one "
          "coordinate only.",
          "For i in 0 .. size(dim) - 1, replace the rank's coordinate along dim by i and turn the "
          "coordinates back into a global rank; the list comes out in group order.",
          "c = mesh_coordinates(rank, dp, pp, tp); [q[\"pp\"]·dp·tp + q[\"dp\"]·tp + q[\"tp\"] "
          "for q = c with c[dim] = i, i in range(size[dim])]; an unknown dim is a ValueError."),
    "C": ("The rule is an order of preference: can you express it as one sort key?",
          "Skip the configurations whose hybrid_memory_per_rank(num_params(config), dp, pp, tp, "
          "zero1=zero1)[\"total\"] exceeds the budget; keep the one with the smallest key.",
          "key = (tp·pp, tp > ranks_per_node, pp); best = min, by key, over the configurations "
          "valid_configs returns for the same arguments that fit; none fits: raise ValueError."),
    "D": ("The mesh with cp is the 3D mesh with cp·tp as its fastest dimension: the part A you wrote "
          "already does half the work. The expert groups are a list cut into pieces.",
          "coordinates: mesh_coordinates(rank, dp, pp, tp·cp), then split its fast coordinate into "
          "(c, t) = divmod(fast, tp); rank_of is the mixed-radix number read back. members: change "
          "one coordinate through its range, rank_of each; for dp_cp change (d, c) together, in "
          "(d, c) order; ep and expert_dp are slices of that dp_cp list.",
          "dc = [rank_of(c with dp=d, cp=k) for d in range(dp) for k in range(cp)]; i = dc.index(rank); "
          "ep: dc[i - i % ep : i - i % ep + ep]; expert_dp: dc[i % ep :: ep]; all_groups: the distinct "
          "tuples of members(r, dim) over every r, in first-seen order (dict.fromkeys)."),
    "E": ("dist.new_group must be called by every rank of the job, even by ranks not in the group.",
          "Loop over the dims in use, and over all_groups(dim) for each; every rank calls new_group on "
          "every list, and keeps the group only when its own rank is in it.",
          "for dim in DIMS + cp dims + ep dims: for ranks in self.all_groups(dim): g = dist.new_group(ranks); "
          "if dist.get_rank() in ranks: self.groups[dim] = g; name_group(g, dim). Then, when cp == 1, "
          "groups['dp_cp'] = groups['dp']; when ep == 1, groups['expert_dp'] = groups['dp_cp']."),
}
CONTRACT = {
    "tensor-parallel ranks vary": "test_coordinates",
    "a rank outside the mesh is a ``ValueError``": "test_coordinates_off_the_grid",
    "ordered by their coordinate along ``dim``": "test_group_members_every_mesh",
    "An unknown ``dim`` is a ``ValueError``": "test_group_members_example",
    "fit in ``memory_per_rank``": "test_choose_config",
    "then tensor parallelism that stays within a node": "test_choose_config",
    "nothing left is a ``ValueError``": "test_choose_config_respects_the_model",
    "tp fastest, then cp, dp, pp": "test_mesh_coordinates_with_cp",
    "coordinates and rank_of are inverse": "test_mesh_coordinates_with_cp",
    "in (d, c) order": "test_mesh_members_every_dim",
    "the groups along any dim partition the ranks": "test_mesh_members_every_dim",
    "not only those of rank 0 (a non-world group)": ("test_mesh_members_every_dim",
                                                     "test_mesh_build_reaches_the_members"),
    "an unknown dim is a ``ValueError`` here too": "test_mesh_members_every_dim",
    "every rank creates every group in the same order": "test_mesh_build_reaches_the_members",
    "a collective on ``self.groups[dim]`` reaches exactly ``members(rank, dim)``":
        "test_mesh_build_reaches_the_members",
    "with cp = 1 the dp_cp group is the dp group": ("test_mesh_build_reaches_the_members",
                                                     "test_3d_training_on_your_mesh"),
    "with ep = 1 the expert_dp group is the dp_cp group": ("test_mesh_build_reaches_the_members",
                                                            "test_3d_training_on_your_mesh"),
}
TIMEOUT = 60
SHAPES = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (3, 1, 2), (2, 3, 1)]
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=4, n_embd=32)
PSI = hybrid.num_params(CFG)


def _want_coords(r, dp, pp, tp):
    return {"pp": r // (dp * tp), "dp": (r // tp) % dp, "tp": r % tp}


@observes('ex07.A.tp_fastest')
def test_coordinates(impl):
    """mesh_coordinates on several meshes: each rank's coordinates (the contract's rank order)."""
    for dp, pp, tp in SHAPES:
        got = {r: mesh.mesh_coordinates(r, dp, pp, tp) for r in range(dp * pp * tp)}
        expect_equal(got, {r: _want_coords(r, dp, pp, tp) for r in range(dp * pp * tp)},
                     f"mesh_coordinates on dp = {dp}, pp = {pp}, tp = {tp}", keys="rank")


@observes('ex07.A.off_grid')
def test_coordinates_off_the_grid(impl):
    """A rank outside the mesh is a ValueError."""
    expect_equal(mesh.mesh_coordinates(0, 1, 1, 1), {"pp": 0, "dp": 0, "tp": 0}, "mesh_coordinates(0, 1, 1, 1)")
    for bad in (8, -1):
        try:
            got = mesh.mesh_coordinates(bad, 2, 2, 2)
        except ValueError:
            continue
        expect(False, f"mesh_coordinates({bad}, dp=2, pp=2, tp=2) returned {got}; rank {bad} is off the "
                      "8-rank grid: a ValueError")


@observes('ex07.B.unknown_dim')
def test_group_members_example(impl):
    """group_members of one rank of dp = pp = tp = 2: its tp, dp and pp groups."""
    got = {dim: mesh.group_members(5, dim, 2, 2, 2) for dim in ("tp", "dp", "pp")}
    expect_equal(got, {"tp": [4, 5], "dp": [5, 7], "pp": [1, 5]},
                 "rank 5's groups on dp = pp = tp = 2 (rank 5 = p 1, d 0, t 1)", keys="dim")
    try:
        bad = mesh.group_members(5, "xp", 2, 2, 2)
    except ValueError:
        return
    expect(False, f"group_members(5, 'xp', ...) returned {bad}; an unknown dim is a ValueError")


def _check_groups(dp, pp, tp):
    n, size = dp * pp * tp, {"dp": dp, "pp": pp, "tp": tp}
    for dim in ("dp", "pp", "tp"):
        for r in range(n):
            g = list(mesh.group_members(r, dim, dp, pp, tp))
            c = _want_coords(r, dp, pp, tp)
            want = sorted(range(n), key=lambda q: _want_coords(q, dp, pp, tp)[dim])
            want = [q for q in want if all(_want_coords(q, dp, pp, tp)[d] == c[d] for d in c if d != dim)]
            with diagnose(lambda e: sorted(g) == sorted(want), "the group holds the right ranks, in another order "
                          "than their coordinate along dim"):
                expect_equal(g, want, f"group_members({r}, {dim!r}) on dp = {dp}, pp = {pp}, tp = {tp} "
                                      f"(rank {r} = p {c['pp']}, d {c['dp']}, t {c['tp']})", keys="member")


@observes('ex07.B.member_order')
def test_group_members_every_mesh(impl):
    """Every group holds the ranks that differ only along dim, ordered by that coordinate."""
    for shape in SHAPES:
        _check_groups(*shape)


CHOICES = [  # (kwargs, expected)
    (dict(world_size=8, batch_size=8), {"dp": 8, "pp": 1, "tp": 1}),
    (dict(world_size=8, batch_size=8, microbatches=2), {"dp": 4, "pp": 1, "tp": 2}),
    (dict(world_size=8, batch_size=8, memory_per_rank=16 * PSI / 4 * 1.01), {"dp": 2, "pp": 1, "tp": 4}),
    (dict(world_size=8, batch_size=8, memory_per_rank=16 * PSI / 4 * 1.01, ranks_per_node=2),
     {"dp": 2, "pp": 2, "tp": 2}),
    (dict(world_size=8, batch_size=8, memory_per_rank=10 * PSI, zero1=True), {"dp": 8, "pp": 1, "tp": 1}),
    (dict(world_size=8, batch_size=8, memory_per_rank=10 * PSI), {"dp": 4, "pp": 1, "tp": 2}),
    (dict(world_size=4, batch_size=4, memory_per_rank=16 * PSI / 4 * 1.01), {"dp": 1, "pp": 1, "tp": 4}),
]


@observes('ex07.C.fits', 'ex07.C.tp_in_node')
def test_choose_config(impl):
    """choose_config's choice against the contract's on several models and clusters."""
    for kw, want in CHOICES:
        expect_equal(hybrid.choose_config(CFG, **kw), want,
                     "choose_config(" + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in kw.items()) + ")", keys="dim")


@observes('ex07.C.nothing_left')
def test_choose_config_respects_the_model(impl):
    """A model whose heads do not divide over the tensor-parallel ranks, and a memory budget nothing fits."""
    odd = dataclasses.replace(CFG, n_head=3, n_embd=48, vocab_size=48)
    psi = hybrid.num_params(odd)
    expect_equal(hybrid.choose_config(odd, 8, 8, memory_per_rank=16 * psi / 2 * 1.01), {"dp": 4, "pp": 2, "tp": 1},
                 "choose_config for 3 heads, world 8, memory for half the model states", keys="dim")
    expect_equal(hybrid.choose_config(odd, 8, 8, memory_per_rank=16 * psi / 4 * 1.01), {"dp": 2, "pp": 4, "tp": 1},
                 "choose_config for 3 heads, world 8, memory for a quarter of the model states", keys="dim")
    try:
        got = hybrid.choose_config(CFG, 8, 8, memory_per_rank=1000)
    except ValueError:
        return
    expect(False, f"choose_config(memory_per_rank=1000) returned {got}; nothing fits in 1000 bytes: a ValueError")


MESHES = [dict(dp=2, pp=1, cp=2, tp=2, ep=2), dict(dp=4, pp=2, cp=1, tp=1, ep=2),
          dict(dp=3, pp=2, cp=2, tp=1, ep=3), dict(dp=1, pp=2, cp=3, tp=2, ep=1)]


def _want4(r, m):
    t, c = r % m["tp"], r // m["tp"] % m["cp"]
    d, p = r // (m["tp"] * m["cp"]) % m["dp"], r // (m["tp"] * m["cp"] * m["dp"])
    return {"pp": p, "dp": d, "cp": c, "tp": t}


def _want_members(r, dim, m):
    n = m["dp"] * m["pp"] * m["cp"] * m["tp"]
    c = _want4(r, m)
    if dim in ("pp", "dp", "cp", "tp"):
        same = [q for q in range(n) if all(_want4(q, m)[x] == c[x] for x in c if x != dim)]
        return sorted(same, key=lambda q: _want4(q, m)[dim])
    dc = sorted((q for q in range(n) if _want4(q, m)["pp"] == c["pp"] and _want4(q, m)["tp"] == c["tp"]),
                key=lambda q: (_want4(q, m)["dp"], _want4(q, m)["cp"]))
    if dim == "dp_cp":
        return dc
    i, ep = dc.index(r), m["ep"]
    return dc[i - i % ep:i - i % ep + ep] if dim == "ep" else dc[i % ep::ep]


def _mesh_name(m):
    return "ProcessMesh(" + ", ".join(f"{k}={v}" for k, v in m.items()) + ")"


@observes('ex07.D.cp_order', 'ex07.D.inverse')
def test_mesh_coordinates_with_cp(impl):
    """coordinates and rank_of on meshes with cp: the contract's rank order, each the other's inverse."""
    for m in MESHES:
        pm, n = mesh.ProcessMesh(**m), m["dp"] * m["pp"] * m["cp"] * m["tp"]
        got = {r: pm.coordinates(r) for r in range(n)}
        expect_equal(got, {r: _want4(r, m) for r in range(n)}, f"{_mesh_name(m)}.coordinates", keys="rank")
        back = {r: pm.rank_of(_want4(r, m)) for r in range(n)}
        expect_equal(back, {r: r for r in range(n)}, f"{_mesh_name(m)}.rank_of(coordinates of rank)",
                     keys="rank")


@observes('ex07.D.dc_order', 'ex07.D.partition', 'ex07.D.any_rank', 'ex07.D.unknown_dim_members')
def test_mesh_members_every_dim(impl):
    """members along every dim of GROUP_DIMS on meshes with cp and ep, at every rank; all_groups
    lists each group once and partitions the ranks; an unknown dim is a ValueError."""
    for m in MESHES:
        pm, n = mesh.ProcessMesh(**m), m["dp"] * m["pp"] * m["cp"] * m["tp"]
        for dim in mesh.GROUP_DIMS:
            got = {r: list(pm.members(r, dim)) for r in range(n)}
            want = {r: _want_members(r, dim, m) for r in range(n)}
            expect_equal(got, want, f"{_mesh_name(m)}.members(rank, {dim!r})", keys="rank")
            groups = [list(g) for g in pm.all_groups(dim)]
            want_groups = [list(g) for g in dict.fromkeys(tuple(want[r]) for r in range(n))]
            expect_equal(groups, want_groups, f"{_mesh_name(m)}.all_groups({dim!r})", keys="group")
    try:
        bad = mesh.ProcessMesh(dp=2, cp=2).members(0, "xp")
    except ValueError:
        return
    expect(False, f"ProcessMesh(dp=2, cp=2).members(0, 'xp') returned {bad}; an unknown dim is a ValueError")


BUILT = dict(dp=2, pp=2, cp=2, tp=1, ep=2)
PLAIN = dict(dp=2, pp=2, cp=1, tp=2, ep=1)


def _reduce_over_groups():
    import torch
    import torch.distributed as dist
    pm = mesh.ProcessMesh(**BUILT, world_size=8).build()
    out = {}
    for dim in mesh.GROUP_DIMS:
        x = torch.tensor([2.0 ** dist.get_rank()], dtype=torch.float64)   # one bit per rank
        dist.all_reduce(x, group=pm.group(dim))
        out[dim] = [q for q in range(8) if int(x.item()) >> q & 1]
    plain = mesh.ProcessMesh(**PLAIN, world_size=8).build()      # cp = ep = 1: the aliases
    for dim in ("dp_cp", "expert_dp"):
        x = torch.tensor([2.0 ** dist.get_rank()], dtype=torch.float64)
        dist.all_reduce(x, group=plain.group(dim))
        out["plain " + dim] = [q for q in range(8) if int(x.item()) >> q & 1]
    return out


@observes('ex07.D.any_rank', 'ex07.E.group_order', 'ex07.E.reaches', 'ex07.E.dp_cp', 'ex07.E.expert_dp')
def test_mesh_build_reaches_the_members(impl):
    """8 ranks build ProcessMesh(dp=2, pp=2, cp=2, tp=1, ep=2) with your code; an all-reduce over
    each rank's group along every dim reaches exactly members(rank, dim); so do the dp_cp and
    expert_dp groups of ProcessMesh(dp=2, pp=2, tp=2), where cp = ep = 1."""
    test_mesh_members_every_dim(impl)                 # fail fast, before starting 8 ranks
    results = minipar.launch(_reduce_over_groups, 8, timeout=TIMEOUT)
    for dim in mesh.GROUP_DIMS:
        expect_equal({r: res[dim] for r, res in enumerate(results)},
                     {r: _want_members(r, dim, BUILT) for r in range(8)},
                     f"the ranks an all-reduce over self.groups[{dim!r}] reached, {_mesh_name(BUILT)}",
                     keys="rank")
    for dim in ("dp_cp", "expert_dp"):
        expect_equal({r: res["plain " + dim] for r, res in enumerate(results)},
                     {r: _want_members(r, dim, PLAIN) for r in range(8)},
                     f"the ranks an all-reduce over self.groups[{dim!r}] reached, {_mesh_name(PLAIN)}",
                     keys="rank")


@observes('ex07.E.dp_cp', 'ex07.E.expert_dp')
def test_3d_training_on_your_mesh(impl):
    """8 ranks, dp = pp = tp = 2 on your mesh: the same losses and weights as one process
    (fp32, rtol 1e-5, atol 1e-6)."""
    _check_groups(2, 2, 2)                            # fail fast, before starting 8 ranks
    batches = data.batches(data.synthetic_tokens(2000, CFG.vocab_size), 2, 8, CFG.block_size)
    want = reference.train_reference(GPT(CFG, seed=0), batches, reference.sgd(0.5))
    got = hybrid.run(GPT(CFG, seed=0), batches, 8, optimizer=reference.sgd(0.5), dp=2, pp=2, tp=2,
                     microbatches=2, timeout=TIMEOUT)
    expect_same_training(got, want, "3D training (dp = pp = tp = 2)", rtol=1e-5, atol=1e-6)
