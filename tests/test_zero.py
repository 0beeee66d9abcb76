"""ZeRO stages 0-3: equivalence with single-process training, memory and communication
per rank against the formulas of minipar.cost.zero, and clear errors.

Two models: ``EVEN`` (every unit's parameter count divisible by 2 and 4) and ``ODD``
(vocab 67, width 30: no unit divisible by 4, so shards are zero-padded to ⌈Ψ_u/N⌉).
One launch per world size trains every stage with AdamW and SGD on both models.
"""
import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, reference
from minipar.models import GPT, GPTConfig
from minipar.strategy import on_device
from minipar.zero import FullyShardedDataParallel, ZeroOptimizer, train, wrap

EVEN = dict(vocab_size=65, n_embd=32, n_head=2, n_layer=2, block_size=16)
ODD = dict(vocab_size=67, n_embd=30, n_head=2, n_layer=2, block_size=16)
STEPS, BATCH = 4, 8
OPTS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}
K = {"adamw": 8, "sgd": 4}      # fp32 bytes of per-element optimizer state per parameter
# fp32, different summation order (sharded mean vs one mean): SGD agrees to rounding;
# AdamW divides by sqrt(v), which magnifies rounding in small gradients (minipar.reference.TOLERANCES)
TOL = {o: reference.tolerance(kind=o) for o in OPTS}


def _batches():
    toks, _ = data.corpus_tokens()
    return data.batches(toks, STEPS, BATCH, EVEN["block_size"])


def _train(stage, model, batches, cls, group=None, param_dtype=None, **kw):
    """``zero.train`` with ``cls(params, **kw)`` on the rank's device; its measurements read at the top level."""
    res = on_device(train, model, batches, optimizer=lambda ps: cls(ps, **kw), group=group, stage=stage,
                    param_dtype=param_dtype)
    m = res["measured"]
    return {"losses": res["losses"], "params": res["params"], "memory": m["memory"], "device": res["device"],
            "comm_bytes": m["bytes_sent"], "unit_sizes": m["unit_sizes"]}


def _reference(cfg, opt):
    cls, kw = OPTS[opt]
    return reference.train_reference(GPT(GPTConfig(**cfg), seed=0), _batches(),
                                      lambda p: cls(p, **kw))


def _all_stages():
    """On every rank: every stage x optimizer x model, trained and measured."""
    out = {}
    for name, cfg in (("even", EVEN), ("odd", ODD)):
        for stage in range(4):
            for opt, (cls, kw) in OPTS.items():
                out[name, stage, opt] = _train(stage, GPT(GPTConfig(**cfg), seed=0), _batches(), cls, **kw)
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"])
def runs(request):
    return request.param, minipar.launch(_all_stages, request.param, timeout=240)


