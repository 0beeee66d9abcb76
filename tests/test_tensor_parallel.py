"""Tensor and sequence parallelism reproduce the single-device GPT, and cost what the
formulas say.

Two launches of 4 ranks do all the distributed work:

* t = 2: two tensor-parallel groups ({0, 1} and {2, 3}, group-local ranks), each running
  the same cases, which must agree with the single-device model and with each other;
* t = 4: the whole world as one group (``group=None``).

Each case (plain TP, TP + sequence parallelism, tied weights) compares logits, loss and
every gradient on one batch, then the loss at every step and the final parameters after
SGD training, with the single-device :class:`minipar.models.GPT`; fp32, ``RTOL``/``ATOL``
below (the splits only change the order of floating-point sums). The same rank function
measures one block's communication and activation memory against ``minipar.cost`` and
checks that uneven splits raise plain errors.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data
from minipar.runtime import trace
from minipar import tensor_parallel as tp
from minipar.activations import SavedActivations
from minipar.models import GPT, Block, GPTConfig
from minipar.reference import assert_same_training, sgd, tolerance, train_reference
from minipar.strategy import to_device

RTOL, ATOL = tolerance(kind="kernel").values()   # fp32 on the ranks' device; on the CPU the worst seen is ~1e-7
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32,
                attention="materialized")   # what the formulas count (the CPU default; a GPU's is sdpa)
SEED, LR, STEPS, B = 3, 0.5, 4, 4
BATCHES = data.batches(data.synthetic_tokens(4000, CFG.vocab_size), STEPS, B, CFG.block_size)
CASES = {"tp": dict(sp=False, tied=False), "tp+sp": dict(sp=True, tied=False),
         "tp+sp tied": dict(sp=True, tied=True)}
TIMEOUT = 120


def _config(tied: bool) -> GPTConfig:
    return dataclasses.replace(CFG, tie_weights=tied)


def _train_case(group, sp: bool, tied: bool, use_constructor: bool) -> dict:
    cfg = _config(tied)
    here = minipar.device()  # the rank's GPU under --gpu
    model = (tp.TensorParallelGPT(cfg, group, sp, seed=SEED) if use_constructor
             else tp.from_gpt(GPT(cfg, seed=SEED), group, sp)).to(here)
    x, y = to_device(BATCHES[0], here)
    logits = model(x)
    loss = model(x, y)
    loss.backward()
    out = {"logits": logits.detach(), "loss": loss.item(), "grads": tp.full_state_dict(model, grads=True)}
    model.zero_grad(set_to_none=True)
    run = train_reference(model, BATCHES, sgd(LR), device=here)   # trains model itself, on every device
    out["trained_in_place"] = all(torch.equal(run["params"][k], p.detach().cpu()) for k, p in model.named_parameters())
    out["train"] = {"losses": run["losses"],  # the trained model's shards gathered back to full tensors
                    "params": {k: v for k, v in tp.full_state_dict(model).items() if k in run["params"]}}
    out["drift"] = tp.replica_drift(model)
    out["round_trip"] = tp.to_gpt(model).state_dict()
    out["shards"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _measure_block(group, sp: bool, b: int = 4, s: int = 16) -> dict:
    """One block's forward + backward: bytes sent by name, and bytes saved for backward."""
    block = tp.ParallelBlock(CFG, group, sp).to(minipar.device())
    x = torch.randn(b, s, CFG.n_embd, generator=torch.Generator().manual_seed(0)).to(minipar.device())
    x = (tp.split_seq(x, group) if sp else x).requires_grad_()
    n0 = len(trace.events())
    with SavedActivations(block) as saved:
        y = block(x)
    y.sum().backward()
    sent = {}
    for e in trace.events()[n0:]:
        if e["kind"] == "comm":  # the operations (a shared GPU's host copies are 'staging' events)
            sent[e["name"]] = sent.get(e["name"], 0) + e["bytes_sent"]
    return {"saved": saved.bytes, "sent": sent}


