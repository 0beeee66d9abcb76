"""The single-process reference takes one path on every device.

``train_reference`` and ``moe_reference`` train the model they are given, moved in place to
where the ranks compute (``reference.place``): no copy (a tensor-parallel model holds a
process group, which cannot be copied) and no branch that only a GPU takes. The non-CPU path
is run here on the CPU by training towards the ``meta`` device: it has no values, so the first
loss cannot be read, but by then the model handed in must be the one that moved (a copy would
leave it on the CPU, and on a sub-group's tensor-parallel model the copy itself fails).
"""
import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import data, reference
from minipar import tensor_parallel as tp
from minipar.hybrid import experts
from minipar.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, attention="materialized")
MOE = GPTConfig(**{**CFG.__dict__, "moe_every": 1, "n_experts": 2, "top_k": 1})
BATCHES = data.batches(data.synthetic_tokens(500, CFG.vocab_size), 2, 4, CFG.block_size)
NO_VALUES = "(?i)meta"   # what computing values on the meta device raises (a loss read, a count)


def _on_meta(model) -> bool:
    return all(p.device.type == "meta" for p in model.parameters())


def test_the_reference_trains_the_model_it_is_given_on_every_device():
    """On the CPU the returned parameters are the model's own, trained; towards another device
    the same model moves (the path a GPU takes), it is not a copy that does."""
    model = GPT(CFG, seed=0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    run = reference.train_reference(model, BATCHES, reference.sgd(0.5), device="cpu")
    for k, p in model.named_parameters():
        assert torch.equal(run["params"][k], p.detach()), k
        assert not torch.equal(p.detach(), before[k]), f"{k} did not train"
    assert run["params"]["head.lm_head.weight"].data_ptr() != model.head.lm_head.weight.data_ptr()

    other = GPT(CFG, seed=0)
    with pytest.raises(RuntimeError, match=NO_VALUES):
        reference.train_reference(other, BATCHES, reference.sgd(0.5), device="meta")
    assert _on_meta(other), "the reference trained a copy: the caller's model stayed where it was"


def test_the_moe_reference_takes_the_same_path(monkeypatch):
    """``moe_reference`` on the ranks' device: the model handed in moves there."""
    monkeypatch.setattr(experts, "rank_device", lambda: torch.device("meta"))
    model = GPT(MOE, seed=0)
    with pytest.raises(RuntimeError, match=NO_VALUES):
        experts.moe_reference(model, BATCHES, reference.sgd(0.5))
    assert _on_meta(model)


def _tensor_parallel_on_a_subgroup() -> dict:
    group = dist.new_group([0, 1])          # a sub-group: the model holds its ProcessGroup
    here = minipar.device()
    model = tp.TensorParallelGPT(CFG, group, seed=0).to(here)
    run = reference.train_reference(model, BATCHES, reference.sgd(0.5), device=here)
    own = all(torch.equal(run["params"][k], p.detach().cpu()) for k, p in model.named_parameters())
    moved = tp.TensorParallelGPT(CFG, group, seed=0)
    try:
        reference.train_reference(moved, BATCHES, reference.sgd(0.5), device="meta")
        error = None
    except (RuntimeError, ValueError) as e:   # a collective refuses a meta tensor by name
        error = str(e)
    return {"own": own, "losses": run["losses"], "full": tp.full_state_dict(model),
            "error": error, "moved": _on_meta(moved)}


def test_a_tensor_parallel_model_on_a_subgroup():
    """The reference trains a tensor-parallel model over a sub-group in place on the rank's
    device, and moves it (no copy) towards another device; its training is one process's."""
    got = minipar.launch(_tensor_parallel_on_a_subgroup, 2, timeout=60)
    want = reference.train_reference(GPT(CFG, seed=0), BATCHES, reference.sgd(0.5))
    for r in got:
        assert r["own"], "the returned parameters are not the model's own"
        assert r["error"] is not None and "meta" in r["error"].lower(), r["error"]
        assert r["moved"]
        reference.assert_same_training({"losses": r["losses"], "device": got.placement.device,
                                        "params": {k: v for k, v in r["full"].items() if k in want["params"]}},
                                       want, rtol=1e-5, atol=1e-6)


def test_the_tolerance_table_states_why_and_keeps_the_cpu_tight():
    """Every entry of ``TOLERANCES`` says why; each kind has a CPU and a GPU entry, the GPU's no
    tighter; the CPU's fp32 entries are what the CPU's own rounding needs (1e-5/1e-6 for a
    kernel or SGD training) and no more; an unknown kind is an error, not a silent default."""
    # placement-free: the table is read for named devices, whatever this machine is
    table = reference.TOLERANCES
    assert all(len(t.why) > 20 for t in table.values())
    for (dev, dtype, kind), t in table.items():
        other = table[("cuda" if dev == "cpu" else "cpu", dtype, kind)]
        gpu, cpu = (t, other) if dev == "cuda" else (other, t)
        assert gpu.rtol >= cpu.rtol and gpu.atol >= cpu.atol, (dtype, kind)
    for kind in ("kernel", "sgd"):
        assert reference.tolerance("cpu", torch.float32, kind) == {"rtol": 1e-5, "atol": 1e-6}
    assert reference.tolerance(["cpu", "cuda:0"], torch.float32, "sgd") == reference.tolerance("cuda", kind="sgd")
    with pytest.raises(KeyError, match="no tolerance"):
        reference.tolerance("cpu", torch.float32, "made up")


def test_a_change_beyond_rounding_fails_the_table():
    """A mutant that moves one loss or one parameter element by 1e-4 (relative), a hundred
    times fp32's rounding at these sizes, fails the CPU's default comparison."""
    want = reference.train_reference(GPT(CFG, seed=0), BATCHES, reference.sgd(0.5), device="cpu")
    reference.assert_same_training(want, want)
    loss = dict(want, losses=[want["losses"][0] * (1 + 1e-4)] + want["losses"][1:])
    with pytest.raises(AssertionError, match="losses differ"):
        reference.assert_same_training(loss, want)
    params = {k: v.clone() for k, v in want["params"].items()}
    w = params["head.lm_head.weight"]
    i = w.abs().argmax()
    w.view(-1)[i] = w.view(-1)[i] * (1 + 1e-4)
    with pytest.raises(AssertionError, match="head.lm_head.weight"):
        reference.assert_same_training(dict(want, params=params), want)
