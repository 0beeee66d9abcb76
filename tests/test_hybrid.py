"""Hybrid parallelism trains the small GPT exactly like one process.

Every combination of the issue, at 4 and at 8 ranks: DP+TP, DP+PP, PP+TP, DP+PP+TP (3D),
each with plain data parallelism (one bucketed all-reduce) and with ZeRO-1 over the
data-parallel dimension, under SGD and AdamW, several schedules (1F1B, GPipe, ZB-H1,
interleaved) and with sequence parallelism. Each run is compared with
:func:`minipar.reference.train_reference` on the same GPT (same seed), the same global
batches and the same optimizer: the loss of every step and every final parameter, fp32,
``TOL`` below: SGD (with and without momentum) ``rtol=1e-5, atol=1e-6`` (measured worst:
losses 5e-7 absolute, i.e. 1.4e-7 relative, parameters 6e-8; the splits only reorder
sums); AdamW ``rtol=1e-4, atol=5e-5``, as in test_zero: Adam moves an element by up to
lr·g/(|g| + eps), so rounding in gradients near eps is magnified by lr/eps; with
eps = 1e-6 the measured worst parameter error is 1e-5 (with the default 1e-8 even plain
tensor parallelism differs by 5e-4), while a wrong gradient still misses by ~lr = 1e-2.

One launch per world size runs all its cases (each builds its own mesh); the same
launches check the round trip through ``full_state_dict``/``load_full_state_dict``, the
bytes each rank sent against :mod:`minipar.cost` and the memory it holds.
"""
import pytest
import torch

import minipar
from minipar import cost
from minipar import data, hybrid
from minipar.models import GPT, GPTConfig
from minipar.reference import assert_same_training, sgd, tolerance, train_reference

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=4, n_embd=32)
SEED, STEPS, BATCH = 1, 3, 8
BATCHES = data.batches(data.synthetic_tokens(3000, CFG.vocab_size), STEPS, BATCH, CFG.block_size)
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
MOMENTUM = {"lr": 0.2, "momentum": 0.9}
OPTIMIZERS = {"sgd": sgd(0.5), "momentum": lambda ps: torch.optim.SGD(ps, **MOMENTUM),
              "adamw": lambda ps: torch.optim.AdamW(ps, **ADAMW)}
K = {"sgd": 0, "momentum": 4, "adamw": 8}     # bytes of optimizer state per parameter
TOL = {"sgd": tolerance(kind="sgd"), "momentum": tolerance(kind="sgd"),
       "adamw": tolerance(kind="adamw")}   # minipar.reference.TOLERANCES, on the ranks' device

# name: (dp, pp, tp, optimizer, build kwargs)
CASES = {
    4: {"dp+tp": (2, 1, 2, "sgd", {}),
        "dp+pp": (2, 2, 1, "sgd", dict(microbatches=2)),
        "pp+tp": (1, 2, 2, "sgd", dict(microbatches=4)),
        "dp+tp zero1": (2, 1, 2, "momentum", dict(zero=1)),
        "dp+pp zero1": (2, 2, 1, "momentum", dict(microbatches=2, zero=1)),
        "dp+pp recompute": (2, 2, 1, "sgd", dict(microbatches=2, recompute="full")),
        "pp+tp adamw": (1, 2, 2, "adamw", dict(microbatches=2))},
    8: {"3d": (2, 2, 2, "sgd", dict(microbatches=2)),
        "3d zero1 adamw": (2, 2, 2, "adamw", dict(microbatches=2, zero=1)),
        "3d gpipe sp": (2, 2, 2, "sgd", dict(microbatches=4, schedule="gpipe", sequence_parallel=True)),
        "3d zb-h1 momentum": (2, 2, 2, "momentum", dict(microbatches=2, schedule="zb-h1")),
        "3d interleaved zero1": (2, 2, 2, "momentum", dict(microbatches=2, schedule="interleaved",
                                                            virtual_stages=2, zero=1)),
        "dp+tp": (2, 1, 4, "sgd", {}),
        "dp+pp zero1": (4, 2, 1, "momentum", dict(microbatches=2, zero=1)),
        "pp+tp": (1, 4, 2, "sgd", dict(microbatches=2))},
}
TIMEOUT = 240