def _layers(group) -> dict:
    """The layer classes on their own: a gathered column-parallel layer, then a row-parallel
    one that splits its (full) input itself, against the two single-device layers."""
    t = dist.get_world_size(group)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(8, 4 * t), torch.nn.Linear(4 * t, 6)
    a, b = a.to(minipar.device()), b.to(minipar.device())
    col = tp.ColumnParallelLinear.from_linear(a, gather_output=True, group=group)
    row = tp.RowParallelLinear.from_linear(b, input_is_parallel=False, group=group)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1)).to(minipar.device()).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    got, want = row(col(x)), b(a(x_ref))
    got.sum().backward()
    want.sum().backward()
    return {"out": (got.detach(), want.detach()), "grad": (x.grad, x_ref.grad)}


def _errors(group) -> dict:
    """Uneven splits raise ValueError before any communication; collect the messages."""
    t = dist.get_world_size(group)
    attempts = {
        "column": lambda: tp.ColumnParallelLinear(8, 2 * t + 1, group=group),
        "row": lambda: tp.RowParallelLinear(2 * t + 1, 8, group=group),
        "embedding": lambda: tp.VocabParallelEmbedding(2 * t + 1, 8, group=group),
        "heads": lambda: tp.ParallelBlock(dataclasses.replace(CFG, n_head=t + 1, n_embd=8 * (t + 1)), group),
        "sequence": lambda: tp.TensorParallelGPT(CFG, group, sequence_parallel=True)(
            torch.zeros(2, 2 * t + 1, dtype=torch.long)),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _rank(t: int) -> dict | None:
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(i, i + t))) for i in range(0, world, t)] if t < world else [None]
    group = groups[rank // t]
    out = {"cases": {name: _train_case(group, c["sp"], c["tied"], use_constructor=(name == "tp"))
                     for name, c in CASES.items()},
           "measure": {sp: _measure_block(group, sp) for sp in (False, True)},
           "errors": _errors(group), "layers": _layers(group)}
    return out if dist.get_rank(group) == 0 else None


@pytest.fixture(scope="module")
def runs():
    """Group-rank-0 results of every tensor-parallel group, for t = 2 and t = 4."""
    return {t: [r for r in minipar.launch(_rank, 4, args=(t,), timeout=TIMEOUT) if r is not None]
            for t in (2, 4)}


@pytest.fixture(scope="module")
def reference():
    """The single-device GPT on the same batches: batch-0 logits, loss, grads; training."""
    out = {}
    for tied in (False, True):
        model = GPT(_config(tied), seed=SEED)
        x, y = BATCHES[0]
        logits = model(x).detach()
        loss = model(x, y)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train = train_reference(GPT(_config(tied), seed=SEED), BATCHES, sgd(LR))
        out[tied] = {"logits": logits, "loss": loss.item(), "grads": grads, "train": train, "init": init}
    return out


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_same_as_single_device(runs, reference, t, case):
    """Logits, loss, gradients and training match the single-device GPT, for every group."""
    want = reference[CASES[case]["tied"]]
    assert len(runs[t]) == 4 // t
    for got in (group["cases"][case] for group in runs[t]):
        torch.testing.assert_close(got["logits"], want["logits"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), rtol=RTOL, atol=ATOL)
        assert set(got["grads"]) >= set(want["grads"])
        for k, w in want["grads"].items():
            torch.testing.assert_close(got["grads"][k], w, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"grad {k}: {m}")
        assert got["trained_in_place"], "the parameters read back are not the ones the reference trained"
        assert_same_training(got["train"], want["train"], rtol=RTOL, atol=ATOL)
        assert got["drift"] == 0.0, "replicated parameters diverged across the group"
    # the training moved the weights well beyond the tolerance, so the comparison means something
    moved = max((want["train"]["params"][k] - want["init"][k]).abs().max().item() for k in want["grads"])
    assert moved > 1e3 * ATOL


@pytest.mark.parametrize("t", [2, 4])
def test_checkpoints_cross_over(runs, t):
    """to_gpt(model) is the trained model's full state; each rank holds exactly its shards."""
    for group in runs[t]:
        got = group["cases"]["tp+sp tied"]
        full = got["round_trip"]
        for k, v in got["train"]["params"].items():
            assert torch.equal(full[k], v), k
        assert full["head.lm_head.weight"] is not None
        assert torch.equal(full["head.lm_head.weight"], full["embed.wte.weight"])
        shards = tp.shard_state_dict(full, t, 0)
        for k, v in got["shards"].items():
            assert torch.equal(shards[k], v), k
        assert got["shards"]["blocks.0.attn.qkv.weight"].shape == (3 * CFG.n_embd // t, CFG.n_embd)
        assert got["shards"]["embed.wte.weight"].shape == (CFG.vocab_size // t, CFG.n_embd)
    # shard/unshard are inverse, including the fused qkv of each rank's heads
    state = GPT(CFG, seed=1).state_dict()
    back = tp.unshard_state_dict([tp.shard_state_dict(state, t, r) for r in range(t)])
    assert all(torch.equal(back[k], v) for k, v in state.items())
    qkv = tp.shard_state_dict(state, t, t - 1)["blocks.0.attn.qkv.weight"]
    h, d = CFG.n_embd, CFG.n_embd // t
    q, k, v = state["blocks.0.attn.qkv.weight"].split(h)
    assert torch.equal(qkv, torch.cat([q[-d:], k[-d:], v[-d:]]))


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_bytes_per_layer_match_formula(runs, t, sp):
    """One layer sends 8·bsh·(t-1)/t elements per rank (+2·bsh·(t-1)/t with the SP re-gather)."""
    b, s, h = 4, 16, CFG.n_embd
    for group in runs[t]:
        sent = group["measure"][sp]["sent"]
        activations = sum(v for k, v in sent.items() if k != "sp.param_grad")
        assert activations == cost.tp_comm_bytes_per_layer(b, s, h, t, bytes_per_element=4, sequence_parallel=sp)
        if sp:  # layer norms (2 x weight, bias) and the 2 row-parallel biases: 6 vectors of h
            assert sent["sp.param_grad"] == 6 * cost.collective_bytes("all_reduce", 4 * h, t)
            assert set(sent) == {"sp.all_gather", "sp.reduce_scatter", "sp.all_gather (recompute)", "sp.param_grad"}
        else:
            assert set(sent) == {"f.all_reduce", "g.all_reduce"}


def _extras(b, s, rep):
    """What the measurement holds beyond the formula's terms: the mean and 1/std of the 2
    layer norms (b·s/rep floats each) and the causal mask (s² bools)."""
    return 4 * 4 * b * s // rep + s * s


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_memory_matches_formula(runs, t, sp):
    """Bytes saved for backward per layer and rank = Korthikanti et al.'s terms at fp32 without dropout."""
    b, s, h, a = 4, 16, CFG.n_embd, CFG.n_head
    want = cost.activation_bytes_per_layer(s, b, h, a, t, sp, bytes_per_element=4, dropout=False)
    if t == 1:
        block = Block(CFG)
        x = torch.randn(b, s, h, requires_grad=True)
        with SavedActivations(block) as saved:
            block(x)
        measured = [saved.bytes]
    else:
        measured = [group["measure"][sp]["saved"] for group in runs[t]]
    for m in measured:
        assert m == want + _extras(b, s, t if sp else 1), (m, want)


def test_paper_formulas():
    """activation_bytes_per_layer and tp_comm_bytes_per_layer on GPT-3's layer (s=2048, h=12288, a=96)."""
    s, b, h, a = 2048, 1, 12288, 96
    assert cost.activation_bytes_per_layer(s, b, h, a) == 2048 * 12288 * 114          # 34 + 5as/h
    assert cost.activation_bytes_per_layer(s, b, h, a, t=8) == 2048 * 12288 * 23        # 10 + 24/8 + 80/8
    assert cost.activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True) == 2048 * 12288 * 14.25
    assert cost.activation_bytes_per_layer(s, b, h, a, t=1, sequence_parallel=True) == 2048 * 12288 * 114
    assert cost.activation_bytes_per_layer(s, b, h, a, bytes_per_element=4, dropout=False) == \
        4 * (16 * s * b * h + a * s * s * b)
    assert cost.tp_comm_bytes_per_layer(b, s, h, t=8) == 2 * 8 * s * h * 7 / 8
    assert cost.tp_comm_bytes_per_layer(b, s, h, t=1) == 0


@pytest.mark.parametrize("t", [2, 4])
def test_layer_classes(runs, t):
    """ColumnParallelLinear(gather_output=True) then RowParallelLinear(input_is_parallel=False)."""
    for group in runs[t]:
        for what in ("out", "grad"):
            torch.testing.assert_close(*group["layers"][what], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("t", [2, 4])
def test_uneven_splits_are_clear_errors(runs, t):
    """Output/input features, vocabulary, heads and (with SP) sequence length not divisible by t."""
    errors = runs[t][0]["errors"]
    for name in ("column", "row", "embedding", "heads", "sequence"):
        assert errors[name] is not None, f"{name}: no error raised"
        assert f"t={t}" in errors[name] and "divisible" in errors[name], errors[name]


def test_config_checked_before_launch():
    """check names every problem of a GPT (or its config) for a given t, without any process."""
    tp.check(CFG, BATCHES, 4, sequence_parallel=True)
    bad = dataclasses.replace(CFG, vocab_size=65, n_head=6, n_embd=36, dropout=0.1)
    with pytest.raises(ValueError) as e:
        tp.run(GPT(bad), BATCHES, 4)
    for part in ("n_head=6", "vocab_size=65", "pad the vocabulary", "dropout"):
        assert part in str(e.value)
    with pytest.raises(ValueError, match="sequence length 18"):
        tp.check(CFG, None, 4, sequence_parallel=True, seq_len=18)
    with pytest.raises(ValueError, match="positive int"):
        tp.check(CFG, None, 0)


@pytest.mark.parametrize("sp, tied", [(False, False), (True, True)])
def test_run_trains_like_one_device(sp, tied):
    """tp.run (the API of every strategy): the losses of every step and the full final
    parameters of one device; what the last step measured: bytes and activations."""
    res = tp.run(GPT(_config(tied), seed=SEED), BATCHES, 2, optimizer=sgd(LR), sequence_parallel=sp)
    want = train_reference(GPT(_config(tied), seed=SEED), BATCHES, sgd(LR))
    assert_same_training(res, want, rtol=RTOL, atol=ATOL)
    for m in res.measured:
        assert m["bytes_by_dim"]["world"] == m["bytes_sent"] > 0 and m["memory"]["activations"] > 0


def test_the_tensor_parallel_gpt_is_the_gpt_built_from_parallel_layers():
    """Each tensor-parallel module subclasses the GPT's and defines only its constructor: the
    forward code (block, attention, MLP, embedding, head, the GPT's loop) is the GPT's, not a copy."""
    from minipar.models import gpt
    pairs = {tp.ParallelAttention: gpt.CausalSelfAttention, tp.ParallelMLP: gpt.FeedForward,
             tp.ParallelBlock: gpt.Block, tp.ParallelEmbedding: gpt.Embedding, tp.ParallelHead: gpt.Head,
             tp.TensorParallelGPT: gpt.GPT}
    own = {tp.TensorParallelGPT: {"parts", "loss", "forward", "load_full_state_dict"}}  # forward: + gather
    for parallel, single in pairs.items():
        assert issubclass(parallel, single), parallel
        defined = {k for k in vars(parallel) if not k.startswith("__")}
        assert defined <= own.get(parallel, set()), f"{parallel.__name__} redefines {defined}"
    assert tp.TensorParallelGPT.layers is gpt.GPT.layers and tp.ParallelBlock._forward is gpt.Block._forward
