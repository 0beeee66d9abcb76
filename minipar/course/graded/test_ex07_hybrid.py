"""Exercise 07: the process mesh, and choosing a configuration.

A. ``mesh_coordinates(rank, dp, pp, tp)``: where a global rank sits in a dp × pp × tp job.
B. ``group_members(rank, dim, dp, pp, tp)``: the global ranks of ``rank``'s group along ``dim``.
C. ``choose_config(config, world_size, batch_size, microbatches=1, memory_per_rank=None,
   ranks_per_node=8, zero1=False)``: Narayanan et al.'s advice (§3, Takeaways #1 and #2) as a
   rule.
D. ``ProcessMesh.coordinates``, ``rank_of``, ``members`` and ``all_groups``: the same layout
   with context parallelism and expert parallelism.
E. ``ProcessMesh.build()``, inside every rank: the process groups themselves.

Each function's docstring below is its contract: clauses ``ex07.P.word`` that must hold (the
grader names the clause a failure breaks). Notebook 07 draws the mesh and its groups and
measures the bytes each dimension sends ("The mesh", "Every strategy, side by side"). The
tests check each property on every rank of several meshes (no layout is written in them), the
choice against every configuration that fits, and then build a mesh with cp and ep on 8 ranks,
reduce over each of its groups, and train the GPT in 3D (dp = pp = tp = 2) with the library's
hybrid training, whose process mesh then comes from your functions, against one process. Stuck? ``minipar.hint("ex07", "A")`` (or "B" .. "E"). Grade it with
``python -m minipar.grade ex07``.
"""
import dataclasses
import itertools


import minipar
from minipar import cost, data, hybrid, mesh, reference
from minipar.course import grading
from minipar.course.grading import breaks, expect, expect_equal, expect_same_training, hang_breaks, observes
from minipar.models import GPT, GPTConfig

