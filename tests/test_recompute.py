"""Activation recomputation (models.recompute) keeps the training, saves what Korthikanti
et al. say, and costs what the FLOP count says.

* Equivalence: a GPT trained with ``recompute="selective"`` or ``"full"`` matches the same
  GPT without recomputation, losses every step and final parameters, rtol 1e-6 / atol 1e-7
  (fp32; recomputation repeats the same operations, measured difference 0); single
  process (with dropout: the random state is replayed), inside pipeline stages (1F1B and
  ZB-H1's split backward) and with TP + SP, on 2 ranks.
* Memory: bytes saved for backward per block and rank (minipar.activations.SavedActivations)
  equal :func:`minipar.cost.recompute_activation_bytes` at fp32 without dropout, plus what
  the formula leaves out (layer-norm mean and 1/std; the s² causal mask when the attention
  is not recomputed), exactly; without parallelism, with TP and with TP + SP.
* Compute: the FLOPs counted by torch.utils.flop_counter equal 3×forward plus
  :func:`minipar.cost.checkpoint_recompute_flops`, exactly.
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minipar import cost

from minipar import data, pipeline
from minipar import tensor_parallel as tp
from minipar.activations import SavedActivations
from minipar.runtime.launch import launch
from minipar.models import GPT, GPTConfig
from minipar.models.gpt import Block
from minipar.reference import assert_same_training, sgd, train_reference
from minipar.strategy import on_device

RTOL, ATOL = 1e-6, 1e-7
MODES = ("none", "selective", "full")
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=4, n_embd=32,
                attention="materialized")   # what the formulas count (the CPU default; a GPU's is sdpa)
B, STEPS = 4, 3
BATCHES = data.batches(data.synthetic_tokens(4000, CFG.vocab_size), STEPS, B, CFG.block_size)


def _extras(b, s, rep, mode):
    """Beyond the formula: 2 layer norms' mean and 1/std (b·s/rep floats each), and the
    s² bool causal mask unless the attention core is recomputed."""
    if mode == "full":
        return 0
    return 4 * 4 * b * s // rep + (s * s if mode == "none" else 0)


def _want(t, sp, mode, b=B, s=CFG.block_size):
    return (cost.recompute_activation_bytes(s, b, CFG.n_embd, CFG.n_head, t, sp, mode,
                                            bytes_per_element=4, dropout=False)
            + _extras(b, s, t if sp else 1, mode))


def _reference(mode, config=CFG, batches=BATCHES):
    torch.manual_seed(0)
    return train_reference(GPT(config, seed=1).set_recompute(mode), batches, sgd(0.5))


def test_single_process_equivalence_and_memory():
    """Selective and full recomputation train exactly like none (also with dropout); a block keeps the formula's bytes."""
    want = _reference("none")
    for mode in ("selective", "full"):
        assert_same_training(_reference(mode), want, RTOL, ATOL)
    drop = GPTConfig(**{**CFG.__dict__, "dropout": 0.1})
    want = _reference("none", drop)
    for mode in ("selective", "full"):
        assert_same_training(_reference(mode, drop), want, RTOL, ATOL)
    for mode in MODES:
        block = Block(CFG)
        block.recompute = block.attn.recompute = mode
        x = torch.randn(B, CFG.block_size, CFG.n_embd, requires_grad=True)
        with SavedActivations(block) as saved:
            block(x)
        assert saved.bytes == _want(1, False, mode), (mode, saved.bytes)
    assert _want(1, False, "full") == 4 * B * CFG.block_size * CFG.n_embd      # 2sbh at 2 bytes -> 4sbh at 4


def test_extra_compute_is_the_count():
    """FLOPs with recomputation = 3×forward + checkpoint_recompute_flops (PyTorch's early stop)."""
    x, y = BATCHES[0]
    b, s, l, h, V = B, CFG.block_size, CFG.n_layer, CFG.n_embd, CFG.vocab_size
    for mode in MODES:
        with FlopCounterMode(display=False) as fc:
            GPT(CFG).set_recompute(mode)(x, y).backward()
        want = cost.training_flops(b, s, l, h, V, "none") + cost.checkpoint_recompute_flops(b, s, h, l, mode)
        assert fc.get_total_flops() == want, mode


def test_bad_mode_is_a_plain_error():
    """An unknown recompute mode is a ValueError naming the choices."""
    with pytest.raises(ValueError, match="recompute must be one of"):
        GPT(CFG).set_recompute("some")


