"""ZeRO-3 keeps small parameters whole (DeepSpeed's ``stage3_param_persistence_threshold``):
``persist_below=N`` elements, or ``persist=`` a predicate on modules, in both stage-3 designs.

Persistent parameters are replicated on every rank, never gathered, and their gradients are
all-reduced (averaged) in one call after every unit's reduce-scatter. Checked here, fp32 on
CPU, SGD with momentum (K = 4), 2 ranks:

* training equals the single process: losses every step and final parameters, rtol 1e-5,
  atol 1e-6 (the tolerance of the other ZeRO tests with SGD);
* collectives per step, exact: per sharded unit 2 all-gathers + 1 reduce-scatter, plus one
  all-reduce when anything persists. At layer granularity (``model.layers()``) every unit
  keeps a matrix to shard, so persistence saves bytes but adds that one call (12 -> 13); at
  module granularity (DeepSpeed's: one unit per module with parameters, FSDP assignments'
  "Linear and Embedding sharded, norms replicated") the 5 LayerNorm units need no collective
  at all: 48 -> 34 calls;
* memory per rank equals :func:`minipar.cost.zero_bytes_per_rank` with ``persistent=Ψ_p``
  ((4 + 4 + K)Ψ_p replicated), and the bytes sent :func:`minipar.cost.zero_comm_bytes`.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import minipar
from minipar import cost
from minipar import data, reference, zero
from minipar.runtime import trace
from minipar.models import GPT, GPTConfig
from minipar.zero import FullyShardedDataParallel, full_state, fully_shard
from minipar.memory import held_state_bytes

CFG = GPTConfig(vocab_size=67, n_embd=30, n_head=2, n_layer=2, block_size=16)
STEPS, BATCH = 3, 8
SGD = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)   # noqa: E731
# LayerNorms: 2 per block + ln_f, weight and bias of 30; biases below 200: qkv 90, proj 30,
# fc 120, proj 30 per block; the smallest matrix is wpe's 16 x 30 = 480
LN_ELEMENTS, SMALL_ELEMENTS = 5 * 2 * 30, 5 * 2 * 30 + 2 * (90 + 30 + 120 + 30)
CASES = {   # name: (units, persist_below, persist) -> (calls per step, Ψ_p)
    "layers": ("layers", None, None, 12, 0),
    "layers, persist_below=200": ("layers", 200, None, 13, SMALL_ELEMENTS),
    "modules": ("modules", None, None, 48, 0),
    "modules, persist LayerNorm": ("modules", None, "layernorm", 34, LN_ELEMENTS),
    "modules, persist_below=200": ("modules", 200, None, 34, SMALL_ELEMENTS),
}


def _batches():
    toks, _ = data.corpus_tokens()
    return data.batches(toks, STEPS, BATCH, CFG.block_size)


def _units(model, kind):
    if kind == "layers":
        return model.layers()
    return [m for m in model.modules() if any(p is not None for p in m._parameters.values())]


def _persist_runs():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for design in ("flat", "per-parameter"):
        for name, (kind, below, pred, _, _) in CASES.items():
            model = GPT(CFG, seed=0)
            keep = dict(persist_below=below, persist=(lambda m: isinstance(m, nn.LayerNorm)) if pred else None)
            if design == "flat":
                fwd = FullyShardedDataParallel(model, units=_units(model, kind), **keep)
            else:
                fwd = fully_shard(model, units=_units(model, kind), **keep)
            s3 = fwd if design == "flat" else fwd.__dict__["_fully_shard"]
            opt = SGD(fwd.parameters())
            losses = []
            for x, y in _batches():
                mark = trace.mark()
                opt.zero_grad()
                loss = fwd(data.shard(x, r, n), data.shard(y, r, n))
                loss.backward()
                opt.step()
                comm = [e for e in trace.since(mark) if e["kind"] == "comm"]
                t = loss.detach().reshape(1)
                dist.all_reduce(t)
                losses.append(t.item() / n)
            out[design, name] = {
                "losses": losses, "memory": held_state_bytes(s3, optimizer=opt),
                "params": fwd.gather_full_params() if design == "flat" else full_state(model),
                "calls": len(comm), "ops": sorted({e["name"] for e in comm}),
                "sent": sum(e["bytes_sent"] for e in comm), "sizes": s3.unit_sizes() if design == "flat"
                else [u.S * n for u in s3.units], "persistent": s3.persistent_numel()}
    # and through zero.train, what it measures
    res = zero.train(GPT(CFG, seed=0), _batches(), SGD, stage=3, sharding="per-parameter", persist_below=200)
    out["zero.train"] = res["measured"]
    return out


@pytest.fixture(scope="module")
def runs():
    return minipar.launch(_persist_runs, 2, timeout=240)


def test_persistent_parameters_train_like_one_process(runs):
    """Both designs, both granularities, with and without persistence: the single process's
    losses and parameters (rtol 1e-5, atol 1e-6), on every rank."""
    want = reference.train_reference(GPT(CFG, seed=0), _batches(), SGD)
    for res in runs:
        for key, got in ((k, v) for k, v in res.items() if k != "zero.train"):
            reference.assert_same_training(got, want, rtol=1e-5, atol=1e-6)


def test_persistence_counts_its_collectives(runs):
    """Exact calls per step: 3 per sharded unit, + 1 all-reduce when anything persists."""
    for res in runs:
        for design in ("flat", "per-parameter"):
            for name, (*_, calls, psi_p) in CASES.items():
                got = res[design, name]
                assert got["persistent"] == psi_p, (design, name)
                assert got["calls"] == calls, (design, name, got["calls"])
                assert ("all_reduce" in got["ops"]) == (psi_p > 0), (design, name, got["ops"])
                assert got["calls"] == 3 * len(got["sizes"]) + (psi_p > 0)


def test_persistence_memory_and_bytes_match_the_formulas(runs):
    """Measured bytes per rank = zero_bytes_per_rank(units, N, 3, K=4, 4 bytes, persistent=Ψ_p);
    bytes sent = zero_comm_bytes(units, N, 3, persistent=Ψ_p); fewer bytes in memory than
    without persistence is not the point (Ψ_p is replicated): fewer calls and no gathers are."""
    for res in runs:
        for design in ("flat", "per-parameter"):
            for name in CASES:
                got = res[design, name]
                want = cost.zero_bytes_per_rank(got["sizes"], 2, 3, k=4, dtype_bytes=4, persistent=got["persistent"])
                assert {c: got["memory"][c] for c in ("params", "grads", "optimizer")} == \
                    {c: want[c] for c in ("params", "grads", "optimizer")}, (design, name)
                assert got["sent"] == cost.zero_comm_bytes(got["sizes"], 2, 3, dtype_bytes=4,
                                                           persistent=got["persistent"]), (design, name)
        m = res["zero.train"]
        assert m["persistent"] == SMALL_ELEMENTS
        want = cost.zero_bytes_per_rank(m["unit_sizes"], 2, 3, k=0, dtype_bytes=4, persistent=m["persistent"])
        assert {c: m["memory"][c] for c in ("params", "grads")} == {c: want[c] for c in ("params", "grads")}


def test_persistence_clear_errors():
    """Persistence is a stage-3 option, with a whole number of elements (and combines with param_dtype)."""
    from minipar.zero import check
    gpt = GPT(CFG, seed=0)
    with pytest.raises(ValueError, match="stage 3"):
        check(gpt, _batches(), 2, stage=2, persist_below=100)
    check(gpt, _batches(), 2, stage=3, persist_below=100, param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="number of elements"):
        check(gpt, _batches(), 2, stage=3, persist_below=1.5)
    with pytest.raises(ValueError, match="stage-3 option"):
        cost.zero_bytes_per_rank(1000, 2, 1, persistent=10)


def _two_backwards():
    r, n = dist.get_rank(), dist.get_world_size()
    x, y = _batches()[0]
    x, y = data.shard(x, r, n), data.shard(y, r, n)
    out = {}
    for design in ("flat", "per-parameter"):
        model = GPT(CFG, seed=0)
        shard = FullyShardedDataParallel if design == "flat" else fully_shard
        fwd = shard(model, units=_units(model, "modules"), persist_below=200)
        opt = torch.optim.SGD(fwd.parameters(), lr=0.1)
        losses = [fwd(xm, ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2))]   # both graphs alive
        for loss in losses:
            loss.backward()                        # each backward all-reduces the accumulated sum
        opt.step()
        out[design] = fwd.gather_full_params() if design == "flat" else full_state(model)
    return out


def test_persistent_gradients_accumulate_over_two_backwards():
    """Gradient accumulation: two micro-batches' backwards before one step. The second
    all-reduce averages (already averaged first) + (this rank's second): still the mean of
    both, as one process accumulating gets (rtol 1e-5, atol 1e-6)."""
    x, y = _batches()[0]
    model = GPT(CFG, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xm, ym in zip(x.chunk(4), y.chunk(4)):     # 2 ranks x 2 micro-batches
        (model(xm, ym) / 4).backward()
    opt.step()
    for res in minipar.launch(_two_backwards, 2, timeout=60):
        for design, got in res.items():
            for k, v in model.named_parameters():
                torch.testing.assert_close(got[k], v.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k: f"{design} {k}: {m}")


def test_persist_below_keeps_only_fewer_elements_than_the_threshold():
    """``persist_below=N`` keeps parameters of *fewer* than N elements (DeepSpeed's threshold):
    one of exactly N is sharded. Linear(4, 5) and Linear(5, 3): weights of 20 and 15, biases of 5, 3."""
    from minipar.zero.persist import persistent_parameters
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    kept = lambda below: sorted(p.numel() for p in persistent_parameters(model, below))   # noqa: E731
    assert kept(15) == [3, 5]            # the 15-element weight is exactly the threshold: sharded
    assert kept(16) == [3, 5, 15]
    assert kept(5) == [3] and kept(3) == [] and kept(21) == [3, 5, 15, 20]


def _mixed_precision():
    r, n = dist.get_rank(), dist.get_world_size()
    x, y = _batches()[0]
    x, y = data.shard(x, r, n), data.shard(y, r, n)
    out = {}
    for design in ("flat", "per-parameter"):
        model, seen = GPT(CFG, seed=0), {}
        shard = FullyShardedDataParallel if design == "flat" else fully_shard
        wrapped = shard(model, param_dtype=torch.float16, persist=lambda m: isinstance(m, nn.LayerNorm))
        fc, ln = model.blocks[0].mlp.fc, model.blocks[0].ln1
        fc.register_forward_hook(lambda m, a, o: seen.update(fc=(m.weight.dtype, a[0].dtype, o.dtype)))
        ln.register_forward_pre_hook(lambda m, a: seen.update(ln=(m.weight.dtype, a[0].dtype)))
        loss = wrapped(x, y)
        loss.backward()
        params = list(wrapped.parameters())
        out[design] = {"seen": seen, "loss": loss.item(), "grads": {(p.dtype, p.grad.dtype, p.grad.shape == p.shape)
                                                                    for p in params},
                       "ln_grad": ln.weight.grad.clone(), "ln_dtype": ln.weight.dtype, "n": len(params)}
    return out


def test_mixed_precision_casts_only_the_sharded_parameters():
    """FSDP2's mixed precision with ``persist=`` (2 ranks, fp16, both designs): the sharded Linear
    weights compute in fp16, the persistent LayerNorms stay fp32 and compute in fp32, and every
    gradient lands in fp32 with its parameter's shape; the persistent gradient is averaged, the
    same on both ranks, and the loss is the fp32 one within fp16's precision."""
    res = minipar.launch(_mixed_precision, 2, device="cpu", timeout=120)
    want = GPT(CFG, seed=0)(*_batches()[0]).item()
    for design in ("flat", "per-parameter"):
        got = [r[design] for r in res]
        assert got[0]["seen"] == {"fc": (torch.float16,) * 3, "ln": (torch.float32, torch.float32)}, design
        assert got[0]["grads"] == {(torch.float32, torch.float32, True)}, design
        assert got[0]["ln_dtype"] == torch.float32
        torch.testing.assert_close(got[0]["ln_grad"], got[1]["ln_grad"], rtol=0, atol=0)
        assert abs(sum(g["loss"] for g in got) / 2 - want) < 1e-2, (design, want, [g["loss"] for g in got])


def _persist_kept_gathered():
    """Persistence with ``reshard_after_forward=False``: units stay gathered through the step and
    :meth:`finish_step` reduce-scatters them and averages the persistent gradients once."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for design in ("flat", "per-parameter"):
        model = GPT(CFG, seed=0)
        keep = dict(persist_below=200, reshard_after_forward=False)
        fwd = (FullyShardedDataParallel(model, units=model.layers(), **keep) if design == "flat"
               else fully_shard(model, units=model.layers(), **keep))
        s3 = fwd if design == "flat" else fwd.__dict__["_fully_shard"]
        opt = SGD(fwd.parameters())
        losses = []
        for x, y in _batches():
            opt.zero_grad()
            loss = fwd(data.shard(x, r, n), data.shard(y, r, n))
            loss.backward()
            s3.finish_step()
            opt.step()
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            losses.append(t.item() / n)
        out[design] = {"losses": losses,
                       "params": fwd.gather_full_params() if design == "flat" else full_state(model)}
    return out


def test_persistent_gradients_are_averaged_when_units_stay_gathered():
    """With ``reshard_after_forward=False`` the persistent parameters' gradients are averaged by
    ``finish_step`` (no backward reduces them): both designs train like one process (rtol 1e-5,
    atol 1e-6). Without that average, each rank steps its replicated parameters on its own half of
    the batch and the ranks drift apart."""
    want = reference.train_reference(GPT(CFG, seed=0), _batches(), SGD)
    for res in minipar.launch(_persist_kept_gathered, 2, timeout=240):
        for design, got in res.items():
            reference.assert_same_training(got, want, rtol=1e-5, atol=1e-6)