def _run_cases(world_size: int) -> dict:
    """Rank function: train every case of this world size; then a round trip of the state."""
    out = {}
    for name, (dp, pp, tp, opt, kw) in CASES[world_size].items():
        res = hybrid.train(GPT(CFG, seed=SEED), BATCHES, OPTIMIZERS[opt], dp=dp, pp=pp, tp=tp, **kw)
        res["measured"].pop("events")
        out[name] = res
    mesh = hybrid.ProcessMesh(dp=2, pp=2, tp=world_size // 4)
    model = hybrid.build(GPT(CFG, seed=SEED), mesh, microbatches=2)
    other = GPT(CFG, seed=SEED + 1).state_dict()
    model.load_full_state_dict(other)
    back = model.full_state_dict()
    out["round_trip"] = max(float((back[k] - other[k]).abs().max()) for k in other)
    out["local_numel"] = sum(v.numel() for v in model.local_state_dict().values())
    return out


@pytest.fixture(scope="module")
def references():
    return {k: train_reference(GPT(CFG, seed=SEED), BATCHES, make) for k, make in OPTIMIZERS.items()}


@pytest.fixture(scope="module", params=[4, pytest.param(8, marks=pytest.mark.slow)])
def launched(request):
    return request.param, minipar.launch(_run_cases, request.param, args=(request.param,), timeout=TIMEOUT)


def test_every_combination_matches_single_process(launched, references):
    """DP+TP, DP+PP, PP+TP, 3D, with and without ZeRO-1: same losses and final parameters."""
    world_size, results = launched
    for name, (dp, pp, tp, opt, kw) in CASES[world_size].items():
        want = references[opt]
        got = results[0][name]
        try:
            assert_same_training(got, want, **TOL[opt])
        except AssertionError as e:
            raise AssertionError(f"{world_size} ranks, case {name!r}: {e}") from None
        assert all(r[name]["losses"] == got["losses"] for r in results), f"{name}: ranks disagree on the loss"


def test_state_round_trip(launched):
    """load_full_state_dict then full_state_dict gives the same single-device weights back."""
    _, results = launched
    assert all(r["round_trip"] == 0.0 for r in results)
    assert sum(r["local_numel"] for r in results) > hybrid.num_params(CFG)  # replicas over dp


def test_coordinates_are_the_mesh_layout(launched):
    """Each rank's coordinates are rank = p·(dp·tp) + d·tp + t."""
    world_size, results = launched
    for name, (dp, pp, tp, _, _) in CASES[world_size].items():
        for rank, r in enumerate(results):
            c = r[name]["measured"]["coords"]
            assert c["pp"] * dp * tp + c["dp"] * tp + c["tp"] == rank


def test_bytes_and_memory_match_the_formulas(launched):
    """Measured bytes per dimension and model-state memory against minipar.cost, exactly
    where the formula is exact: dp all-reduce of the rank's own parameters, pp transfers
    of a middle stage, tp collectives of a stage holding only blocks."""
    world_size, results = launched
    for name, (dp, pp, tp, opt, kw) in CASES[world_size].items():
        m, zero1 = kw.get("microbatches", 1), kw.get("zero", 0) == 1
        b = BATCH // (dp * m)
        for rank, r in enumerate(results):
            res = dict(r[name]["measured"])          # a plain copy of the record, to add "bytes" to
            c, res["bytes"] = res["coords"], res["bytes_by_dim"]
            local = res["memory"]["params"] // 4
            if not zero1:
                assert res["memory"]["grads"] == 4 * local
                assert res["memory"]["optimizer"] == K[opt] * local
                assert res["bytes"]["dp"] == cost.collective_bytes("all_reduce", 4 * local, dp) * (dp > 1)
            else:  # ZeRO-1: optimizer state is 1/dp of the (padded) flat parameters
                assert res["memory"]["optimizer"] == K[opt] * local // dp
                assert res["bytes"]["dp"] == 2 * cost.collective_bytes("all_gather", 4 * local, dp)
            middle = 0 < c["pp"] < pp - 1
            if pp > 1 and kw.get("schedule", "1f1b") != "interleaved" and middle:
                assert res["bytes"]["pp"] == 2 * m * b * CFG.block_size * CFG.n_embd * 4
            blocks_only = pp == 4 and middle       # 6 layers in 4 stages: [e b0] [b1] [b2] [b3 h]
            if blocks_only and not kw.get("sequence_parallel"):
                want = cost.hybrid_comm_bytes(hybrid.num_params(CFG), CFG.n_layer, dp, pp, tp, BATCH,
                                              CFG.block_size, CFG.n_embd, m)
                assert res["bytes"]["tp"] == want["tp"] and res["bytes"]["pp"] == want["pp"]
    if world_size == 8:
        assert any(0 < r["pp+tp"]["measured"]["coords"]["pp"] < 3 for r in results)  # the exact case ran


@pytest.mark.parametrize("bad, message", [
    (dict(dp=2, pp=2, tp=2, world_size=4), "world_size"),
    (dict(dp=1, pp=1, tp=3, world_size=3), "divisible"),
    (dict(dp=1, pp=7, tp=1, world_size=7), "more stages than layers|only 6 layers"),
    (dict(dp=4, pp=1, tp=1, world_size=4, microbatches=4), "cannot be split"),
    (dict(dp=1, pp=0, tp=1, world_size=None), "positive"),
])
def test_bad_configurations_fail_before_launch(bad, message):
    """Plain errors before any process starts: product, divisibility, stages, batch."""
    with pytest.raises(ValueError, match=message):
        hybrid.check(CFG, BATCHES, **bad)


def test_tied_weights_and_pipeline_is_refused():
    """Tied embedding/head across pipeline stages is refused with a reason."""
    import dataclasses
    with pytest.raises(ValueError, match="tie_weights"):
        hybrid.run(GPT(dataclasses.replace(CFG, tie_weights=True)), BATCHES, 2, pp=2)
    with pytest.raises(ValueError, match="world_size|dp·pp·tp"):
        hybrid.check(CFG, BATCHES, 6, dp=2, pp=2, tp=2)


def test_formulas_reduce_to_the_single_strategies():
    """cost.hybrid_*: dp alone is ZeRO stage 0 (stage 1 with zero1), tp alone is the
    Megatron per-layer traffic, pp alone two activations per micro-batch."""
    psi = hybrid.num_params(CFG)
    for d in (2, 8):
        for zero1, stage in ((False, 0), (True, 1)):
            want = cost.zero_bytes_per_rank(psi, d, stage, k=8, dtype_bytes=4, padded=False)
            assert cost.hybrid_memory_per_rank(psi, d, 1, 1, zero1=zero1) == pytest.approx(want)
        got = cost.hybrid_comm_bytes(psi, CFG.n_layer, d, 1, 1, 16, 16, 32)
        assert got["dp"] == pytest.approx(cost.ddp_bytes_per_step(psi, d)) and got["tp"] == got["pp"] == 0
    got = cost.hybrid_comm_bytes(psi, 4, 1, 2, 4, 16, 8, 32, microbatches=2)
    assert got["tp"] == pytest.approx(2 * 2 * cost.tp_comm_bytes_per_layer(8, 8, 32, 4, 4))
    assert got["pp"] == 2 * 2 * 8 * 8 * 32 * 4 and got["dp"] == 0
    assert cost.hybrid_memory_per_rank(psi, 2, 2, 2)["total"] == pytest.approx(16 * psi / 4)
