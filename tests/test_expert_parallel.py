"""Expert parallelism: the MoE layer on one device, its expert-parallel version (outputs,
losses, every gradient, the dropped tokens, the all-to-all bytes) and DP × EP training of
the MoE GPT, each against one process.

Tolerances (fp32, CPU): outputs and input gradients are compared exactly (the experts see
the same rows in the same order, and combine adds at most two terms); parameter gradients
with rtol=1e-5, atol=1e-6 (the router's gradient is summed over ranks in another order);
training losses and final parameters with rtol=1e-5, atol=1e-6.
"""
import math

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, expert_parallel
from minipar.runtime import trace
from minipar.expert_parallel import count_tokens, kept_counts, permutation, split_sizes
from minipar.models import GPT, GPTConfig
from minipar.models.moe import MoE, capacity, route
from minipar.reference import DEVICE_TOLERANCE, assert_same_training, sgd, train_reference

H, B, T = 16, 8, 6
CASES = [(1, None), (2, None), (1, 1.0), (2, 1.0)]  # (top_k, capacity_factor)


def _layer(E, k, cf):
    torch.manual_seed(0)
    return MoE(H, E, k, cf, aux_coef=0.1, z_coef=0.01, hidden=24)


def _inputs():
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(1))
    g = torch.randn(B, T, H, generator=torch.Generator().manual_seed(2))
    return x, g


def _ep_cases(E):
    """On every rank: the EP layer on this rank's rows of x, for every case (where the rank
    computes: the CPU, or its GPU; results come back on the CPU)."""
    r, n, dev = dist.get_rank(), dist.get_world_size(), minipar.device()
    x, g = (t.to(dev) for t in _inputs())
    out = []
    for k, cf in CASES:
        ep = expert_parallel.ExpertParallelMoE(_layer(E, k, cf).to(dev))
        xs = x.chunk(n)[r].clone().requires_grad_()
        first = len(trace.events())
        y = ep(xs)
        ((y * g.chunk(n)[r]).sum() + ep.loss / n).backward()
        grads = {name: p.grad.clone() for name, p in ep.named_parameters()}
        dist.all_reduce(grads["router.weight"])  # the router is replicated: its gradient sums over ranks
        events = [e for e in trace.events()[first:] if e["name"].startswith("ep_")]
        out.append({"y": y.detach().cpu(), "dx": xs.grad.cpu(), "grads": {k: v.cpu() for k, v in grads.items()},
                    "aux": ep.stats["aux"].cpu(), "z": ep.stats["z"].cpu(), "dropped": ep.stats["dropped"],
                    "kept": ep.stats["kept"], "events": events, "device": dev.type})
    return out


def _single(E, k, cf):
    moe = _layer(E, k, cf)
    x, g = _inputs()
    x.requires_grad_()
    y = moe(x)
    ((y * g).sum() + moe.loss).backward()
    return moe, x, y


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ep_run(request):
    ep, E = request.param, 8
    return ep, E, minipar.launch(_ep_cases, ep, args=(E,), timeout=60)


def _same(got, want, rtol=0.0, atol=0.0, device="cpu"):
    """Equal within rtol/atol, or within the floor of the device the ranks computed on."""
    floor = DEVICE_TOLERANCE.get(device, (0.0, 0.0))
    torch.testing.assert_close(got, want, rtol=max(rtol, floor[0]), atol=max(atol, floor[1]))