EXERCISE = "ex07_hybrid"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNodytENgDAIBcBV3gJ1AOdwARRaiZYmFE3dXuN937KrHWgZhKpDODmxDthVV/EZsQsy9ZAe6SZ/1'
        'Aq21pzVKATa/3F+A6xFY3oBnjQdVA==',
        'sealed:eNp1zsENwjAQRNFWpoCQBjghKlnsSbyKZVveDaIz7lSGE87c5vD1NDc8cg0b6oLYPm9vCLUYw+76J'
        'LqUzWBJOg21EE0bs45hLiuv0GIaCfXp59gB/UdOI4rLpUmXnJmHEPmacU8cLzyd+Uos2s3nL1cYOjs=',
        'sealed:eNorSszLVrBVKDi0XSMFSJQUaCpoK6SAGEC6xEqhQEehKLW4BKgkJbMsNz9FowioQUchpUBBSwGo2'
        'FohRUcBWRaoVgckoQcAhmIdyw==',
    ),
    'B': (
        'sealed:eNpNi0EKgDAMBL+yN28+wG/4gtomGLQJJAHx95aevAwMw+xZPMFuHXkSvOi1BOxRVDNvoiUpttlsw'
        'NGpH+SBJsxD5ykJUZjSbxp6v+sHh5Mi0w==',
        'sealed:eNpFzj0OwjAMBeCrvA2QIIKZnXs4iRWipnblpAOcviYL+/d+XmqoqII7QkCvXz7nul5ww+MK461RY'
        'ow3w0iWU0dStVyFBoOaSoFrxI93kGSM3WTqP+uIlBZfGApCaRqpzbLnhK324Xp1p/v4HSmm+waPs4UDRDk2V'
        'A==',
        'sealed:eNo1jEEKgzAQRa/ycaU09ALSZa/QTZASkrQO1smYRIRezL0n6yB08RfvfXgeN8yxjE+fUg7ErsbSZ'
        'seTQRAD0VXpetjFNiLNcOxBjr0KLlATTvOnqoRXylg06rFRHeFtoHlQJgMCMbT9jm2hbzyfbujhGCtPnDaGK'
        'lCBw8N91njPOeXrDxzZODw=',
    ),
    'C': (
        'sealed:eNoljNENgCAUA1fpAEzgj0u4AMESiAFMHyayvRD/2rumRyJ6EgmfiznkOiuz0HRSDl7T4BYjxRq4I'
        'fiK0R7wndRszQu8oVXCmjouDrcoYpb19fun/QMcnCZe',
        'sealed:eNpdkEFOxDAMRa/y1Q2tNOqIA7DgAKxgh1CVTtw2mjSO7HSGcgPuwR3YcxROQtJugIWzsH/83/fj2'
        'UWkiXDiMLhxEZMcB8V1YiVMay/OdjPNLGsXSTox4VyHZe6iETNrvX9rDrDxgJgr5Xoj4du77W2eq8TJ+OoF9'
        'Hoisrq59YsdKbV4YCFYkwzKPu/JO53hFJ40K+PXZ4wt7v/S3ZQJRuElKjSZFS6os4TAlgo6BdCFZN01Bb8n0'
        'VoOqFKsfrM2GLKr5gXgQBAcjygRdQtb9qHOXt/vH//bmTFwAgVexmn3zELLtPetuxQil5oWT1vgvvdUgK6Z0'
        'KVpO0M+ZCYDDyXGSNr+AAL/kK4=',
        'sealed:eNoljUEOwjAMBL+yR5AiHkDFkS9wRS5126htbDlOUV7GnZcR1NtqtKNZuOKGk+v3oxpAqcIVk0lRZ'
        'KWU4W9BkoFzgOq5Q8/Zm7LFFNBXLFwDZGeDz4yXpDFOxcijNHenNQ7PA2YYe7FGRznOmTYG2VQ2Tt5CMznG6'
        'F3LJf6vfIVRzIwHrYXvZmKXHyYbQDM=',
    ),
    'D': (
        'sealed:eNpVjLENwzAMBFf5CdykSxcgI3gBQqIjwrIoiBQUT5Y+k0Vwl+5x+Ls1MQ62hCGeECrE4JPdnn/4+'
        '/EKMogbNjJnc0Q5uJhouV9GpeZ44NSO0dQZlBtTPBGVDYnydt2Gtn3BOhe/K0/l1bRXA7VpIMsMh+6Q4ooqH'
        'NiWHwrbOyU=',
        'sealed:eNpNj9FtwzAMRFe5TxtwM0CNzmIwEm0RsSWBYgpvlv9OVqpomn4QIA/Hx2MoRaNkMm7vOLilJbyUQ'
        'SnfJsQ6oXpZ/XqEOnqTOKPVXQxiDSs1w2sNkq1gCO4b8YEon0eJQzd1xDijU5eyQlon4ZCT45tSlBP5flxZo'
        'UwRVwq3i2fqiocLifLGKJn/37Kk5b6lnxzaDdMfnimkGWtRf2AJ9QkY4oQwwsrGfl0nj/vUnMo6gysoR/BZW'
        'W2JPimj7RK4wbmWyH6RuzS7fAMMU3HK',
        'sealed:eNpNjlGKwzAMRK8yPws22+YAKTlJWUJrya1IYhvZ3U1uX5VQuj8DM280iAIGnPWSpjFHF/An7Q4qA'
        'x0QyjB5xKwgSIJ1buyo7NH0iULxPyeI7VDoJBGv7rXnT+DSW3YWHA1/mUWPf+bbxC55LaxtpHd5L/Y7vMzze'
        'NP8KLVHuzNIapMUGtqjzFyRIxZerqzV6cHo4pF/WcEmGyyyN6NobcfKnJCVDDqS0LqoeZl4q757Am8KVTE=',
    ),
    'E': (
        'sealed:eNodzNENgCAMRdFV3gCGlQxIVRRaA0XD9qb83pPcmJo6pm89qvQHpTdFIGw+Z4oIA/RSHaieb8gOP'
        'QmXhMUyGxs0sCgST50f9wN52h9J',
        'sealed:eNo1jsENwjAQBFvZZ5BQGqAFekBWsuBTzJ3lc7DSPVYM7xnN7t0swz4sqJFY5e0Qxe68Iug6SEjp8'
        'Sq2Z5+6cMHTChiWeAM7PlCCbli65VC2ocL0R5N4HbGNzH7u/JV0oEUqpDqs6SjJeUHq/AUotjfh',
        'sealed:eNpdjj0LgzAURf/K3TRUAl0Vty4dOrVbkSD6kko1hiTF/vzmQzq4PB7vnnt4crUYpwWTxuV6u+OEw'
        'cSDCxvlrYYMkO3120XM0Sx5P89C2fVjXBkQVkOhDbDzXNOWkzI1WINJ5kSRF/FWsqhJaZ1t2fQMpi5oVAPdL'
        '7RbVBWfYByPF+kKW5jxxbbFucJeLEYjBlOk8v9SdE2m6UjT15D1Yjw2koP/AIIIXAs=',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT
SHAPES = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (3, 1, 2), (2, 3, 1), (2, 2, 3)]   # (dp, pp, tp)
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=4, n_embd=32)
PSI = hybrid.num_params(CFG)


