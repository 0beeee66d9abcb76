"""ZeRO-3 per parameter (FSDP2's design) against the single process and against the flat
design; the reduce-path rules every stage shares; gradient clipping under every stage.

fp32 on CPU. Tolerances as in test_zero.py: SGD to rounding, AdamW looser (it divides by
sqrt(v), which magnifies the rounding of small gradients).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import minipar
from minipar import cost
from minipar import data, reference
from minipar.runtime import trace
from minipar.models import GPT, GPTConfig
from minipar.zero import (FullyShardedDataParallel, ReplicatedOptimizer, Zero2Optimizer,
                          ZeroOptimizer, clip_grad_norm_, fully_shard, full_state,
                          padded_unit_sizes)
from minipar.strategy import to_device
from minipar.memory import held_state_bytes

EVEN = dict(vocab_size=65, n_embd=32, n_head=2, n_layer=2, block_size=16)
ODD = dict(vocab_size=67, n_embd=30, n_head=2, n_layer=2, block_size=16)
STEPS, BATCH = 4, 8
OPTS = {"adamw": reference.adamw(1e-2, 0.1), "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}
TOL = {o: reference.tolerance(kind=o) for o in OPTS}   # minipar.reference.TOLERANCES, with the reasons


def _batches():
    toks, _ = data.corpus_tokens()
    return data.batches(toks, STEPS, BATCH, EVEN["block_size"])


def _per_parameter_runs(dtype=None):
    """Every rank: GPT (even and odd sizes) x optimizer under fully_shard, trained and measured."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, cfg in (("even", EVEN), ("odd", ODD)):
        for opt_name, make in OPTS.items():
            model = fully_shard(GPT(GPTConfig(**cfg), seed=0).to(minipar.device()), param_dtype=dtype)
            opt = make(model.parameters())        # any optimizer, on the module's own parameters
            losses = []
            for step, (x, y) in enumerate(to_device(_batches(), minipar.device())):
                mark = len(trace.events())
                opt.zero_grad()
                loss = model(data.shard(x, r, n), data.shard(y, r, n))
                loss.backward()
                grads_are_shards = all(p.grad is not None and p.grad.shape == p.shape
                                       and p.grad.dtype == torch.float32 for p in model.parameters())
                opt.step()
                t = loss.detach().float().reshape(1)
                dist.all_reduce(t)
                losses.append(t.item() / n)
            comm = [e for e in trace.events()[mark:] if e["kind"] == "comm"]
            out[name, opt_name] = {
                "losses": losses, "params": full_state(model), "grads_are_shards": grads_are_shards,
                "memory": held_state_bytes(model, optimizer=opt), "sizes": padded_unit_sizes(model),
                "sent": sum(e["bytes_sent"] for e in comm), "calls": len(comm)}
    return out


@pytest.fixture(scope="module")
def references():
    return {(name, o): reference.train_reference(GPT(GPTConfig(**cfg), seed=0), _batches(), make)
            for name, cfg in (("even", EVEN), ("odd", ODD)) for o, make in OPTS.items()}


@pytest.mark.parametrize("n", [2, 4])
def test_per_parameter_trains_like_one_process(references, n):
    """fully_shard: the module's own parameters are the shards; any optimizer on
    model.parameters(); .grad is the shard's fp32 gradient; losses and parameters equal the
    single process; memory (2+2+K)Ψ/N and bytes 3Ψ(N-1)/N, padding per parameter row."""
    for res in minipar.launch(_per_parameter_runs, n, timeout=180):
        for (name, o), got in res.items():
            reference.assert_same_training(got, references[name, o], **TOL[o])
            assert got["grads_are_shards"]
            sizes, k = got["sizes"], {"adamw": 8, "sgd": 4}[o]
            want = cost.zero_bytes_per_rank(sizes, n, 3, k=k, dtype_bytes=4)
            assert {c: got["memory"][c] for c in want} == want, (name, o)
            assert got["sent"] == cost.zero_comm_bytes(sizes, n, 3, dtype_bytes=4)
            assert got["calls"] == 3 * len(sizes)          # per unit: 2 all-gathers, 1 reduce-scatter