def test_layer_equals_single_device(ep_run):
    """Outputs, input gradients, aux and z-loss, every parameter gradient: EP = one device.
    Outputs and input gradients agree to fp32 rounding (rtol 1e-6, atol 1e-7), not bit for bit:
    the driver's GEMMs run on all its threads and a rank's on one, and a different thread count
    sums a dot product in a different order (4.8e-8 apart on 2 cores)."""
    ep, E, results = ep_run
    for c, (k, cf) in enumerate(CASES):
        moe, x, y = _single(E, k, cf)
        ranks = [r[c] for r in results]
        dev = ranks[0]["device"]
        _same(torch.cat([r["y"] for r in ranks]), y.detach(), rtol=1e-6, atol=1e-7, device=dev)
        _same(torch.cat([r["dx"] for r in ranks]), x.grad, rtol=1e-6, atol=1e-7, device=dev)
        aux, z = moe.stats["aux"], moe.stats["z"]
        _same(torch.stack([r["aux"] for r in ranks]).mean(), aux, rtol=1e-6, atol=1e-7, device=dev)
        _same(torch.stack([r["z"] for r in ranks]).mean(), z, rtol=1e-6, atol=1e-7, device=dev)
        got = {name: g for r in ranks for name, g in r["grads"].items()}
        assert set(got) == {n for n, _ in moe.named_parameters()}
        for name, p in moe.named_parameters():
            want = p.grad if p.grad is not None else torch.zeros_like(p)   # an expert nobody chose
            _same(got[name], want, rtol=1e-5, atol=1e-6, device=dev)


def test_same_tokens_dropped(ep_run):
    """The EP run drops exactly the assignments the single device drops (some, with capacity)."""
    ep, E, results = ep_run
    for c, (k, cf) in enumerate(CASES):
        moe, _, _ = _single(E, k, cf)
        dropped = torch.cat([r[c]["dropped"] for r in results])
        assert torch.equal(dropped, moe.stats["dropped"]), (ep, k, cf)
        n = int(dropped.sum())
        assert (n > 0) if cf is not None else (n == 0), (ep, k, cf, n)
        assert torch.equal(results[0][c]["kept"].sum(0), moe.stats["kept"])
        if cf is not None:  # no expert over capacity
            assert int(moe.stats["kept"].max()) <= capacity(B * T, E, k, cf)


def test_all_to_all_bytes_equal_formula(ep_run):
    """Recorded dispatch/combine bytes (forward and backward) = the formula given the routing."""
    ep, E, results = ep_run
    for c, (k, cf) in enumerate(CASES):
        kept = results[0][c]["kept"]
        for r, res in enumerate(results):
            ev = {e["name"]: e for e in res[c]["events"]}
            sent = cost.ep_bytes_routed(kept, r, H)
            recv = cost.ep_bytes_received(kept, r, H)
            for name in ("ep_dispatch", "ep_combine_backward"):
                assert (ev[name]["bytes_sent"], ev[name]["bytes_recv"]) == (sent, recv), (name, r)
            for name in ("ep_combine", "ep_dispatch_backward"):
                assert (ev[name]["bytes_sent"], ev[name]["bytes_recv"]) == (recv, sent), (name, r)
            assert ev["ep_dispatch"]["labels"]["dim"] == "ep"
        if cf is None:  # dropless: on average k·S·h·(ep-1)/ep per rank (exact in expectation only)
            total = sum(cost.ep_bytes_routed(kept, r, H) for r in range(ep))
            expected = ep * cost.ep_all_to_all_bytes(B * T // ep, H, k, ep)
            assert 0.5 * expected < total < 1.5 * expected


def test_moe_layer_on_one_device():
    """Routing renormalised, capacity formula, dropped token carried by zeros, naive reference."""
    moe = _layer(4, 2, 0.5)
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    logits = moe.router(x)
    probs, w, e = route(logits, 2)
    torch.testing.assert_close(w.sum(-1), torch.ones(32))
    assert capacity(32, 4, 2, 0.5) == 8 and capacity(10, 4, 1, 1.0) == 3 and capacity(5, 4, 1, None) is None
    assert torch.equal(route(logits, 1)[1][:, 0], probs.max(-1).values)  # k = 1 keeps the raw probability
    y = moe(x)
    keep = ~moe.stats["dropped"].view(32, 2)
    assert (moe.stats["kept"] <= 8).all() and (~keep).any()
    # naive reference: every expert on every token, weighted by the kept gates
    gates = torch.zeros(32, 4).scatter(1, e, w * keep)
    want = sum(gates[:, i:i + 1] * moe.experts[i](x) for i in range(4))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    # dropped-first policy is by position: a later token is never kept where an earlier one was dropped
    for i in range(4):
        mask = (e == i)
        kept_rows = (mask & keep).any(1).nonzero().squeeze(-1)
        dropped_rows = (mask & ~keep).any(1).nonzero().squeeze(-1)
        if len(kept_rows) and len(dropped_rows):
            assert kept_rows.max() < dropped_rows.min()
    f = torch.bincount(e.reshape(-1), minlength=4).float() / 64
    aux = 4 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(moe.loss, 0.1 * aux + 0.01 * logits.logsumexp(-1).square().mean())


def test_gpt_moe_options():
    """Default GPT unchanged (no router); moe_every picks the blocks; the loss includes the aux loss."""
    dense = GPT(GPTConfig(), seed=0)
    assert not any("router" in n for n, _ in dense.named_parameters())
    cfg = GPTConfig(n_layer=4, moe_every=2, n_experts=4, top_k=2, aux_loss_coef=0.5)
    m = GPT(cfg, seed=0)
    assert [type(b.mlp).__name__ for b in m.blocks] == ["FeedForward", "MoE", "FeedForward", "MoE"]
    x = torch.randint(0, 65, (2, 8))
    from minipar.models.gpt import lm_loss
    loss = m(x, x)
    aux = sum(b.mlp.loss for b in m.blocks[1::2])
    torch.testing.assert_close(loss, lm_loss(m(x), x) + aux)


def test_dispatch_pieces():
    """Counts, split sizes, the stable permutation and its inverse, capacity by position."""
    e = torch.tensor([2, 0, 3, 2, 1, 0, 2])
    assert count_tokens(e, 5).tolist() == [2, 1, 3, 1, 0]
    M = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert split_sizes(M, 0, 2) == ([3, 7], [3, 11]) and split_sizes(M, 1, 2) == ([11, 15], [7, 15])
    perm, inv = permutation(e)
    assert perm.tolist() == [1, 5, 4, 0, 3, 6, 2]
    assert torch.equal(e[perm][inv], e)
    assert kept_counts(torch.tensor([[3, 1], [4, 0]]), 5).tolist() == [[3, 1], [2, 0]]


def _moe_gpt(cf=None, k=2, E=4):
    return GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=16, vocab_size=32, moe_every=1,
                         n_experts=E, top_k=k, capacity_factor=cf, aux_loss_coef=0.1), seed=1)