# ----------------------------------------------------------------------------- the properties
def _bijection(got, sizes, what, clause):
    """Every rank's coordinates in range, and no two ranks at the same point."""
    seen = {}
    for r, c in got.items():
        expect(isinstance(c, dict) and set(c) == set(sizes),
               f"{clause} {what}: rank {r} got {c!r}, not a dict with keys {sorted(sizes)}")
        for dim, n in sizes.items():
            expect(isinstance(c[dim], int) and 0 <= c[dim] < n,
                   f"{clause} {what}: rank {r} got {dim} = {c[dim]!r}, outside 0 .. {n - 1}")
        point = tuple(c[d] for d in sizes)
        expect(point not in seen, f"{clause} {what}: ranks {seen.get(point)} and {r} both get {c}")
        seen[point] = r


def _runs(got, blocks, what, clause):
    """The ranks equal in ``agree`` (for each (label, agree) of blocks) are consecutive, and in every
    group a higher coordinate is a higher rank."""
    for label, agree in blocks:
        by = {}
        for r, c in got.items():
            by.setdefault(tuple(c[d] for d in agree), []).append(r)
        for key, ranks in by.items():
            expect(max(ranks) - min(ranks) + 1 == len(ranks),
                   f"{clause} {what}: the ranks of one {label} ({', '.join(f'{d} = {k}' for d, k in zip(agree, key))}) "
                   f"are {ranks}, not consecutive")
    dims = list(next(iter(got.values())))
    for dim in dims:
        for a, b in itertools.combinations(sorted(got), 2):
            ca, cb = got[a], got[b]
            if all(ca[d] == cb[d] for d in dims if d != dim) and ca[dim] > cb[dim]:
                expect(False, f"{clause} {what}: ranks {a} and {b} differ only in {dim}, and the lower rank {a} "
                              f"has the higher {dim} ({ca[dim]} > {cb[dim]})")


def _group_ok(g, r, dim, coords, what, clause):
    """``g`` (rank r's group along dim) holds the ranks equal to r in every other coordinate, no
    other, listed by their coordinate along dim."""
    expect(isinstance(g, (list, tuple)) and all(isinstance(q, int) for q in g),
           f"{clause} {what}: got {g!r}, not a list of ranks")
    c, others = coords[r], [d for d in coords[r] if d != dim]
    want = {q for q, cq in coords.items() if all(cq[d] == c[d] for d in others)}
    strangers = [q for q in g if q not in want]
    expect(not strangers, f"{clause} {what}: holds {strangers}, whose coordinates {[coords.get(q) for q in strangers]} "
                          f"differ from rank {r}'s {c} outside {dim}")
    missing = sorted(want - set(g))
    expect(not missing, f"{clause} {what}: misses {missing}, equal to rank {r} ({c}) but in {dim}")
    expect(len(g) == len(want), f"{clause} {what}: {g} lists a rank twice")
    along = [coords[q][dim] for q in g]
    expect(along == sorted(along), f"{clause} {what}: {g}, whose {dim} coordinates are {along}: a rank's index "
                                   f"in the list is its group-local rank, its coordinate along {dim}")


def _coords3(dp, pp, tp):
    return {r: mesh.mesh_coordinates(r, dp, pp, tp) for r in range(dp * pp * tp)}


def _name3(dp, pp, tp):
    return f"dp = {dp}, pp = {pp}, tp = {tp}"


# ----------------------------------------------------------------------------- A, B
@observes("ex07.A.bijection")
def test_coordinates_are_a_bijection(impl):
    """mesh_coordinates on several meshes: every rank a different point of the grid, each in range."""
    for dp, pp, tp in SHAPES:
        _bijection(_coords3(dp, pp, tp), {"pp": pp, "dp": dp, "tp": tp},
                   f"mesh_coordinates on {_name3(dp, pp, tp)}", "ex07.A.bijection")


@observes("ex07.A.order")
def test_coordinates_keep_groups_together(impl):
    """mesh_coordinates on several meshes: which ranks are neighbours (tp groups, pipeline stages),
    and the order inside every group."""
    test_coordinates_are_a_bijection(impl)
    for dp, pp, tp in SHAPES:
        _runs(_coords3(dp, pp, tp), [("tp group", ("pp", "dp")), ("pipeline stage", ("pp",))],
              f"mesh_coordinates on {_name3(dp, pp, tp)}", "ex07.A.order")


@observes("ex07.A.range")
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


@observes("ex07.B.dim")
def test_group_members_unknown_dim(impl):
    """group_members with a dim that is not dp, pp or tp."""
    try:
        bad = mesh.group_members(5, "xp", 2, 2, 2)
    except ValueError:
        return
    expect(False, f"group_members(5, 'xp', ...) returned {bad}; an unknown dim is a ValueError")