@pytest.fixture(scope="module")
def references():
    return {(name, opt): _reference(cfg, opt) for name, cfg in (("even", EVEN), ("odd", ODD))
            for opt in OPTS}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_same_training_as_single_process(runs, references, stage):
    """Losses every step and final parameters match single-process training, fp32."""
    n, results = runs
    for (name, opt), want in references.items():
        for rank, res in enumerate(results):
            got = res[name, stage, opt]
            try:
                reference.assert_same_training(got, want, **TOL[opt])
            except AssertionError as e:
                raise AssertionError(f"{n} ranks, stage {stage}, {opt}, {name} model, rank {rank}: {e}")
        # every rank ends with identical parameters
        for k, v in results[0][name, stage, opt]["params"].items():
            for res in results[1:]:
                assert torch.equal(res[name, stage, opt]["params"][k], v), f"ranks differ in {k}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_equals_formula(runs, stage):
    """Measured parameter, gradient and optimizer-state bytes per rank equal the formula
    exactly (padding each unit to a multiple of N), for both models."""
    n, results = runs
    for name in ("even", "odd"):
        for opt in OPTS:
            for rank, res in enumerate(results):
                got = res[name, stage, opt]
                want = cost.zero_bytes_per_rank(got["unit_sizes"], n, stage, k=K[opt], dtype_bytes=4)
                measured = {k: got["memory"][k] for k in ("params", "grads", "optimizer", "total")}
                assert measured == want, f"{n} ranks, stage {stage}, {opt}, {name}, rank {rank}"
    sizes = results[0]["odd", stage, "adamw"]["unit_sizes"]
    if n == 4:
        assert any(s % n for s in sizes), "the ODD model should need padding on 4 ranks"
    # the activations are those of the rank's share of the batch, the same in every stage
    acts = {res["odd", s, "sgd"]["memory"]["activations"] for s in range(4) for res in results}
    assert len(acts) == 1 and acts.pop() > 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_communication_per_step(runs, stage):
    """Bytes sent per rank per step: 2(N-1)/N·Ψ for stages 0-2, 3(N-1)/N·Ψ for stage 3 (fp32),
    as recorded from the tensors moved. Stages 1-3 move padded units, the same on every rank;
    stage 0 all-reduces unpadded buckets, in which each rank keeps its own share (the larger
    ones on the first ranks where N does not divide a bucket), so there the ranks together send
    N times the formula."""
    n, results = runs
    want = cost.zero_comm_bytes(results[0]["odd", stage, "adamw"]["unit_sizes"], n, stage, dtype_bytes=4)
    sent = [res["odd", stage, "adamw"]["comm_bytes"] for res in results]
    assert sum(sent) == pytest.approx(n * want, abs=0.5), sent
    if stage:
        assert sent == [want] * n
    ratio = results[0]["even", 3, "sgd"]["comm_bytes"] / results[0]["even", 1, "sgd"]["comm_bytes"]
    assert ratio == pytest.approx(1.5)


def _subgroups():
    """Two data-parallel groups of 2 ({0, 1} and {2, 3}), ZeRO stages 1 and 3 inside each."""
    group, ranks_of = None, ([0, 1], [2, 3])
    for ranks in ranks_of:                         # every rank creates every group
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            group = g
    cls, kw = OPTS["adamw"]
    return {stage: _train(stage, GPT(GPTConfig(**ODD), seed=0), _batches(), cls, group=group, **kw)
            for stage in (1, 3)}


def test_process_subgroups(references):
    """With group= a subgroup, each of two groups of 2 ranks reproduces single-process
    training and holds 1/2 of the state (what a 2D mesh's data-parallel dimension needs)."""
    results = minipar.launch(_subgroups, 4, timeout=120)
    for rank, res in enumerate(results):
        for stage in (1, 3):
            reference.assert_same_training(res[stage], references["odd", "adamw"], **TOL["adamw"])
            want = cost.zero_bytes_per_rank(res[stage]["unit_sizes"], 2, stage, k=8, dtype_bytes=4)
            assert res[stage]["memory"]["optimizer"] == want["optimizer"], f"rank {rank}"


def _mixed():
    cls, kw = OPTS["adamw"]
    out = {}
    for stage in (1, 2, 3):
        out[stage] = _train(stage, GPT(GPTConfig(**ODD), seed=0), _batches(), cls,
                           param_dtype=torch.bfloat16, **kw)
    return out


def test_mixed_precision(references):
    """bf16 compute with fp32 master weights: losses follow fp32 training closely, memory
    per rank equals the paper's mixed-precision formula (2Ψ + 2Ψ + 12Ψ, sharded by stage),
    and the collectives move 2-byte elements."""
    n = 2
    results = minipar.launch(_mixed, n, timeout=120)
    want = references["odd", "adamw"]
    for res in results:
        for stage in (1, 2, 3):
            got = res[stage]
            where = [got["device"], want["device"]]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                       **reference.tolerance(where, torch.bfloat16, "bf16-vs-fp32"))
            # AdamW moves an element by about lr per step, whatever the gradient's size, so
            # bf16 rounding of a tiny gradient can flip STEPS updates of size lr (the table's why)
            flips = reference.tolerance(where, torch.bfloat16, "bf16-vs-fp32 adamw params",
                                        steps=STEPS, lr=OPTS["adamw"][1]["lr"])
            for k, v in want["params"].items():
                torch.testing.assert_close(got["params"][k], v, **flips, msg=lambda m, k=k: f"stage {stage} {k}: {m}")
            sizes = got["unit_sizes"]
            paper = cost.zero_bytes_per_rank(sizes, n, stage, k=12, dtype_bytes=2)
            measured = {k: got["memory"][k] for k in ("params", "grads", "optimizer", "total")}
            if stage < 3:
                assert measured == paper, f"stage {stage}"
            else:   # the fp32 shard is both the parameter and the master copy: 4 + 4 + 8
                assert measured == cost.zero_bytes_per_rank(sizes, n, 3, k=8, dtype_bytes=4)
                assert measured["total"] == paper["total"]
            assert got["comm_bytes"] == cost.zero_comm_bytes(sizes, n, stage, dtype_bytes=2)


