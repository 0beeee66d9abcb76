"""Five dimensions on one mesh: the ep groups carved out of dp·cp, the plain errors before launch,
and EP × PP (× TP, × CP, × DP) trained against its stated reference on 8 ranks.

The reference (:func:`minipar.hybrid.experts.moe_reference`) is one process accumulating the
same m micro-batches, capacity and the auxiliary loss counted per micro-batch. Tolerance:
AdamW magnifies last-bit differences of reordered sums (tests/test_zero.py), so losses and
final parameters agree within rtol 1e-4, atol 5e-5 (measured: ~5e-6 on the parameters); the
per-batch reference (auxiliary loss over the whole batch) is ~1e-2 away, far outside it."""
import math

import pytest
import torch

from minipar import hybrid
from minipar.data import batches, synthetic_tokens
from minipar.hybrid import experts
from minipar.mesh import ProcessMesh
from minipar.models.gpt import GPT, GPTConfig
from minipar.reference import adamw, assert_same_training

RTOL, ATOL = 1e-4, 5e-5
MOE = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, moe_every=1, n_experts=4,
                top_k=2, aux_loss_coef=1.0, z_loss_coef=0.01)
DATA = batches(synthetic_tokens(), 3, 8, 16)


def test_ep_groups_are_carved_out_of_dp_cp():
    """dp2·cp2·pp2, ep2: the dp·cp ranks of one stage in (d, c) order, cut into blocks of ep
    (ep groups), the same place of every block forms expert-dp; positional (dp, pp, tp) stays."""
    mesh = ProcessMesh(dp=2, cp=2, pp=2, ep=2, world_size=8)
    assert mesh.all_groups("dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.all_groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.all_groups("expert_dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.expert_dp == 2
    m = ProcessMesh(2, 2, 2, ep=2)          # dp, pp, tp positionally, as before
    assert (m.dp, m.pp, m.tp, m.cp, m.ep) == (2, 2, 2, 1, 2)
    assert m.all_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]      # dp groups are strided by tp
    assert m.all_groups("expert_dp") == [[r] for r in range(8)]                # ep = dp: one replica
    for rank in range(8):   # every ep group lies inside one dp·cp group
        assert set(mesh.members(rank, "ep")) <= set(mesh.members(rank, "dp_cp"))


@pytest.mark.parametrize("config, options, message", [
    (GPTConfig(), dict(dp=2, ep=2), "needs a mixture-of-experts model"),
    (MOE, dict(dp=3, ep=3), "cannot be split evenly over ep=3"),
    (MOE, dict(dp=2, ep=4), "must divide dp·cp"),
    (GPTConfig(**{**MOE.__dict__, "capacity_factor": 1.0}), dict(dp=4, ep=2), "ep = dp and cp = 1"),
    (GPTConfig(**{**MOE.__dict__, "capacity_factor": 1.0}), dict(dp=1, cp=2, ep=2), "ep = dp and cp = 1"),
    (GPTConfig(), dict(dp=2, pp=2, zero=3, reshard_after_forward="sometimes"), "must be one of"),
    (MOE, dict(dp=2, zero=4), "must be 0, 1, 2 or 3"),
    (MOE, dict(tp=2, sequence_parallel=True), "sequence_parallel with MoE"),
    (MOE, dict(dp=2, ep=2, recompute="full"), "twice per micro-batch"),
])
def test_check_rejects_impossible_combinations(config, options, message):
    """Each impossible combination is a plain ValueError before launch, with its reason."""
    with pytest.raises(ValueError, match=message.replace("·", ".").replace("(", r"\(")):
        hybrid.check(config, None, None, **options)


def _compare(options: dict, config=MOE):
    got = hybrid.run(GPT(config, seed=0), DATA, math.prod(options.get(d, 1) for d in ("dp", "pp", "tp", "cp")), optimizer=adamw(1e-2, 0.1), **options)
    m, dp = options["microbatches"], options["dp"]
    want = experts.moe_reference(GPT(config, seed=0), DATA, adamw(1e-2, 0.1), dp=dp, microbatches=m)
    assert_same_training(got, want, rtol=RTOL, atol=ATOL)
    per_batch = experts.moe_reference(GPT(config, seed=0), DATA, adamw(1e-2, 0.1))
    with pytest.raises(AssertionError):  # the definition matters: per batch is another training
        assert_same_training(got, per_batch, rtol=RTOL, atol=ATOL)
    return got


def test_4d_dp_pp_tp_ep_with_zero1_and_capacity():
    """dp2·pp2·tp2 with ep2 (8 ranks), ZeRO-1 (dense state over dp, experts' over expert-dp),
    capacity factor 1.0 (tokens dropped per micro-batch), m=2: every loss and final parameter
    equal the micro-batched reference."""
    config = GPTConfig(**{**MOE.__dict__, "capacity_factor": 1.0})
    got = _compare(dict(dp=2, pp=2, tp=2, ep=2, microbatches=2, zero=1), config)
    ref = GPT(config, seed=0)
    ref(*[experts.micro_batches(t, 2, 2)[0] for t in DATA[0]])
    assert any(m.stats["dropped"].any() for m in ref.modules() if hasattr(m, "stats") and m.stats)
    assert got.measured[0]["coords"] == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}


