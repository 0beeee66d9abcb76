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

Derived in notebook 07, "Why combine" and "3D training is still the same training". The
last test trains the GPT in 3D (dp = pp = tp = 2) with the library's hybrid training, whose
process mesh then comes from your functions, and compares with one process. Stuck?
``minipar.hint("ex07", "A")`` (or "B", "C"). Grade it with ``python -m minipar.grade ex07``.
"""
import dataclasses


import minipar
from minipar import data, hybrid, mesh, reference
from minipar.course.grading import diagnose, expect, expect_equal, expect_same_training
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
          "key = (tp·pp, tp > ranks_per_node, pp); best = min over the fitting valid_configs(config, "
          "world_size, batch_size, microbatches) by key; none fits: raise ValueError."),
}
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
