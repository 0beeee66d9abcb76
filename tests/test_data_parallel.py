"""Data parallelism matches the single process, step for step.

For 2 and 4 ranks, one launch each trains several cases (GPT and MLP; naive, bucketed and
overlapped DDP; gradient accumulation; tied weights; frozen parameters; AdamW; your own
all-reduce; DDP inside sub-groups) and returns, per case, the losses, the final
parameters and the bytes each rank recorded. The driver compares every case with
``train_reference`` on the same global batches and the bytes with 2(n-1)/n·Ψ·4.
"""
import copy

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, reference
from minipar.runtime import trace
from minipar.comm import ring_all_reduce
from minipar.data_parallel import DistributedDataParallel, assign_buckets, run, train, trainable
from minipar.models import GPT, MLP, GPTConfig
from minipar.strategy import on_device

# fp32, a few steps: the only difference from one process is the order of the sums
RTOL, ATOL = reference.tolerance(kind="sgd").values()   # fp32 on the ranks' device (minipar.reference.TOLERANCES)
STEPS = 4
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
TIED = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32, tie_weights=True)
CAP = 0.02  # MB: ~5 buckets for the small GPT
TOKENS = data.synthetic_tokens(4000)


def _frozen_gpt():
    m = GPT(CFG, seed=3)
    m.embed.wpe.weight.requires_grad_(False)
    m.blocks[0].ln1.requires_grad_(False)
    return m


def _cases(n):
    gpt_b = data.batches(TOKENS, STEPS, 8, 16)
    mlp_b = data.regression_batches(STEPS, 16)
    naive, bucketed = dict(bucket_cap_mb=None, overlap=False), dict(bucket_cap_mb=CAP, overlap=False)
    over = dict(bucket_cap_mb=CAP, overlap=True)
    return {  # name: (model, batches, optimizer, accumulation, ddp kwargs)
        "gpt naive": (GPT(CFG, seed=1), gpt_b, reference.sgd(0.5), 1, naive),
        "gpt bucketed": (GPT(CFG, seed=1), gpt_b, reference.sgd(0.5), 1, bucketed),
        "gpt overlapped": (GPT(CFG, seed=1), gpt_b, reference.sgd(0.5), 1, over),
        "gpt overlapped accumulation": (GPT(CFG, seed=1), gpt_b, reference.sgd(0.5), 2, over),
        "gpt naive accumulation": (GPT(CFG, seed=1), gpt_b, reference.sgd(0.5), 2, naive),
        "gpt tied overlapped": (GPT(TIED, seed=4), gpt_b, reference.sgd(0.5), 1, over),
        "gpt tied naive": (GPT(TIED, seed=4), gpt_b, reference.sgd(0.5), 1, naive),
        "gpt frozen overlapped": (_frozen_gpt(), gpt_b, reference.sgd(0.5), 1, over),
        "gpt ring all-reduce": (GPT(CFG, seed=1), gpt_b, reference.sgd(0.5), 1,
                                dict(over, all_reduce_fn=ring_all_reduce)),
        "mlp naive": (MLP(seed=5), mlp_b, reference.sgd(0.1), 1, naive),
        "mlp bucketed": (MLP(seed=5), mlp_b, reference.sgd(0.1), 1, dict(bucket_cap_mb=0.005, overlap=False)),
        "mlp overlapped": (MLP(seed=5), mlp_b, reference.sgd(0.1), 2,
                           dict(bucket_cap_mb=0.005, overlap=True)),
        # AdamW on the MLP: on the GPT, Adam's g/√v turns the rounding noise of gradients
        # that are zero in exact arithmetic (the attention key bias) into full-size steps
        "mlp adamw overlapped": (MLP(seed=6), mlp_b, reference.adamw(1e-2), 1, dict(bucket_cap_mb=0.005)),
    }