def _check_groups(dp, pp, tp):
    coords = _coords3(dp, pp, tp)
    for dim in ("dp", "pp", "tp"):
        for r in coords:
            _group_ok(mesh.group_members(r, dim, dp, pp, tp), r, dim, coords,
                      f"group_members({r}, {dim!r}) on {_name3(dp, pp, tp)}", "ex07.B.members")


@observes("ex07.B.members")
def test_group_members_every_mesh(impl):
    """Every rank's group along every dim, on several meshes: who is in it, in which order."""
    for shape in SHAPES:
        _check_groups(*shape)


# ----------------------------------------------------------------------------- C
ODD = dataclasses.replace(CFG, n_head=3, n_embd=48, vocab_size=48)
SIX = GPTConfig(vocab_size=48, block_size=16, n_layer=4, n_head=6, n_embd=48)
TEN = GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=10, n_embd=40)
TEN_AT_12_5 = cost.hybrid_memory_per_rank(hybrid.num_params(TEN), 12, 1, 5)["total"] * 1.000001   # dp=12, tp=5
AT_4_1_2 = cost.hybrid_memory_per_rank(PSI, 4, 1, 2)["total"]
CHOICES = [  # (model, kwargs): the choice is judged against every configuration that fits
    (CFG, dict(world_size=8, batch_size=8)),
    (CFG, dict(world_size=8, batch_size=8, microbatches=2)),
    (CFG, dict(world_size=8, batch_size=8, memory_per_rank=16 * PSI / 4 * 1.01)),
    (CFG, dict(world_size=8, batch_size=8, memory_per_rank=16 * PSI / 4 * 1.01, ranks_per_node=2)),
    (CFG, dict(world_size=8, batch_size=8, memory_per_rank=10 * PSI, zero1=True)),
    (CFG, dict(world_size=8, batch_size=8, memory_per_rank=10 * PSI)),
    (CFG, dict(world_size=4, batch_size=4, memory_per_rank=16 * PSI / 4 * 1.01)),
    (ODD, dict(world_size=8, batch_size=8, memory_per_rank=16 * hybrid.num_params(ODD) / 2 * 1.01)),
    (ODD, dict(world_size=8, batch_size=8, memory_per_rank=16 * hybrid.num_params(ODD) / 4 * 1.01)),
    (SIX, dict(world_size=12, batch_size=12, memory_per_rank=16 * hybrid.num_params(SIX) / 6 * 1.01,
               ranks_per_node=4)),
    (SIX, dict(world_size=12, batch_size=12, memory_per_rank=16 * hybrid.num_params(SIX) / 6 * 1.01,
               ranks_per_node=6)),
    (SIX, dict(world_size=12, batch_size=12, memory_per_rank=16 * hybrid.num_params(SIX) / 3 * 1.01,
               ranks_per_node=4)),
    (CFG, dict(world_size=8, batch_size=8, memory_per_rank=AT_4_1_2)),                   # exactly dp=4's states
    (TEN, dict(world_size=60, batch_size=60, memory_per_rank=TEN_AT_12_5, ranks_per_node=4)),  # aim 1 before aim 2
    # tp = 3 does not divide 8 ranks a node, but the whole job of 6 fits in one: no tp group crosses a node
    (SIX, dict(world_size=6, batch_size=6, memory_per_rank=16 * hybrid.num_params(SIX) / 3 * 1.01)),
]


def _call(cfg, kw):
    heads = f"{cfg.n_head} heads, " if cfg is not CFG else ""
    return "choose_config(" + heads + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in kw.items()) + ")"