def _ranks(config, batches):
    """On 2 ranks: per-block activation bytes under TP (and SP), TP+SP training and
    pipeline training (1F1B, ZB-H1) with every mode."""
    out = {"block": {}, "tp": {}, "pp": {}}
    model = tp.TensorParallelGPT(config, None, True, seed=1)
    x = torch.randn(B, config.block_size, config.n_embd, requires_grad=True)
    for sp in (False, True):
        block = tp.TensorParallelGPT(config, None, sp, seed=1).blocks[0]
        xs = x.chunk(2, 1)[torch.distributed.get_rank()].detach().requires_grad_() if sp else x
        for mode in MODES:
            block.recompute = block.attn.recompute = mode
            with SavedActivations(block) as saved:
                block(xs)
            out["block"][sp, mode] = saved.bytes
    del model
    for mode in MODES:
        out["tp"][mode] = on_device(tp.train, GPT(config, seed=1), batches, optimizer=sgd(0.5),
                                    sequence_parallel=True, recompute=mode)
        for sched in ("1f1b", "zb-h1"):
            out["pp"][mode, sched] = on_device(pipeline.train, GPT(config, seed=1).set_recompute(mode), batches,
                                               optimizer=sgd(0.5), schedule=sched, microbatches=2)
    return out


def test_tensor_and_pipeline_parallel():
    """TP+SP and pipeline stages (1F1B, ZB-H1) with recomputation match the single process; TP memory = formula."""
    res = launch(_ranks, 2, args=(CFG, BATCHES), timeout=120)
    want = _reference("none")
    for r in res:
        for (sp, mode), got in r["block"].items():
            assert got == _want(2, sp, mode), (sp, mode, got)
    for mode in MODES:
        got = {"losses": res[0]["tp"][mode]["losses"], "params": res[0]["tp"][mode]["params"]}
        assert_same_training(got, want, 1e-5, 1e-6)   # TP changes the order of sums
        for sched in ("1f1b", "zb-h1"):
            parts = [r["pp"][mode, sched] for r in res]
            got = {"losses": next(p["losses"] for p in parts if p["losses"] is not None),
                   "params": {k: v for p in parts for k, v in p["params"].items()}}
            assert_same_training(got, want, 1e-5, 1e-6)
    # the whole model on a TP+SP rank: none - full = L layers' difference of the formulas
    acts = {m: res[0]["tp"][m]["measured"]["memory"]["activations"] for m in MODES}
    L = CFG.n_layer
    assert acts["none"] - acts["full"] == L * (_want(2, True, "none") - _want(2, True, "full"))
    assert acts["none"] - acts["selective"] == L * (_want(2, True, "none") - _want(2, True, "selective"))


MOE = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32, moe_every=2, n_experts=4, top_k=2)


def _others():
    """On 4 ranks: the other strategies with recomputation (their recompute= option)."""
    import torch.distributed as dist

    from minipar import data_parallel, expert_parallel, hybrid, zero
    runs = {"dp full": lambda: data_parallel.train(GPT(CFG, seed=1), BATCHES, sgd(0.5), recompute="full"),
            "zero-3 full": lambda: zero.train(GPT(CFG, seed=1), BATCHES, sgd(0.5), stage=3, recompute="full"),
            "hybrid dp2×tp2+sp selective": lambda: hybrid.train(GPT(CFG, seed=1), BATCHES, sgd(0.5), dp=2, tp=2,
                                                                 sequence_parallel=True, recompute="selective"),
            "hybrid pp2×tp2 full": lambda: hybrid.train(GPT(CFG, seed=1), BATCHES, sgd(0.5), pp=2, tp=2,
                                                         microbatches=2, recompute="full"),
            "ep full": lambda: expert_parallel.train(GPT(MOE, seed=1), BATCHES, sgd(0.5), ep=4, recompute="full")}
    out = {}
    for name, fn in runs.items():
        dist.barrier()
        out[name] = fn()
    return out


def test_other_strategies_with_recompute():
    """DP, ZeRO-3, the hybrid mesh (TP+SP, PP×TP) and expert parallelism with recomputation = one process."""
    from minipar.strategy import TrainResult
    res = launch(_others, 4, timeout=180)
    for name in res[0]:
        got = TrainResult.merge([r[name] for r in res])
        cfg = MOE if name.startswith("ep") else CFG
        torch.manual_seed(0)
        want = train_reference(GPT(cfg, seed=1), BATCHES, sgd(0.5))
        assert_same_training(got, want, 1e-5, 1e-6)