def momentum(params):
    """SGD with momentum: an expert that gets a zero gradient instead of none would still move."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def test_dp_ep_training_matches_single_process():
    """DP × EP (dp=4, ep=2, dropless), EP (dp=ep=2, capacity 1.0, full recomputation) and DP × EP
    with momentum and experts that no token chose in some step, each trains like one process."""
    bs = data.batches(data.synthetic_tokens(4000, 32), 4, 8, 16)
    for world, ep, cf, k, E, opt, rec in [(4, 2, None, 2, 4, sgd(0.3), "none"),
                                          (2, 2, 1.0, 1, 4, sgd(0.3), "full"),
                                          (4, 2, None, 1, 8, momentum, "none")]:
        ref = train_reference(_moe_gpt(cf, k, E), bs, opt)
        got = expert_parallel.run(_moe_gpt(cf, k, E), bs, world, optimizer=opt, ep=ep, recompute=rec)
        assert_same_training(got, ref, rtol=1e-5, atol=1e-6)
        assert got.losses[-1] < got.losses[0]
        dispatches = len(got.trace.events(name="ep_dispatch"))   # ranks × layers × steps (× 2 recomputed)
        assert dispatches == world * 2 * len(bs) * (2 if rec == "full" else 1)
        expert = cost.moe_params(16, E, k)["expert"]      # parameters per rank: experts sharded over ep
        assert got.measured[0]["parameters"] == sum(p.numel() for p in ref["params"].values()) - 2 * (E - E // ep) * expert
        if opt is momentum:  # the case this run is for did happen
            assert any(0 in layer for step in got.measured[0]["tokens_per_expert"] for layer in step)
        ev = got.trace.events(kind="comm")
        assert {e["name"] for e in ev} >= {"ep_dispatch", "ep_combine", "dense_grads", "expert_grads"}
        groups = {e["name"]: e["labels"].get("reduced_over") for e in ev if e["name"].endswith("_grads")}
        assert groups == {"dense_grads": "dp", "expert_grads": "expert_dp"}


@pytest.mark.parametrize("kw, msg", [
    (dict(ep=3), "cannot be split"), (dict(ep=8, world=4), "cannot be split"),
    (dict(ep=2, world=3), "must divide"), (dict(ep=2, pp=2), "pp=2"),
    (dict(ep=2, tp=3, world=6), "cannot split"), (dict(ep=4, tp=2, world=4), "must divide"),
    (dict(ep=2, world=4, cf=1.0), "dropless"), (dict(ep=2, top_k=5), "exceeds"),
    (dict(ep=2, dense=True), "no MoE layers")])
def test_check_rejects(kw, msg):
    """Bad configurations fail in check(), before any process starts."""
    model = GPT(GPTConfig(n_layer=1)) if kw.get("dense") else _moe_gpt(kw.get("cf"))
    if "top_k" in kw:
        model.blocks[0].mlp.top_k = kw["top_k"]
    bs = data.batches(data.synthetic_tokens(2000, 32), 1, 8, 16)
    opts = {k: v for k, v in kw.items() if k in ("ep", "tp", "pp")}
    with pytest.raises(ValueError, match=msg):
        expert_parallel.check(model, bs, kw.get("world", 2), **opts)


def test_cost_formulas_match_the_model():
    """Parameter counts and per-rank shares equal the layer's; FLOPs per token active < total."""
    moe = MoE(H, 8, 2, hidden=24)
    p = cost.moe_params(H, 8, 2, 24, ep=4)
    assert p["total"] == sum(t.numel() for t in moe.parameters())
    assert p["per_rank"] == H * 8 + 2 * sum(t.numel() for t in moe.experts[0].parameters())
    f = cost.moe_flops_per_token(H, 8, 2, 24)
    assert f["active"] == 2 * H * 8 + 2 * 2 * 2 * H * 24 and f["all_experts"] == 8 * 4 * H * 24
    assert math.isclose(cost.ep_all_to_all_bytes(100, H, 2, 4), 2 * 100 * H * 0.75 * 4)
    assert cost.ep_memory_per_rank(1000, 8000, 4) == (1000 + 2000) * 16