def _nodes_of_tp_groups(c, world, per_node):
    """The nodes each tp group of configuration c spans (a tp group: tp consecutive ranks, part A)."""
    return [sorted({q // per_node for q in range(k * c["tp"], (k + 1) * c["tp"])}) for k in range(world // c["tp"])]


def _judge(cfg, kw, got):
    world, per_node, mem = kw["world_size"], kw.get("ranks_per_node", 8), kw.get("memory_per_rank")
    what = _call(cfg, kw)
    valid = hybrid.valid_configs(cfg, world, kw["batch_size"], kw.get("microbatches", 1))
    psi = hybrid.num_params(cfg)

    def need(c):
        return cost.hybrid_memory_per_rank(psi, c["dp"], c["pp"], c["tp"], zero1=kw.get("zero1", False))["total"]

    fits = [c for c in valid if mem is None or need(c) <= mem]
    expect(isinstance(got, dict) and set(got) == {"dp", "pp", "tp"},
           f"ex07.C.fit {what} returned {got!r}, not a dict with keys dp, pp, tp")
    expect(got in valid, f"ex07.C.fit {what} chose {got}, which this model and batch refuse (not in valid_configs)")
    expect(got in fits, f"ex07.C.fit {what} chose {got}: its model states, {need(got):,.0f} bytes per rank, "
                        f"do not fit in {mem or 0:,.0f}")
    at = [c for c in fits if need(c) == mem and c["dp"] > got["dp"]]
    expect(not at, f"ex07.C.fit {what} chose {got}; {at[0] if at else ''} needs exactly memory_per_rank, "
                   f"{mem or 0:,.0f} bytes per rank, and fits, with more data parallelism")
    more = [c for c in fits if c["dp"] > got["dp"]]
    expect(not more, f"ex07.C.prefer {what} chose {got}; {max(more, key=lambda c: c['dp']) if more else ''} fits too, "
                     "with more data parallelism")
    same = [c for c in fits if c["dp"] == got["dp"]]
    inside = [c for c in same if all(len(n) == 1 for n in _nodes_of_tp_groups(c, world, per_node))]
    spans = [n for n in _nodes_of_tp_groups(got, world, per_node) if len(n) > 1]
    expect(not (inside and spans), f"ex07.C.prefer {what} chose {got}: a tp group spans nodes {spans[0] if spans else ''} "
                                   f"({per_node} ranks a node), while {inside[0] if inside else ''} keeps every tp "
                                   "group inside one node with as much data parallelism")
    rest = inside or same
    fewer = [c for c in rest if c["pp"] < got["pp"]]
    expect(not fewer, f"ex07.C.prefer {what} chose {got}: {got['pp']} pipeline stages, while "
                      f"{min(fewer, key=lambda c: c['pp']) if fewer else ''} is as good by the aims before and has "
                      "a smaller bubble")


@observes("ex07.C.fit", "ex07.C.prefer")
def test_choose_config(impl):
    """choose_config on several models, worlds, memory budgets and node sizes, judged against every
    configuration that fits: fits, then the contract's aims in their order."""
    for cfg, kw in CHOICES:
        _judge(cfg, kw, hybrid.choose_config(cfg, **kw))


@observes("ex07.C.none")
def test_choose_config_nothing_fits(impl):
    """A memory budget nothing fits."""
    try:
        got = hybrid.choose_config(CFG, 8, 8, memory_per_rank=1000)
    except ValueError as e:
        expect("1000" in str(e), f"choose_config(memory_per_rank=1000) raised ValueError({str(e)!r}): its message "
                                 f"does not give the budget, 1000")
        return
    expect(False, f"choose_config(memory_per_rank=1000) returned {got}; nothing fits in 1000 bytes: a ValueError")


# ----------------------------------------------------------------------------- D
MESHES = [dict(dp=2, pp=1, cp=2, tp=2, ep=2), dict(dp=4, pp=2, cp=1, tp=1, ep=2),
          dict(dp=3, pp=2, cp=2, tp=1, ep=3), dict(dp=1, pp=2, cp=3, tp=2, ep=1),
          dict(dp=2, pp=2, cp=2, tp=2, ep=4)]


def _mesh_name(m):
    return "ProcessMesh(" + ", ".join(f"{k}={v}" for k, v in m.items()) + ")"


def _size(m):
    return m["dp"] * m["pp"] * m["cp"] * m["tp"]


@observes("ex07.D.layout")
def test_mesh_coordinates_with_cp(impl):
    """coordinates on meshes with cp: every rank a different point, and which ranks are neighbours."""
    for m in MESHES:
        pm = mesh.ProcessMesh(**m)
        got = {r: pm.coordinates(r) for r in range(_size(m))}
        what = f"{_mesh_name(m)}.coordinates"
        _bijection(got, {k: m[k] for k in ("cp", "dp", "pp", "tp")}, what, "ex07.D.layout")
        _runs(got, [("tp group", ("pp", "dp", "cp")), ("cp × tp block", ("pp", "dp")), ("pipeline stage", ("pp",))],
              what, "ex07.D.layout")


@observes("ex07.D.inverse")
def test_mesh_rank_of_inverts(impl):
    """rank_of and coordinates, each the other's inverse, over every rank and every point of the grid."""
    for m in MESHES:
        pm = mesh.ProcessMesh(**m)
        back = {r: pm.rank_of(pm.coordinates(r)) for r in range(_size(m))}
        expect_equal(back, {r: r for r in range(_size(m))}, f"ex07.D.inverse {_mesh_name(m)}.rank_of(coordinates(rank))",
                     keys="rank")
        for p, d, c, t in itertools.product(range(m["pp"]), range(m["dp"]), range(m["cp"]), range(m["tp"])):
            point = {"pp": p, "dp": d, "cp": c, "tp": t}
            expect_equal(pm.coordinates(pm.rank_of(point)), point,
                         f"ex07.D.inverse {_mesh_name(m)}.coordinates(rank_of({point}))")


def _expert_groups_ok(pm, m, r, coords, what):
    dc, ep, x = pm.members(r, "dp_cp"), list(pm.members(r, "ep")), list(pm.members(r, "expert_dp"))
    k = m["ep"]
    expect(len(ep) == k and r in ep and set(ep) <= set(dc),
           f"ex07.D.ep_blocks {what}: rank {r}'s ep group {ep} is not {k} ranks of its dp_cp group {dc} with {r} among them")
    where = sorted(dc.index(q) for q in ep)
    expect(ep == sorted(ep) and where == list(range(where[0], where[0] + k)),
           f"ex07.D.ep_blocks {what}: rank {r}'s ep group {ep} sits at places {where} of its dp_cp group {dc}: "
           "not neighbours in it, in increasing rank")
    blocks = {tuple(pm.members(q, "ep")) for q in dc}
    expect(sorted(q for b in blocks for q in b) == sorted(dc),
           f"ex07.D.ep_blocks {what}: the ep groups of {dc}'s ranks, {sorted(blocks)}, do not cut it into groups")
    expect(len(x) == len(dc) // k and r in x and set(x) <= set(dc) and x == sorted(x),
           f"ex07.D.ep_blocks {what}: rank {r}'s expert_dp group {x} is not {len(dc) // k} ranks of its dp_cp group {dc}, "
           f"{r} among them, in increasing rank")
    place = ep.index(r)
    for b in sorted(blocks):
        held = [q for q in x if q in b]
        expect(len(held) == 1 and b.index(held[0]) == place,
               f"ex07.D.ep_blocks {what}: rank {r} is at index {place} of its ep group; its expert_dp group {x} holds "
               f"{held} of the ep group {list(b)}")


@observes("ex07.D.dp_cp", "ex07.D.ep_blocks", "ex07.D.partition", "ex07.D.dim")
def test_mesh_members_every_dim(impl):
    """members along every dim of GROUP_DIMS on meshes with cp and ep, at every rank; all_groups
    lists each group once and partitions the ranks; an unknown dim is a ValueError."""
    for m in MESHES:
        pm, n = mesh.ProcessMesh(**m), _size(m)
        coords = {r: pm.coordinates(r) for r in range(n)}
        for r in range(n):
            what = f"{_mesh_name(m)}.members({r}, dim)"
            for dim in ("cp", "dp", "pp", "tp"):
                _group_ok(pm.members(r, dim), r, dim, coords, what.replace("dim", repr(dim)), "ex07.D.dp_cp")
            dc = list(pm.members(r, "dp_cp"))
            want = sorted(q for q in range(n) if coords[q]["pp"] == coords[r]["pp"] and coords[q]["tp"] == coords[r]["tp"])
            expect_equal(dc, want, f"ex07.D.dp_cp {what.replace('dim', repr('dp_cp'))}", keys="member")
            _expert_groups_ok(pm, m, r, coords, _mesh_name(m))
        for dim in mesh.GROUP_DIMS:
            groups = [tuple(g) for g in pm.all_groups(dim)]
            label = f"ex07.D.partition {_mesh_name(m)}.all_groups({dim!r})"
            expect(len(set(groups)) == len(groups), f"{label} lists a group twice: {groups}")
            expect(sorted(q for g in groups for q in g) == list(range(n)),
                   f"{label}: {groups} do not hold every rank exactly once")
            for g in groups:
                expect(all(list(pm.members(q, dim)) == list(g) for q in g),
                       f"{label}: {list(g)} is not the members(rank, {dim!r}) of its ranks")
    try:
        bad = mesh.ProcessMesh(dp=2, cp=2).members(0, "xp")
    except ValueError:
        return
    expect(False, f"ex07.D.dim ProcessMesh(dp=2, cp=2).members(0, 'xp') returned {bad}; an unknown dim is a ValueError")


# ----------------------------------------------------------------------------- E
BUILT = dict(dp=2, pp=2, cp=2, tp=1, ep=2)
PLAIN = dict(dp=2, pp=2, cp=1, tp=2, ep=1)
CP_ONLY = dict(dp=2, pp=1, cp=2, tp=2, ep=1)
BUILD_TIMEOUT = 180   # three meshes of 8 ranks: 64 groups created, each collective over the world


def _watch_new_group(where):
    """Inside a rank: every ``torch.distributed.new_group`` call is noted with the flight recorder
    (so a hang report names it) and in the file ``where``/rank<r> (so the driver can tell, after a
    hang, which ranks were inside one); returns a function that undoes this and a one-element
    list counting the calls (every rank calls ``new_group`` for every group, member or not)."""
    import os
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from minipar.runtime import flight
    real, rank, made = c10d.new_group, dist.get_rank(), [0]
    note = os.path.join(where, f"rank{rank}")

    def new_group(ranks=None, *args, **kwargs):
        ranks = None if ranks is None else list(ranks)   # shown below and passed on: a generator once only
        made[0] += 1
        shown = sorted(ranks) if ranks is not None else "the world"
        with open(note, "w") as f:
            f.write(f"inside new_group({shown}), its new_group call {made[0]}")
        entry = flight.started("new_group", name=f"new_group({shown})")
        g = real(ranks, *args, **kwargs)
        flight.completed(entry)
        with open(note, "w") as f:
            f.write(f"after new_group({shown}), its new_group call {made[0]}")
        return g
    dist.new_group = c10d.new_group = new_group

    def undo():
        dist.new_group = c10d.new_group = real
    return undo, made


def _reduce_over_groups(where):
    import torch
    import torch.distributed as dist
    from minipar.comm import group_name
    from minipar.runtime import flight
    out = {}
    undo, made = _watch_new_group(where)
    try:
        for name, shape in (("built", BUILT), ("plain", PLAIN), ("cp only", CP_ONLY)):
            before = made[0]
            pm = mesh.ProcessMesh(**shape, world_size=8).build()
            out[name, "created"] = made[0] - before
            out[name, "keys"] = sorted(pm.groups)
            out[name, "names"] = {dim: group_name(g) for dim, g in pm.groups.items()}
            out[name, "same"] = {"dp_cp is dp": pm.groups.get("dp_cp") is pm.groups.get("dp"),
                                 "expert_dp is dp_cp": pm.groups.get("expert_dp") is pm.groups.get("dp_cp")}
            for dim in pm.groups:
                x = torch.tensor([2.0 ** dist.get_rank()], dtype=torch.float64)   # one bit per rank
                entry = flight.started("all_reduce", name=f"the check's all_reduce over self.groups[{dim!r}]")
                dist.all_reduce(x, group=pm.group(dim))
                flight.completed(entry)
                out[name, dim] = [q for q in range(8) if int(x.item()) >> q & 1]
                out[name, dim, "rank in it"] = dist.get_rank(pm.group(dim))
    finally:
        undo()
    return out


def _launch_build():
    """``minipar.launch`` of :func:`_reduce_over_groups`; ranks that hang inside ``new_group``
    fail naming ex07.E.order (every rank creates every group, in the same order)."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory(prefix="minipar-ex07-") as where:
        def inside_new_group(text):
            notes = {int(f.name[4:]): f.read_text() for f in Path(where).glob("rank*")}
            if not any(n.startswith("inside new_group") for n in notes.values()):
                return None
            rows = "\n".join(f"  rank {r}: {notes.get(r, 'no new_group call yet')}" for r in range(8))
            return (f"ex07.E.order the ranks hung in build() after {BUILD_TIMEOUT:g} s, inside "
                    f"torch.distributed.new_group:\n{rows}\n  a group's creation is collective "
                    "over the world: every rank creates every group, in the same order")
        with hang_breaks("ex07.E.order", inside_new_group):
            return minipar.launch(_reduce_over_groups, 8, args=(where,), timeout=BUILD_TIMEOUT)


def _created(shape):
    """How many groups build() may create on ``shape``: every group along each dim in use."""
    pm = mesh.ProcessMesh(**shape)
    dims = ["dp", "pp", "tp"] + (["cp", "dp_cp"] if shape["cp"] > 1 else []) + (["ep", "expert_dp"] if shape["ep"] > 1 else [])
    return sum(len(pm.all_groups(d)) for d in dims), dims


def _keys(shape):
    return sorted({"dp", "pp", "tp", "dp_cp", "expert_dp"} | ({"cp"} if shape["cp"] > 1 else set())
                  | ({"ep"} if shape["ep"] > 1 else set()))


@observes("ex07.E.order", "ex07.E.reach", "ex07.E.keys", "ex07.E.cp1", "ex07.E.ep1", "ex07.E.named")
def test_mesh_build_reaches_the_members(impl):
    """8 ranks build, with your code, ProcessMesh(dp=2, pp=2, cp=2, tp=1, ep=2), then
    ProcessMesh(dp=2, pp=2, tp=2) (cp = ep = 1), then ProcessMesh(dp=2, cp=2, tp=2) (ep = 1): the
    groups each holds, their names, how many groups each build() creates, an all-reduce over each
    reaches exactly members(rank, dim), in which each rank's group rank is its index (dp_cp: dp when
    cp = 1; expert_dp: dp_cp when ep = 1)."""
    test_mesh_members_every_dim(impl)                 # fail fast, before starting 8 ranks
    results = _launch_build()
    for name, shape in (("built", BUILT), ("plain", PLAIN), ("cp only", CP_ONLY)):
        pm, what = mesh.ProcessMesh(**shape), _mesh_name(shape)
        expect_equal({r: res[name, "keys"] for r, res in enumerate(results)}, {r: _keys(shape) for r in range(8)},
                     f"ex07.E.keys the keys of self.groups after build(), {what}", keys="rank")
        same = results[0][name, "same"]
        expect(shape["cp"] > 1 or same["dp_cp is dp"],
               f"ex07.E.cp1 {what}: self.groups['dp_cp'] is not self.groups['dp'] (cp = 1)")
        expect(shape["ep"] > 1 or same["expert_dp is dp_cp"],
               f"ex07.E.ep1 {what}: self.groups['expert_dp'] is not self.groups['dp_cp'] (ep = 1)")
        want, dims = _created(shape)
        made = {r: res[name, "created"] for r, res in enumerate(results)}
        extra = shape["cp"] == 1 or shape["ep"] == 1
        clause = "ex07.E.order" if not extra or any(n < want for n in made.values()) else \
            ", ".join(c for c, k in (("ex07.E.cp1", "cp"), ("ex07.E.ep1", "ep")) if shape[k] == 1)
        with breaks(*clause.split(", ")):
            unseen = "" if any(made.values()) else (" (no call of torch.distributed.new_group was seen: the test "
                                                    "counts calls made as dist.new_group)")
            expect_equal(made, {r: want for r in range(8)},
                         f"{clause} the groups build() created (new_group calls), {what}: the groups along "
                         f"{', '.join(dims)}{unseen}", keys="rank")
        for dim in _keys(shape):
            alias = {"dp_cp": "dp" if shape["cp"] == 1 else "dp_cp"}.get(dim, dim)
            if dim == "expert_dp" and shape["ep"] == 1:
                alias = "dp_cp"
            expect_equal({r: res[name, dim] for r, res in enumerate(results)},
                         {r: sorted(pm.members(r, alias)) for r in range(8)},
                         f"ex07.E.reach the ranks an all-reduce over self.groups[{dim!r}] reached, {what}", keys="rank")
            expect_equal({r: res[name, dim, "rank in it"] for r, res in enumerate(results)},
                         {r: pm.members(r, alias).index(r) for r in range(8)},
                         f"ex07.E.reach each rank's rank in self.groups[{dim!r}] (dist.get_rank(group)), {what}: "
                         "its index in members(rank, dim)", keys="rank")
        created = [d for d in ("dp", "pp", "tp", "cp", "dp_cp", "ep", "expert_dp") if d in _keys(shape)
                   and not (d == "dp_cp" and shape["cp"] == 1) and not (d == "expert_dp" and shape["ep"] == 1)]
        expect_equal({r: {d: res[name, "names"].get(d) for d in created} for r, res in enumerate(results)},
                     {r: {d: d for d in created} for r in range(8)},
                     f"ex07.E.named group_name(self.groups[dim]) after build(), {what}", keys="rank")


@observes("ex07.E.reach", "ex07.E.cp1", "ex07.E.ep1")
def test_3d_training_on_your_mesh(impl):
    """8 ranks, dp = pp = tp = 2 on your mesh: the same losses and weights as one process
    (fp32, rtol 1e-5, atol 1e-6)."""
    _check_groups(2, 2, 2)                            # fail fast, before starting 8 ranks
    batches = data.batches(data.synthetic_tokens(2000, CFG.vocab_size), 2, 8, CFG.block_size)
    want = reference.train_reference(GPT(CFG, seed=0), batches, reference.sgd(0.5))
    got = hybrid.run(GPT(CFG, seed=0), batches, 8, optimizer=reference.sgd(0.5), dp=2, pp=2, tp=2,
                     microbatches=2, timeout=TIMEOUT)
    expect_same_training(got, want, "3D training (dp = pp = tp = 2)", rtol=1e-5, atol=1e-6)