def test_per_parameter_mixed_precision(references):
    """bf16 gathers and compute, fp32 shards and fp32 gradients for the optimizer: close to
    fp32 training (same bound as the flat design's test), bytes on the wire halved."""
    want = references["odd", "adamw"]
    for res in minipar.launch(_per_parameter_runs, 2, args=(torch.bfloat16,), timeout=180):
        got = res["odd", "adamw"]
        assert got["grads_are_shards"]
        where = [got.get("device"), want["device"]]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   **reference.tolerance(where, torch.bfloat16, "bf16-vs-fp32"))
        flips = reference.tolerance(where, torch.bfloat16, "bf16-vs-fp32 adamw params", steps=STEPS, lr=1e-2)
        for k, v in want["params"].items():
            torch.testing.assert_close(got["params"][k], v, **flips)
        assert got["sent"] == cost.zero_comm_bytes(got["sizes"], 2, 3, dtype_bytes=2)


# ------------------------------------------------------------------ a data-dependent graph
class _Gate(nn.Module):
    """Adds a learned correction only to the samples with x[:, 0] > 0: on a rank whose
    shard has none, this unit's parameters get no gradient at all (its backward still runs:
    its input comes from a unit with parameters)."""

    def __init__(self, g):
        super().__init__()
        self.b = nn.Linear(4, 4)
        with torch.no_grad():
            self.b.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)

    def forward(self, x, raw):
        mask, out = raw[:, 0] > 0, x.clone()
        if mask.any():
            out[mask] = out[mask] + self.b(x[mask])
        return out


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        with torch.random.fork_rng():            # the same initial weights in every process
            torch.manual_seed(0)
            self.pre, self.gate, self.head = nn.Linear(4, 4), _Gate(g), nn.Linear(4, 1)

    def layers(self):
        return [self.pre, self.gate, self.head]

    def forward(self, x, y):
        return F.mse_loss(self.head(self.gate(torch.tanh(self.pre(x)), x)), y)


def _per_parameter_prefetch():
    """Every rank: one step of fully_shard with and without prefetch; what each gathered."""
    from minipar.zero.per_parameter import sharded_state
    r, n = dist.get_rank(), dist.get_world_size()
    x, y = _batches()[0]
    out = {}
    for prefetch in (True, False):
        model = fully_shard(GPT(GPTConfig(**EVEN), seed=0), prefetch=prefetch)
        fs = sharded_state(model)
        mark = trace.mark()
        loss = model(data.shard(x, r, n), data.shard(y, r, n))
        after_forward = [u.full.untyped_storage().nbytes() for u in fs.units]
        loss.backward()
        out[prefetch] = {"after_forward": after_forward, "peak": fs.peak_gathered_bytes,
                         "after_step": [u.full.untyped_storage().nbytes() for u in fs.units],
                         "unit_bytes": [4 * u.full.numel() for u in fs.units],
                         "gathers": [e["labels"] for e in trace.since(mark) if e["name"] == "all_gather"],
                         "grads": [p.grad.clone() for p in model.parameters()]}
    return out


def test_per_parameter_prefetches_the_next_unit():
    """Like FSDP2, each unit's gather starts while the unit before it computes (forward) or
    after it (backward): at most two neighbouring units gathered at once, every unit freed
    after use, and the same gradients as without prefetch."""
    for res in minipar.launch(_per_parameter_prefetch, 2, timeout=120):
        on, off = res[True], res[False]
        n_units = len(on["unit_bytes"])
        for run in (on, off):
            assert run["after_forward"] == run["after_step"] == [0] * n_units
            phases = [g.get("phase") for g in run["gathers"]]
            assert phases.count("forward") == phases.count("backward") == n_units
        assert sum(bool(g.get("prefetch")) for g in on["gathers"]) == 2 * (n_units - 1)
        assert not any(g.get("prefetch") for g in off["gathers"])
        pairs = [a + b for a, b in zip(on["unit_bytes"], on["unit_bytes"][1:])]
        assert on["peak"] == max(pairs) and off["peak"] == max(on["unit_bytes"])
        assert all(torch.equal(a, b) for a, b in zip(on["grads"], off["grads"]))