def test_5d_dp_cp_pp_ep():
    """dp2·cp2·pp2 with ep2 carved out of dp·cp (8 ranks, ring attention, zigzag), m=2: every
    loss and final parameter equal the micro-batched reference."""
    got = _compare(dict(dp=2, cp=2, pp=2, ep=2, microbatches=2))
    sent = got.measured[0]["bytes_by_dim"]
    assert all(sent.get(d, 0) > 0 for d in ("dp", "cp", "pp", "ep")), sent


DENSE = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)


def test_zero2_and_zero3_with_experts():
    """ZeRO 2 and 3 with experts: the dense parameters sharded over dp·cp, the experts' over their
    expert-dp group (dp·cp/ep ranks), their mean there × 1/ep (the sum ÷ dp·cp). dp2·ep2 ZeRO-3
    (expert-dp of one rank) and dp4·ep2 ZeRO-1, 2, 3 (flat and per-parameter; expert-dp of two)
    train as the micro-batched single process; dp4·ep2's experts move bytes over expert-dp, each
    stage holds fewer bytes than the one before, and both ZeRO-3 designs hold the same."""
    def run(dp, **options):
        got = hybrid.run(GPT(MOE, seed=0), DATA, dp, optimizer=adamw(1e-2, 0.1), dp=dp, ep=2, **options)
        want = experts.moe_reference(GPT(MOE, seed=0), DATA, adamw(1e-2, 0.1), dp=dp, microbatches=1)
        assert_same_training(got, want, rtol=RTOL, atol=ATOL)
        return got.measured[0]
    assert run(2, zero=3)["bytes_by_dim"]["dp"] > 0
    totals = []
    for options in (dict(zero=1), dict(zero=2), dict(zero=3), dict(zero=3, sharding="per-parameter")):
        m = run(4, **options)
        assert m["bytes_by_dim"]["expert_dp"] > 0 and m["bytes_by_dim"]["dp"] > 0, (options, m["bytes_by_dim"])
        totals.append(m["memory"]["total"])
    assert totals[0] > totals[1] > totals[2] == totals[3], totals


def test_zero_stages_1_to_3_on_a_dp_tp_mesh():
    """dp2·tp2 (4 ranks): ZeRO 1, 2, 3 (flat units and per-parameter fully_shard, with m=2) shard
    the tp shards' states over dp and train as one process (rtol 1e-4, atol 5e-5, AdamW); each
    stage holds fewer bytes of model states than the one before."""
    from minipar.reference import train_reference
    want = train_reference(GPT(DENSE, seed=0), DATA, adamw(1e-2, 0.1))
    totals = []
    for options in (dict(zero=0), dict(zero=1), dict(zero=2, microbatches=2), dict(zero=3),
                    dict(zero=3, sharding="per-parameter", microbatches=2)):
        got = hybrid.run(GPT(DENSE, seed=0), DATA, 4, optimizer=adamw(1e-2, 0.1), dp=2, tp=2, **options)
        assert_same_training(got, want, rtol=RTOL, atol=ATOL)
        totals.append(got.measured[0]["memory"]["total"])
    assert totals[0] > totals[1] > totals[2] > totals[3] == totals[4], totals


def test_a_planner_layout_runs_at_toy_size():
    """The planner's dp8·tp8·pp16·cp2·ep8 with ZeRO-1 becomes dp2·cp2·pp2 with ep2 and ZeRO-1 (tp
    set back to 1 to fit 8 ranks, and said); its command line passes minipar.production.train's checks, and
    the hybrid.run call trains like the micro-batched single process (rtol 1e-4, atol 5e-5)."""
    from minipar.production import train
    from minipar.study.layouts import toy_command, toy_options, toy_run
    from minipar.plan import Layout
    layout = Layout(dp=8, tp=8, pp=16, cp=2, ep=8, zero=1, dtype="fp32")
    config, options, notes = toy_options(layout)
    assert {k: options[k] for k in ("dp", "cp", "pp", "tp", "ep", "zero")} == \
        dict(dp=2, cp=2, pp=2, tp=1, ep=2, zero=1)
    assert notes == ["tp=8 runs as tp=1 (a toy world of at most 8 ranks)"]
    _, o3, n3 = toy_options(Layout(dp=4, pp=4, zero=3, recompute="full", dtype="fp32"))
    assert o3["zero"] == 3 and n3 == []                      # ZeRO-3 composes with a pipeline
    _, oe, ne = toy_options(Layout(dp=4, ep=2, zero=3, dtype="fp32"))
    assert oe["zero"] == 3 and ne == []                      # and with experts
    argv = toy_command(layout)
    assert argv[1:3] == ["-m", "minipar.production.train"]
    args = train.parse(argv[3:])
    train.check(args, args.dp * args.cp * args.pp * args.tp)          # accepted before launch
    assert (args.dp, args.cp, args.pp, args.tp, args.ep, args.zero, args.n_experts) == (2, 2, 2, 1, 2, 1, 4)
    run = toy_run(layout, steps=2)
    assert_same_training(run["result"], run["reference"], rtol=RTOL, atol=ATOL)