def _grad_bytes(since):
    evs = trace.events()[since:]
    return (sum(e["bytes_sent"] for e in evs if e["name"] == "grad_all_reduce"),
            sum(e["name"] == "grad_all_reduce" for e in evs),
            sum(e["bytes_sent"] for e in evs if e["name"] == "ring_all_reduce"))


def _train_cases(cases, subgroups):
    """Every case on the world group, then (if ``subgroups``) one case per sub-group."""
    out = {}
    for name, (model, batches, opt, acc, kw) in cases.items():
        since = len(trace.events())
        res = on_device(train, model, batches, optimizer=opt, accumulation=acc, **kw)
        res["bytes"], res["calls"], res["ring_bytes"] = _grad_bytes(since)
        res["frozen_grads"] = [p.grad is None for p in model.parameters() if not p.requires_grad]
        out[name] = res
    if subgroups:
        groups = [dist.new_group(g) for g in subgroups]  # every rank creates every group
        mine = next(i for i, g in enumerate(subgroups) if dist.get_rank() in g)
        model, batches, opt, acc, kw = cases["gpt overlapped"]
        since = len(trace.events())
        res = on_device(train, GPT(CFG, seed=1), batches, optimizer=opt, group=groups[mine], **kw)
        res["bytes"], res["calls"], _ = _grad_bytes(since)
        out["subgroup"] = res
    return out


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_single_process(n):
    cases = _cases(n)
    subgroups = [[0, 1], [2, 3]] if n == 4 else None
    results = minipar.launch(_train_cases, n, args=(cases, subgroups), timeout=120)
    for name, (model, batches, opt, acc, kw) in cases.items():
        want = reference.train_reference(copy.deepcopy(model), batches, opt)  # ranks got copies
        psi = sum(p.numel() for p in trainable(model.parameters()))
        for rank, per_case in enumerate(results):
            got = per_case[name]
            try:
                reference.assert_same_training(got, want, rtol=RTOL, atol=ATOL)
            except AssertionError as e:
                raise AssertionError(f"{name}, rank {rank} of {n}: {e}") from None
            # bytes: 2(n-1)/n·Ψ·4 per step, whatever the bucketing; calls: one per bucket
            sent = got["ring_bytes"] if kw.get("all_reduce_fn") else got["bytes"]
            assert sent == STEPS * cost.ddp_bytes_per_step(psi, n), (name, sent, psi)
            if kw.get("all_reduce_fn") is None:
                per_step = (len(trainable(model.parameters())) if kw["bucket_cap_mb"] is None
                            else len(assign_buckets(trainable(model.parameters()), kw["bucket_cap_mb"])))
                assert got["calls"] == STEPS * per_step, (name, got["calls"], per_step)
            assert all(got["frozen_grads"]), f"{name}: a frozen parameter got a gradient"
    if n == 4:  # two independent DDP groups of 2, as in a 2D mesh
        model, batches, opt, _, _ = cases["gpt overlapped"]
        want = reference.train_reference(GPT(CFG, seed=1), batches, opt)
        psi = sum(p.numel() for p in model.parameters())
        for rank, per_case in enumerate(results):
            reference.assert_same_training(per_case["subgroup"], want, rtol=RTOL, atol=ATOL)
            assert per_case["subgroup"]["bytes"] == STEPS * cost.ddp_bytes_per_step(psi, 2)


def test_frozen_and_tied_are_counted_once():
    """Frozen parameters are not trainable; a tied matrix is one parameter, in one bucket."""
    frozen, tied = _frozen_gpt(), GPT(TIED, seed=4)
    assert len(trainable(frozen.parameters())) == len(list(frozen.parameters())) - 3
    assert tied.head.lm_head.weight is tied.embed.wte.weight
    ps = trainable(tied.parameters())
    assert sum(p is tied.embed.wte.weight for p in ps) == 1
    buckets = assign_buckets(ps, CAP)
    assert sum(p is tied.embed.wte.weight for b in buckets for p in b) == 1