def _branchy_batches():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    x[:4, 0] = x[:4, 0].abs() + 0.1      # rank 0 of 2: every sample takes the branch
    x[4:, 0] = -x[4:, 0].abs() - 0.1     # rank 1: none does
    return [(x, y)] * 3


def _branchy_all_stages():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in ("0", "1", "2", "3", "3p", "3 no prefetch", "3p no prefetch"):
        model = _Branchy()
        units = [list(m.parameters()) for m in model.layers()]
        sgd = reference.sgd(0.1)
        prefetch, stage = "no prefetch" not in stage, stage.split()[0]
        if stage == "3":
            fwd = FullyShardedDataParallel(model, prefetch=prefetch)
            opt = sgd(fwd.parameters())
        elif stage == "3p":
            fwd = fully_shard(model, prefetch=prefetch)
            opt = sgd(model.parameters())
        else:
            fwd, opt = model, {"0": ReplicatedOptimizer, "1": ZeroOptimizer, "2": Zero2Optimizer}[stage](units, sgd, group=None)
        losses = []
        for x, y in _branchy_batches():
            opt.zero_grad()
            loss = fwd(data.shard(x, r, n), data.shard(y, r, n))
            loss.backward()
            opt.step()
            if stage == "3p":   # no gather left in flight or storage left gathered after a step
                from minipar.zero.per_parameter import sharded_state
                state = sharded_state(model)
                out.setdefault("3p idle", []).append(all(state.pending[i] is None and u.full.untyped_storage().nbytes() == 0
                                                         for i, u in enumerate(state.units)))
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            losses.append(t.item() / n)
        params = (fwd.gather_full_params() if stage == "3" else full_state(model) if stage == "3p"
                  else {k: v.detach().clone() for k, v in model.named_parameters()})
        out[stage + ("" if prefetch else " no prefetch")] = {"losses": losses, "params": params}
    return out


def test_unused_parameter_on_one_rank_does_not_hang():
    """A unit whose parameters get no gradient on one rank (data-dependent graph): every
    stage still runs the same collectives on every rank (zeros for the missing gradients)
    and trains like one process; stage 3 in both designs with prefetch and without (where no
    prefetched gather hides the reduce-scatters' order: ``OrderedReduction.reached``). Before the fix, stages 2 and 3 decided on a rank-local
    condition whether to reduce, and the ranks waited on each other until the timeout."""
    want = reference.train_reference(_Branchy(), _branchy_batches(), reference.sgd(0.1))
    assert want["params"]["gate.b.weight"].ne(_Branchy().gate.b.weight).any()   # the branch does learn
    for res in minipar.launch(_branchy_all_stages, 2, timeout=30):
        assert res.pop("3p idle") == [True] * 2 * len(_branchy_batches())
        assert set(res) == {"0", "1", "2", "3", "3p", "3 no prefetch", "3p no prefetch"}
        for stage, got in res.items():
            reference.assert_same_training(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------- two forwards, then two backwards
def _two_forwards_then_two_backwards():
    r, n = dist.get_rank(), dist.get_world_size()
    x, y = _batches()[0]
    x, y = data.shard(x, r, n), data.shard(y, r, n)
    out = {}
    for design in ("flat", "per-parameter"):
        model = GPT(GPTConfig(**EVEN), seed=0)
        fwd = FullyShardedDataParallel(model) if design == "flat" else fully_shard(model)
        opt = torch.optim.SGD(fwd.parameters(), lr=0.1)
        losses = [fwd(xm, ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2))]   # both graphs alive
        for loss in losses:
            loss.backward()
        opt.step()
        out[design] = fwd.gather_full_params() if design == "flat" else full_state(model)
    return out


