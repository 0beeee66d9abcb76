"""Chapter 12 on every layout the training command runs: experts over ep, bf16, ZeRO 1-3 flat
and per-parameter, HSDP. One launch of 4 ranks.

**The switch is bit for bit.** For each pair of layouts, a model trained one step on the old
layout is resharded into the new one; every element of every parameter and optimizer slot
(Adam's ``exp_avg``, ``exp_avg_sq``, fp32 master weights under bf16) that any rank holds after
the switch equals, bitwise, the element the old layout held (both gathered to full vectors from
:func:`minipar.adapt.holdings.holdings`), and Adam's ``step`` is carried. Tolerance 0: a switch
only copies.

**The runs train like one process** (6 steps, AdamW, losses of every step and final parameters):

* MoE (4 experts, top-2, dropless, m = 1): dp4·ep2 → dp4 (no ep) → dp2·tp2·ep2 ZeRO-1 →
  dp4·ep4 ZeRO-3 against :func:`~minipar.hybrid.experts.moe_reference`; fp32, ``rtol=1e-4,
  atol=5e-5`` (Adam magnifies rounding near eps; only the layouts' order of sums differs);
* bf16 autocast with fp32 master weights: dp4 ZeRO-1 → dp4 ZeRO-3 → dp4 ZeRO-2 →
  dp4 ZeRO-1. These layouts sum the gradients in the same order, so the run equals the same run
  without switches **bitwise** (losses and parameters, tolerance 0: the switch adds no rounding);
  against one process in bf16: losses ``rtol=1e-3, atol=2e-3`` (as tests/test_precision.py: a
  bf16 matmul's sums round differently over another batch split), weights within steps × lr (AdamW
  moves an element by about lr per step whatever its gradient's size, so bf16 rounding of a tiny
  gradient can flip an update, as tests/test_train.py);
* HSDP 2×2 ZeRO-3 → dp4 ZeRO-3 → HSDP 2×2 per-parameter → dp2·pp2 ZeRO-2; fp32, as the MoE.
"""
import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import adapt, data, hybrid
from minipar.adapt.holdings import holdings, scalars
from minipar.adapt.switch import reshard
from minipar.hybrid import experts
from minipar.models import GPT, GPTConfig
from minipar.reference import assert_same_training, train_reference

DENSE = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32)
MOE = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32, moe_every=1, n_experts=4, top_k=2)
SEED, STEPS, BATCH, LR = 1, 6, 8, 1e-2
BATCHES = data.batches(data.synthetic_tokens(3000, DENSE.vocab_size), STEPS, BATCH, DENSE.block_size)
ADAMW = {"lr": LR, "weight_decay": 0.1, "eps": 1e-6}


def adamw(ps):
    return torch.optim.AdamW(ps, **ADAMW)


JOBS = {"moe": (MOE, None, "dp=4,ep=2", ["2=dp=4", "3=dp=2,tp=2,ep=2,zero=1", "5=dp=4,ep=4,zero=3"]),
        "bf16": (DENSE, torch.bfloat16, "dp=4,zero=1",
                 ["2=dp=4,zero=3", "3=dp=4,zero=2", "5=dp=4,zero=1"]),
        "hsdp": (DENSE, None, "dp=4,zero=3,dp_shard=2",
                 ["2=dp=4,zero=3", "3=dp=4,zero=3,sharding=per-parameter,dp_shard=2", "5=dp=2,pp=2,zero=2"])}
PAIRS = [(MOE, None, "dp=4,ep=2", "dp=4"), (MOE, None, "dp=4", "dp=4,ep=4,zero=3"),
         (MOE, None, "dp=4,ep=4,zero=1", "dp=2,tp=2,ep=2,zero=2"),
         (DENSE, torch.bfloat16, "dp=4,zero=1", "dp=4,zero=3"), (DENSE, torch.bfloat16, "dp=4,zero=3", "dp=4,zero=1"),
         (DENSE, None, "dp=4,zero=3,dp_shard=2", "dp=4,zero=3"),
         (DENSE, None, "dp=4,zero=3", "dp=4,zero=3,sharding=per-parameter,dp_shard=2")]


# tensor-parallel column shards (moved as strided blocks) into ZeRO-3 and a pipeline, each pair twice:
# the second time its plan is the one kept from the first (minipar.adapt.plans)
KEPT = [(DENSE, None, "dp=2,tp=2,zero=1", "dp=4,zero=3"), (DENSE, None, "dp=4,zero=3", "pp=2,tp=2,zero=1")]


def _build(config, layout, dtype):
    lay = adapt.parse(layout)
    return hybrid.HybridModel(GPT(config, seed=SEED), lay.mesh(), optimizer=adamw, dtype=dtype, **lay.options())