def _overlap_run(cap):
    """Per step: when the last gradient (the token embedding's) was ready, and when each
    gradient all-reduce started and ended."""
    from minipar.models import GPT as G
    model = G(GPTConfig(vocab_size=32, block_size=32, n_layer=4, n_head=2, n_embd=64), seed=0)
    ddp_kw = [dict(bucket_cap_mb=cap, overlap=False), dict(bucket_cap_mb=cap, overlap=True)]
    out = []
    for kw in ddp_kw:
        ddp = DistributedDataParallel(model, **kw)
        ready = []
        h = model.embed.wte.weight.register_post_accumulate_grad_hook(lambda p: ready.append(trace.now()))
        trace.start(dist.get_rank())
        for step in range(3):
            x, y = data.get_batch(TOKENS, 8, 32, step)
            ddp(x, y).backward()
            model.zero_grad()
        h.remove()
        ddp.remove_hooks()
        comm = [(e["start"], e["end"]) for e in trace.events() if e["name"] == "grad_all_reduce"]
        out.append((ready, comm))
    return out


def test_overlap_starts_all_reduce_during_backward():
    """Overlapped: the first buckets' all-reduces start before the last gradient is computed;
    bucketed without overlap: none does."""
    (ready_b, comm_b), (ready_o, comm_o) = minipar.launch(_overlap_run, 2, args=(0.05,), timeout=60)[0]
    per_step = len(comm_b) // 3
    assert per_step >= 3 and len(comm_o) == len(comm_b)
    for s in range(3):
        b = comm_b[s * per_step:(s + 1) * per_step]
        o = comm_o[s * per_step:(s + 1) * per_step]
        assert all(start >= ready_b[s] for start, _ in b), "non-overlapped DDP launched early"
        early = [start < ready_o[s] for start, _ in o]
        assert sum(early) >= per_step - 1, \
            f"step {s}: only {sum(early)} of {per_step} buckets launched during backward"


def test_bad_setup_fails_before_launch():
    model, bs = MLP(seed=0), data.regression_batches(2, 6)
    with pytest.raises(ValueError, match="cannot split evenly"):
        run(model, bs, 4)
    with pytest.raises(ValueError, match="cannot split evenly"):
        run(model, data.regression_batches(2, 8), 2, accumulation=3)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        run(model, data.regression_batches(2, 8), 2, bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="world_size"):
        run(model, bs, 0)


def test_bucket_assignment():
    """Reverse order, at most the cap unless a single parameter is larger, every parameter once."""
    params = [torch.nn.Parameter(torch.zeros(k)) for k in (10, 300, 20, 20, 5, 1000)]
    cap_mb = 1200 / 2**20  # 1200 bytes = 300 floats
    index = {id(p): i for i, p in enumerate(params)}
    ids = [[index[id(p)] for p in b] for b in assign_buckets(params, cap_mb)]
    assert ids == [[5], [4, 3, 2], [1], [0]]
    assert [[index[id(p)] for p in b] for b in assign_buckets(params, 0)] == [[i] for i in range(5, -1, -1)]
    assert len(assign_buckets(params, 25)) == 1
    with pytest.raises(ValueError):
        assign_buckets(params, -1)


def _wrap_different_replicas():
    """Each rank builds a different model (seed = rank, a buffer = rank); DDP makes them equal."""
    r = dist.get_rank()
    with torch.device("cpu"):   # seeded on the CPU (the same on every machine), then where the rank computes
        model = GPT(TIED, seed=r).to(minipar.device())
    model.register_buffer("counter", torch.full((3,), float(r), device=minipar.device()))
    names = [k for k, _ in model.named_parameters()]
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP)
    return {"params": {k: v.detach().clone() for k, v in ddp.named_parameters()},
            "buffer": model.counter.clone(), "names": names,
            "ddp_names": [k for k, _ in ddp.named_parameters()],
            "state": list(ddp.state_dict()), "module": ddp.module is model}