def test_stage3_two_forwards_then_two_backwards():
    """Two micro-batches forwarded before either backward (gradient accumulation with both
    graphs alive): each backward re-gathers every unit it needs. Before the fix the second
    backward computed on freed storage, because the flag saying "gathered for this
    backward" was reset by the forward."""
    x, y = _batches()[0]
    model = GPT(GPTConfig(**EVEN), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xm, ym in zip(x.chunk(4), y.chunk(4)):   # 2 ranks x 2 micro-batches of 2 samples
        (model(xm, ym) / 4).backward()
    opt.step()
    want = dict(model.named_parameters())
    for res in minipar.launch(_two_forwards_then_two_backwards, 2, timeout=60):
        for design, got in res.items():
            for k, v in want.items():
                torch.testing.assert_close(got[k], v.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{design} {k}: {m}")


# ------------------------------------------------------------------------ clipping
CLIP = 0.05   # well below the GPT's gradient norm, so every step clips


def _clipped_reference():
    model = GPT(GPTConfig(**ODD), seed=0)
    opt = reference.adamw(1e-2, 0.1)(model.parameters())
    losses, norms = [], []
    for x, y in _batches():
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}, "norms": norms}


def _clipped_all_stages():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in ("0", "1", "2", "3", "3p"):
        model = GPT(GPTConfig(**ODD), seed=0)
        units = [list(m.parameters()) for m in model.layers()]
        adamw = reference.adamw(1e-2, 0.1)
        if stage in ("3", "3p"):
            fwd = FullyShardedDataParallel(model) if stage == "3" else fully_shard(model)
            opt = adamw(fwd.parameters())
        else:
            cls = {"0": ReplicatedOptimizer, "1": ZeroOptimizer, "2": Zero2Optimizer}[stage]
            fwd, opt = model, cls(units, adamw, max_grad_norm=CLIP)
        losses, norms = [], []
        for x, y in _batches():
            opt.zero_grad()
            loss = fwd(data.shard(x, r, n), data.shard(y, r, n))
            loss.backward()
            if stage in ("3", "3p"):     # the shards' .grad are the averaged gradient's shards
                norms.append(clip_grad_norm_([p.grad for p in fwd.parameters()], CLIP))
            opt.step()
            if stage not in ("3", "3p"):
                norms.append(opt.grad_norm)
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            losses.append(t.item() / n)
        params = (fwd.gather_full_params() if stage == "3" else full_state(model) if stage == "3p"
                  else {k: v.detach().clone() for k, v in model.named_parameters()})
        out[stage] = {"losses": losses, "params": params, "norms": norms}
    return out


def test_gradient_clipping_under_every_stage():
    """Clipping by the global norm of the averaged gradient gives the single process's
    norms and training under stages 0-3 (flat and per parameter): the norm is summed over
    the ranks' disjoint shards with one all-reduce of a scalar."""
    want = _clipped_reference()
    assert min(want["norms"]) > CLIP          # the test clips at every step
    for res in minipar.launch(_clipped_all_stages, 4, timeout=120):
        for stage, got in res.items():
            torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]),
                                       rtol=1e-5, atol=1e-7, msg=lambda m: f"stage {stage} norms: {m}")
            reference.assert_same_training(got, want, **TOL["adamw"])


def test_per_parameter_clear_errors():
    """Tied weights across units, and parameters outside every unit, are refused, by both
    designs in the same words (one check, ``stage3.unit_parameters``)."""
    for shard in (fully_shard, FullyShardedDataParallel):
        with pytest.raises(ValueError, match="shared by two units") as tied:
            shard(GPT(GPTConfig(**EVEN, tie_weights=True)))
        with pytest.raises(ValueError, match="in no unit") as missing:
            m = GPT(GPTConfig(**EVEN))
            shard(m, units=m.layers()[:1])
        assert (str(tied.value), str(missing.value)) == (
            "a parameter is shared by two units (tied weights?); stage 3 needs each parameter in exactly one unit",
            "parameters in no unit: ['blocks.0.ln1.weight', 'blocks.0.ln1.bias', 'blocks.0.attn.qkv.weight']...; "
            "pass units= covering them"), shard
