"""Exercise 07: the process mesh, and choosing a configuration.

A. ``mesh_coordinates(rank, dp, pp, tp)`` (``minipar/mesh.py``): the ranks of a
   dp × pp × tp job are laid out as Megatron-LM does (Narayanan et al. 2021, §3.3):
   tensor-parallel ranks vary fastest (adjacent ranks, one node), then data-parallel, then
   pipeline stages::

       rank = p · (dp · tp) + d · tp + t

   Return ``{"pp": p, "dp": d, "tp": t}``. A rank outside ``0 .. dp·pp·tp - 1`` is a
   ``ValueError``.
B. ``group_members(rank, dim, dp, pp, tp)`` (``minipar/mesh.py``): the global ranks of
   ``rank``'s group along ``dim`` (``"dp"``, ``"pp"`` or ``"tp"``): the ranks whose
   coordinates equal ``rank``'s in the two other dimensions, ordered by their coordinate
   along ``dim`` (so a rank's index in the list is its group-local rank). An unknown
   ``dim`` is a ``ValueError``. Example: dp = pp = tp = 2, rank 5 = (p=1, d=0, t=1):
   tp [4, 5], dp [5, 7], pp [1, 5].
C. ``choose_config(config, world_size, batch_size, microbatches=1, memory_per_rank=None,
   ranks_per_node=8, zero1=False)`` (``minipar/hybrid/config.py``), Narayanan et al.'s
   advice as a rule: among ``valid_configs(config, world_size, batch_size, microbatches)``
   (every dp·pp·tp = world_size the model and batch allow) keep those whose model states
   fit, ``hybrid_memory_per_rank(num_params(config), dp, pp, tp, zero1=zero1)["total"] <=
   memory_per_rank`` (no limit when ``None``); pick the smallest model-parallel size tp·pp
   (data parallelism for the rest); among equals prefer ``tp <= ranks_per_node``, then the
   fewest pipeline stages; return ``{"dp", "pp", "tp"}``, or raise ``ValueError`` if
   nothing is left.

The last test trains the GPT in 3D (dp = pp = tp = 2) with the library's hybrid training,
whose process mesh now comes from your functions, and compares with one process. Grade it
with ``python -m minipar.grade ex07``.
"""
import dataclasses


import minipar
from minipar import data, hybrid, mesh, reference
from minipar.grading import diagnose, expect, expect_equal, expect_same_training
from minipar.models import GPT, GPTConfig

EXERCISE = "ex07_hybrid"
TIMEOUT = 60
SHAPES = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (3, 1, 2), (2, 3, 1)]
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=4, n_embd=32)
PSI = hybrid.num_params(CFG)


def _want_coords(r, dp, pp, tp):
    return {"pp": r // (dp * tp), "dp": (r // tp) % dp, "tp": r % tp}


def test_coordinates(impl):
    """mesh_coordinates follows rank = p·(dp·tp) + d·tp + t on several meshes."""
    for dp, pp, tp in SHAPES:
        got = {r: mesh.mesh_coordinates(r, dp, pp, tp) for r in range(dp * pp * tp)}
        expect_equal(got, {r: _want_coords(r, dp, pp, tp) for r in range(dp * pp * tp)},
                     f"mesh_coordinates on dp = {dp}, pp = {pp}, tp = {tp}", keys="rank")


def test_coordinates_off_the_grid(impl):
    """A rank outside 0 .. dp·pp·tp - 1 is a ValueError."""
    expect_equal(mesh.mesh_coordinates(0, 1, 1, 1), {"pp": 0, "dp": 0, "tp": 0}, "mesh_coordinates(0, 1, 1, 1)")
    for bad in (8, -1):
        try:
            got = mesh.mesh_coordinates(bad, 2, 2, 2)
        except ValueError:
            continue
        expect(False, f"mesh_coordinates({bad}, dp=2, pp=2, tp=2) returned {got}; rank {bad} is off the "
                      "8-rank grid: a ValueError")


def test_group_members_example(impl):
    """Rank 5 of dp = pp = tp = 2: tp [4, 5], dp [5, 7], pp [1, 5]."""
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
            with diagnose(lambda e: sorted(g) == sorted(want), "the right ranks in the wrong order: order them "
                          "by their coordinate along dim (a rank's index is its group-local rank)"):
                expect_equal(g, want, f"group_members({r}, {dim!r}) on dp = {dp}, pp = {pp}, tp = {tp} "
                                      f"(rank {r} = p {c['pp']}, d {c['dp']}, t {c['tp']})", keys="member")


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


def test_choose_config(impl):
    """The smallest tp·pp that fits and splits the batch; tp inside a node; then fewest stages."""
    for kw, want in CHOICES:
        expect_equal(hybrid.choose_config(CFG, **kw), want,
                     "choose_config(" + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in kw.items()) + ")", keys="dim")


def test_choose_config_respects_the_model(impl):
    """3 heads cannot be split over 2 or 4 ranks: the model goes to pipeline stages instead;
    a memory budget nothing fits is a ValueError."""
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


def test_3d_training_on_your_mesh(impl):
    """8 ranks, dp = pp = tp = 2 on your mesh: the same losses and weights as one process
    (fp32, rtol 1e-5, atol 1e-6)."""
    _check_groups(2, 2, 2)                            # fail fast, before starting 8 ranks
    batches = data.batches(data.synthetic_tokens(2000, CFG.vocab_size), 2, 8, CFG.block_size)
    want = reference.train_reference(GPT(CFG, seed=0), batches, reference.sgd(0.5))
    got = hybrid.run(GPT(CFG, seed=0), batches, 8, optimizer=reference.sgd(0.5), dp=2, pp=2, tp=2,
                     microbatches=2, timeout=TIMEOUT)
    expect_same_training(got, want, "3D training (dp = pp = tp = 2)", rtol=1e-5, atol=1e-6)