def _gathered(hm) -> dict:
    """Every key's full flat vector from every rank's holdings (replicas must agree)."""
    index, views = holdings(hm)
    mine = {k: (i, torch.cat(views[k]).detach().cpu()) for k, i in index.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for held in everyone:
        for k, (i, v) in held.items():
            full = out.setdefault(k, torch.full((int(i.max()) + 1 if len(i) else 0,), float("nan")))
            if len(full) <= int(i.max()):
                full = out[k] = torch.cat([full, torch.full((int(i.max()) + 1 - len(full),), float("nan"))])
            seen = ~torch.isnan(full[i])
            assert torch.equal(full[i][seen], v[seen]), f"{k}: replicas disagree"
            full[i] = v
    return out


def _bitwise(config, dtype, old, new):
    x, y = BATCHES[0]
    a = _build(config, old, dtype)
    a.train_step(x, y)
    before, steps = _gathered(a), {k: float(v) for k, v in scalars(a).items()}
    b = _build(config, new, dtype)
    kept = reshard(a, b)["plan_kept"]
    after = _gathered(b)
    return {"keys": sorted(before) == sorted(after) and len(before) > 0, "kept": kept,
            "equal": [k for k in before if k in after and torch.equal(before[k], after[k])],
            "holes": [k for k, v in after.items() if bool(torch.isnan(v).any())],
            "steps": steps == {k: float(v) for k, v in scalars(b).items()} and steps.get("step") == 1.0}


def _jobs() -> dict:
    out = {name: adapt.train(GPT(cfg, seed=SEED), BATCHES, adamw, layout=first, switches=sw, dtype=dtype)
           for name, (cfg, dtype, first, sw) in JOBS.items()}
    out["bf16_still"] = adapt.train(GPT(DENSE, seed=SEED), BATCHES, adamw, layout="dp=4,zero=1",
                                    dtype=torch.bfloat16)
    out["bitwise"] = [_bitwise(*pair) for pair in PAIRS]
    out["kept"] = [_bitwise(*pair) for pair in KEPT + KEPT]
    return out


@pytest.fixture(scope="module")
def launched():
    return minipar.launch(_jobs, 4, timeout=300)


def test_every_switch_moves_every_element_bit_for_bit(launched):
    for pair, r in zip(PAIRS, launched[0]["bitwise"]):
        assert r["keys"], (pair[2:], "the layouts hold other keys")
        assert not r["holes"], (pair[2:], "elements no rank holds after the switch", r["holes"][:3])
        assert len(r["equal"]) > 0 and r["steps"], (pair[2:], r)
    for pair, r in zip(PAIRS, launched[0]["bitwise"]):      # every key equal: nothing rounded, nothing lost
        other = _gathered_keys(pair)
        assert sorted(r["equal"]) == other, (pair[2:], sorted(set(other) - set(r["equal"]))[:4])


def test_a_kept_plan_moves_every_element_bit_for_bit(launched):
    """Column shards into ZeRO-3, ZeRO-3 into pp2·tp2, each twice: the plan is made, then kept, and
    both times every element of every key arrives bitwise."""
    results = launched[0]["kept"]
    assert [r["kept"] for r in results] == [False] * len(KEPT) + [True] * len(KEPT)
    for pair, r in zip(KEPT + KEPT, results):
        assert r["keys"] and not r["holes"] and r["steps"], (pair[2:], r)
        assert sorted(r["equal"]) == _gathered_keys(pair), (pair[2:], r["kept"])


def _gathered_keys(pair) -> list[str]:
    """The keys a layout holds after one AdamW step: param, exp_avg, exp_avg_sq of every parameter."""
    names = [n for n, _ in GPT(pair[0], seed=SEED).named_parameters()]
    return sorted(f"{slot}/{n}" for n in names for slot in ("param", "exp_avg", "exp_avg_sq"))


def test_moe_switches_into_and_out_of_ep_like_one_process(launched):
    want = experts.moe_reference(GPT(MOE, seed=SEED), BATCHES, adamw, dp=4, microbatches=1)
    got = launched[0]["moe"]
    assert_same_training(got, want, rtol=1e-4, atol=5e-5)
    assert [s["to"] for s in got["measured"]["switches"]] == [s.split("=", 1)[1] for s in JOBS["moe"][3]]
    assert all(r["moe"]["losses"] == got["losses"] for r in launched), "ranks disagree on the loss"


def test_bf16_switches_between_zero_stages_like_one_process_in_bf16(launched):
    got, still = launched[0]["bf16"], launched[0]["bf16_still"]
    assert len(got["measured"]["switches"]) == 3
    assert_same_training(got, still, rtol=0, atol=0)        # bitwise: the switches add nothing
    want = train_reference(GPT(DENSE, seed=SEED), BATCHES, adamw, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-3, atol=2e-3)
    for k, v in want["params"].items():
        torch.testing.assert_close(got["params"][k], v, rtol=0, atol=STEPS * LR, msg=lambda m, k=k: f"{k}: {m}")


def test_hsdp_switches_to_and_from_plain_zero3_like_one_process(launched):
    want = train_reference(GPT(DENSE, seed=SEED), BATCHES, adamw)
    got = launched[0]["hsdp"]
    assert_same_training(got, want, rtol=1e-4, atol=5e-5)
    assert len(got["measured"]["switches"]) == 3


@pytest.mark.parametrize("config, layout, switches, message", [
    (MOE, "dp=2,pp=2,ep=2,m=2", ["2=dp=4,ep=2"], "micro-batches hold other rows"),
    (DENSE, "dp=4", ["2=dp=4,ep=2"], "needs a mixture-of-experts model"),
    (DENSE, "dp=4,zero=1", ["2=dp=4,zero=1,dp_shard=2"], "needs zero=3"),
    (DENSE, "dp=4", ["2=dp=4,sharding=rows"], "sharding is one of"),
])
def test_switches_that_cannot_continue_the_run_are_refused_before_launch(config, layout, switches, message):
    with pytest.raises(ValueError, match=message):
        adapt.run(GPT(config, seed=SEED), BATCHES, 4, layout=layout, switches=switches)