def _stage3_details():
    """Stage 3 internals: buffers freed after use, prefetch overlapping compute."""
    from minipar.runtime import trace
    model = GPT(GPTConfig(**EVEN), seed=0)
    fsdp = FullyShardedDataParallel(model)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    x, y = _batches()[0]
    r, n = dist.get_rank(), dist.get_world_size()
    live_in_forward = []
    for u in fsdp.units:   # how many gathered buffers exist while each unit computes
        u.module.register_forward_pre_hook(   # runs after FSDP's own pre-hook
            lambda *a: live_in_forward.append(sum(v.full.untyped_storage().nbytes() > 0 for v in fsdp.units)))
    trace.start(r)
    loss = fsdp(data.shard(x, r, n), data.shard(y, r, n))
    after_forward = [u.full.untyped_storage().nbytes() for u in fsdp.units]
    loss.backward()
    opt.step()
    after_step = [u.full.untyped_storage().nbytes() for u in fsdp.units]
    gathers = [e for e in trace.events() if e["name"] == "all_gather"]
    return {"live": live_in_forward, "after_forward": after_forward, "after_step": after_step,
            "peak": fsdp.peak_gathered_bytes, "padded": [u.flat.padded for u in fsdp.units],
            "gathers": gathers, "n_units": len(fsdp.units),
            "shard_numel": [u.shard.numel() for u in fsdp.units],
            "unit_sizes": fsdp.unit_sizes()}


