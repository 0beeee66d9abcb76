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
grader names the clause a failure breaks). Derived in notebook 07, "Why combine" and "3D
training is still the same training". The last tests build a mesh with cp and ep on 8 ranks
and reduce over each of its groups, and train the GPT in 3D (dp = pp = tp = 2) with the
library's hybrid training, whose process mesh then comes from your functions, and compare
with one process. Stuck? ``minipar.hint("ex07", "A")`` (or "B" .. "E"). Grade it with
``python -m minipar.grade ex07``.
"""
import dataclasses


import minipar
from minipar import data, hybrid, mesh, reference
from minipar.course.grading import diagnose, expect, expect_equal, expect_same_training, observes
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
        'sealed:eNoNycENgCAQRcFWXh1ebMIGCH4i0bBmFxLpXq4zxyV8PKIGqWF+yrHC6ypytayNvGLaQN/SCGonB'
        'dZEmHduzf0HjmsZaw==',
        'sealed:eNoljcEKgzAQRH9l8aQghZ5Lv6LHUkI0UxM02bDZoPbrK3p4A8MwvNccMqkHjZy+YapiNXAqtHouI'
        'L8PEpyJiCy7yRAjNs1tqtFkKzaW9rp1PbncUz7Qgx+E788zu3ejrHZpPoRtBFw5bUN1E/RBM3DpOYHWoP4sJ'
        'dplQdFj3m9/KtA7AA==',
        'sealed:eNolzjEOwjAMheGrvBGkiANQwcYVWKuUOiVq61i2U6knY+dkBHV7+vQPb6YdN5xcvh+RABfcoZFn6'
        '4W05zJSgMi5w0DmrVwzBww7ZtoDykYKfxNehVOeqkbPhQ1bXPLYH2hQ8qpNUzliiysh6lRXYrdG0ZGyd+DC9'
        'F92bReyEZ5xqfRQLXr5AdpaPM4=',
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
TIMEOUT = 60
SHAPES = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (3, 1, 2), (2, 3, 1)]
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=4, n_embd=32)
PSI = hybrid.num_params(CFG)


def _want_coords(r, dp, pp, tp):
    return {"pp": r // (dp * tp), "dp": (r // tp) % dp, "tp": r % tp}


@observes("ex07.A.order")
def test_coordinates(impl):
    """mesh_coordinates on several meshes: each rank's coordinates (the contract's rank order)."""
    for dp, pp, tp in SHAPES:
        got = {r: mesh.mesh_coordinates(r, dp, pp, tp) for r in range(dp * pp * tp)}
        expect_equal(got, {r: _want_coords(r, dp, pp, tp) for r in range(dp * pp * tp)},
                     f"mesh_coordinates on dp = {dp}, pp = {pp}, tp = {tp}", keys="rank")


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


@observes("ex07.B.order")
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


@observes("ex07.C.fit", "ex07.C.prefer")
def test_choose_config(impl):
    """choose_config's choice against the contract's on several models and clusters."""
    for kw, want in CHOICES:
        expect_equal(hybrid.choose_config(CFG, **kw), want,
                     "choose_config(" + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in kw.items()) + ")", keys="dim")


@observes("ex07.C.none")
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


@observes("ex07.D.layout", "ex07.D.inverse")
def test_mesh_coordinates_with_cp(impl):
    """coordinates and rank_of on meshes with cp: the contract's rank order, each the other's inverse."""
    for m in MESHES:
        pm, n = mesh.ProcessMesh(**m), m["dp"] * m["pp"] * m["cp"] * m["tp"]
        got = {r: pm.coordinates(r) for r in range(n)}
        expect_equal(got, {r: _want4(r, m) for r in range(n)}, f"{_mesh_name(m)}.coordinates", keys="rank")
        back = {r: pm.rank_of(_want4(r, m)) for r in range(n)}
        expect_equal(back, {r: r for r in range(n)}, f"{_mesh_name(m)}.rank_of(coordinates of rank)",
                     keys="rank")


@observes("ex07.D.dp_cp", "ex07.D.partition", "ex07.D.ep_blocks", "ex07.D.dim")
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


@observes("ex07.D.ep_blocks", "ex07.E.order", "ex07.E.reach", "ex07.E.cp1", "ex07.E.ep1")
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


@observes("ex07.E.cp1", "ex07.E.ep1")
def test_3d_training_on_your_mesh(impl):
    """8 ranks, dp = pp = tp = 2 on your mesh: the same losses and weights as one process
    (fp32, rtol 1e-5, atol 1e-6)."""
    _check_groups(2, 2, 2)                            # fail fast, before starting 8 ranks
    batches = data.batches(data.synthetic_tokens(2000, CFG.vocab_size), 2, 8, CFG.block_size)
    want = reference.train_reference(GPT(CFG, seed=0), batches, reference.sgd(0.5))
    got = hybrid.run(GPT(CFG, seed=0), batches, 8, optimizer=reference.sgd(0.5), dp=2, pp=2, tp=2,
                     microbatches=2, timeout=TIMEOUT)
    expect_same_training(got, want, "3D training (dp = pp = tp = 2)", rtol=1e-5, atol=1e-6)