def test_wrap_broadcasts_from_rank_0_and_keeps_names():
    """At wrap time rank 0's parameters and buffers reach every rank (3 ranks: a non-power-of-2
    tree); the wrapper keeps the module's names and order and exposes it as ``.module``."""
    results = minipar.launch(_wrap_different_replicas, 3, timeout=60)
    want = dict(GPT(TIED, seed=0).named_parameters())
    for rank, got in enumerate(results):
        assert got["module"] and got["ddp_names"] == got["names"] == list(want)
        assert "counter" in got["state"] and not any(k.startswith("module.") for k in got["state"])
        assert torch.equal(got["buffer"], torch.zeros(3)), f"rank {rank} kept its own buffer"
        for k, w in want.items():
            assert torch.equal(got["params"][k], w.detach()), f"rank {rank}: {k} not rank 0's"


def _ddp_bugs():
    """Two former bugs, on 2 ranks with different data: (1) ``bucket_cap_mb=None`` with the
    default ``overlap=True`` is the naive version: one all-reduce per parameter, all after
    the last gradient; (2) a backward that raises must not leave the next backward without
    its gradient averaging."""
    r = dist.get_rank()
    model = MLP(seed=0)
    x, y = data.regression_batches(1, 8, seed=r)[0]       # rank-dependent data
    ddp = DistributedDataParallel(model, bucket_cap_mb=None)
    first = next(iter(model.parameters()))                # its gradient is computed last
    ready = []
    h = first.register_post_accumulate_grad_hook(lambda p: ready.append(trace.now()))
    since = trace.mark()
    ddp(x, y).backward()
    h.remove()
    starts = [e["start"] for e in trace.since(since) if e["name"] == "grad_all_reduce"]
    naive = {"reducer": ddp.reducer is None, "calls": len(starts), "after": min(starts) >= ready[0]}
    ddp.remove_hooks()

    ddp = DistributedDataParallel(MLP(seed=0), bucket_cap_mb=CAP)
    boom = {"on": True}

    def fail(g):
        if boom["on"]:
            raise RuntimeError("boom")
        return g

    out = ddp.module.net[0](x)                             # the first layer's output ...
    out.register_hook(fail)                                # ... raises in the middle of backward
    loss = torch.nn.functional.mse_loss(ddp.module.net[1:](out), y)
    try:
        loss.backward()
    except RuntimeError:
        pass
    boom["on"] = False
    ddp.module.zero_grad(set_to_none=True)
    ddp(x, y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])
    return {"naive": naive, "grads": grads}


def test_naive_means_naive_and_a_failed_backward_is_forgotten():
    """bucket_cap_mb=None is one all-reduce per parameter after backward even with overlap=True;
    after a backward that raised, the next backward still averages the gradients."""
    results = minipar.launch(_ddp_bugs, 2, timeout=60)
    n_params = len(list(MLP(seed=0).parameters()))
    for r in results:
        assert r["naive"] == {"reducer": True, "calls": n_params, "after": True}, r["naive"]
    torch.testing.assert_close(results[0]["grads"], results[1]["grads"], rtol=0, atol=0)


def test_mixed_precision_follows_the_reference():
    """dtype="bf16": the forward under autocast on every rank, fp32 master weights; the
    losses follow the single process's bf16 run (bf16 rounding: 2e-2) and differ from fp32."""
    batches = data.batches(TOKENS, 3, 8, 16)
    got = run(GPT(CFG, seed=1), batches, 2, optimizer=reference.sgd(0.5), dtype="bf16")
    want = reference.train_reference(GPT(CFG, seed=1), batches, reference.sgd(0.5), dtype=torch.bfloat16)
    fp32 = reference.train_reference(GPT(CFG, seed=1), batches, reference.sgd(0.5))
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want["losses"]), rtol=0, atol=2e-2)
    assert got.losses != fp32["losses"] and all(v.dtype == torch.float32 for v in got.params.values())