def test_stage3_gathers_and_frees():
    """Stage 3 gathers each unit twice per step (forward, backward), frees it after use
    (at most 2 units gathered: the current one and the prefetched next), keeps k = ⌈Ψ_u/N⌉."""
    for res in minipar.launch(_stage3_details, 4, timeout=60):
        assert res["after_forward"] == [0] * res["n_units"]
        assert res["after_step"] == [0] * res["n_units"]
        assert res["live"] == [2] * (res["n_units"] - 1) + [1], res["live"]
        pairs = [4 * (a + b) for a, b in zip(res["padded"], res["padded"][1:])]
        assert res["peak"] == max(pairs), "at most two neighbouring units gathered at once"
        assert res["shard_numel"] == [-(-s // 4) for s in res["unit_sizes"]]
        phases = [e["labels"].get("phase") for e in res["gathers"]]
        assert phases.count("forward") == res["n_units"] and phases.count("backward") == res["n_units"]
        assert sum(bool(e["labels"].get("prefetch")) for e in res["gathers"]) == 2 * (res["n_units"] - 1)


class _Recording:
    """A stage-3 storage that logs what the schedule asks of it, then does it."""

    def __init__(self, inner, log):
        self.inner, self.units, self.log = inner, inner.units, log

    def gather(self, i, **labels):
        self.log.append(("gather", i))
        return self.inner.gather(i, **labels)

    def use(self, i, gathered):
        self.log.append(("use" if gathered else "unuse", i))
        self.inner.use(i, gathered)

    def free(self, i):
        self.log.append(("free", i))
        self.inner.free(i)

    def reduce(self, i):
        self.log.append(("reduce", i))
        self.inner.reduce(i)


def _schedule_calls():
    """Every rank: one step of stage 3's UnitSchedule over each design's storage, logged."""
    from minipar.zero.flat import FlatStorage
    from minipar.zero.per_parameter import PerParameterStorage
    from minipar.zero.stage3 import UnitSchedule, unit_parameters
    r, n = dist.get_rank(), dist.get_world_size()
    x, y = _batches()[0]
    out = {}
    for design in ("flat", "per-parameter"):
        model, log = GPT(GPTConfig(**EVEN), seed=0), []
        found = unit_parameters(model)
        if design == "flat":
            storage = FlatStorage([(m, [p for p, _ in f.values()]) for m, f in found])
            shards = [u.shard for u in storage.units]
        else:
            storage = PerParameterStorage([(m, list(f.values())) for m, f in found])
            shards = [q.shard for u in storage.units for q in u.ps]
        schedule = UnitSchedule(_Recording(storage, log), model)
        opt = torch.optim.SGD(shards, lr=0.1)
        model(data.shard(x, r, n), data.shard(y, r, n)).backward()
        opt.step()
        out[design] = {"log": log, "units": len(storage.units), "left": schedule.gathered_bytes,
                       "live": [u.full.untyped_storage().nbytes() for u in storage.units]}
    return out


def _paper_order(L):
    """Stage 3 with prefetch, as the FSDP paper's pseudo-code runs it on L units: forward
    gathers unit i, computes with it while unit i+1 is gathered, frees it; backward gathers
    unit i while unit i-1 is prefetched, then frees it and reduce-scatters its gradients."""
    fwd = []
    for i in range(L):
        fwd += ([("gather", 0)] if i == 0 else []) + [("use", i)] + ([("gather", i + 1)] if i + 1 < L else [])
        fwd += [("unuse", i), ("free", i)]
    bwd = [("gather", L - 1)]
    for i in reversed(range(L)):
        bwd += ([("gather", i - 1)] if i > 0 else []) + [("free", i), ("reduce", i)]
    return fwd + bwd


def test_schedule_runs_gather_use_free_reduce_in_the_papers_order():
    """Both storages see exactly the calls of the paper's schedule, in its order, for one
    step (prefetch on): each unit gathered twice, freed twice, reduced once; nothing left
    gathered, and the gathered bytes counted back to 0."""
    for res in minipar.launch(_schedule_calls, 2, timeout=60):
        for design, got in res.items():
            assert got["log"] == _paper_order(got["units"]), design
            assert got["left"] == 0 and got["live"] == [0] * got["units"], design


def test_clear_errors():
    """Bad configurations fail with a plain message, without starting any process."""
    with pytest.raises(ValueError, match="shared by two units"):
        FullyShardedDataParallel(GPT(GPTConfig(**EVEN, tie_weights=True)))
    with pytest.raises(ValueError, match="fp32"):
        ZeroOptimizer(GPT(GPTConfig(**EVEN)).to(torch.bfloat16).parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="stage"):
        wrap(4, GPT(GPTConfig(**EVEN)), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="stage"):
        cost.zero_bytes_per_rank(1000, 4, stage=4)
    with pytest.raises(ValueError, match="positive"):
        cost.zero_bytes_per_rank(1000, 0, stage=1)


def test_formulas_match_the_paper():
    """Ψ = 7.5B, N = 64, K = 12 (the ZeRO paper's Figure 1): 120, 31.4, 16.6, 1.88 GB."""
    gb = [cost.zero_bytes_per_rank(7.5e9, 64, s, padded=False)["total"] / 1e9 for s in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.875], rel=3e-3)
    # padding: 10 parameters on 4 ranks -> shards of 3, replicated buffers of 12
    assert cost.zero_bytes_per_rank(10, 4, 1, k=8, dtype_bytes=4) == \
        {"params": 48, "grads": 48, "optimizer": 24, "total": 120}
    assert cost.zero_bytes_per_rank([10, 4], 4, 3, k=8, dtype_bytes=4)["params"] == 4 * (3 + 1)
    assert cost.zero_comm_bytes(1000, 4, 3) == pytest.approx(1.5 * cost.zero_comm_bytes(1000, 4, 1))


def test_units_given_as_generators_stay_units():
    """``split_units`` takes the units as lists, generators or modules alike: one unit per
    layer, not all parameters in one (generators used to be consumed while flattening)."""
    from minipar.zero import split_units
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8), seed=0)
    want = [len(list(layer.parameters())) for layer in model.layers()]
    for units in ([list(layer.parameters()) for layer in model.layers()],
                  [layer.parameters() for layer in model.layers()], list(model.layers())):
        assert [len(u) for u in split_units(units)] == want