def test_all_to_all_bytes_are_elements_times_their_size():
    """ep_all_to_all_bytes returns bytes: k·S·h·(ep-1)/ep elements times bytes_per_element
    (fp32 by default), and its docstring says so."""
    elements = 2 * 256 * 64 * 3 / 4
    assert cost.ep_all_to_all_bytes(256, 64, 2, 4) == elements * 4 == 98304
    assert cost.ep_all_to_all_bytes(256, 64, 2, 4, bytes_per_element=2) == elements * 2
    assert "bytes_per_element" in cost.ep_all_to_all_bytes.__doc__


def test_ep_tp_training_matches_single_process():
    """EP × TP (dp=2, tp=2, ep=2; a dense block and an MoE block) trains like one process."""
    model = lambda: GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=16, vocab_size=32, moe_every=2,
                                  n_experts=4, top_k=2, aux_loss_coef=0.1), seed=1)
    bs = data.batches(data.synthetic_tokens(4000, 32), 3, 8, 16)
    ref = train_reference(model(), bs, sgd(0.3))
    got = expert_parallel.run(model(), bs, 4, optimizer=sgd(0.3), ep=2, tp=2)
    assert_same_training(got, ref, rtol=1e-5, atol=1e-6)
    dims = {e["name"]: e["labels"].get("dim") for e in got.trace.events(kind="comm")}
    assert dims["ep_dispatch"] == "ep" and dims["g.all_reduce"] == "tp" and dims["dense_grads"] == "dp"


def test_bf16_autocast_trains_close_to_fp32():
    """dtype="bf16": the forward under autocast (router softmax in fp32) trains close to fp32."""
    bs = data.batches(data.synthetic_tokens(4000, 32), 3, 8, 16)
    ref = train_reference(_moe_gpt(), bs, sgd(0.3))
    got = expert_parallel.run(_moe_gpt(), bs, 2, optimizer=sgd(0.3), ep=2, dtype="bf16")
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref["losses"]), rtol=0, atol=2e-2)
    assert got.losses != ref["losses"]   # it did compute in bf16
