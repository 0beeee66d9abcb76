"""Context parallelism: sharding, ring / all-gather / Ulysses attention against full attention
(output, log-sum-exp, dQ, dK, dV) at cp = 2 and 4, both layouts, causal and not; the bytes,
activation memory and attention FLOPs against minipar.cost; training against one process.

Tolerances (fp32 on CPU): attention outputs, lse and gradients within rtol 1e-5, atol 1e-5
of full attention on the whole sequence (observed ≤ 1e-6); training losses and final
parameters within rtol 1e-5, atol 1e-6 (observed ≤ 1e-8). With recomputation ("selective",
"full") the same tolerances against one process with the same recompute, directly at cp = 2
and through minipar.hybrid at 4 ranks; a block's saved activations (SavedActivations) equal
cost.cp_activation_bytes(..., recompute=mode) exactly, and the recorded bytes show that "full"
sends the attention's forward traffic again in the backward.
"""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import minipar
from minipar import comm, data, hybrid, reference, strategy
from minipar import cost
from minipar.runtime import trace
from minipar import context_parallel as cpm
from minipar.mesh import ProcessMesh
from minipar.models import GPT, GPTConfig

B, H, D, T = 2, 4, 8, 32
LAYOUTS, VARIANTS = ("contiguous", "zigzag"), ("ring", "all_gather", "ulysses")
MEM_T = (32, 64, 128)
CFG = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=4, n_embd=32)
TOL = reference.tolerance(kind="kernel")   # the ranks' device (the driver's own checks run there too)


def _inputs(T=T):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, D, generator=g).to(minipar.device()) for _ in range(4)]   # q, k, v, loss weights


def _saved_bytes(model, h):
    """Bytes of the distinct storages autograd saves in one block's forward (parameters excluded)."""
    return cpm.saved_activation_bytes(lambda: model.blocks[0](h), exclude=model.parameters())[0]


def _rank_checks():
    """Every variant × layout × mask on this rank's tokens: outputs, gradients, bytes by call,
    FLOPs and seconds of the ring's attention, and saved activation bytes of a block."""
    c, r = comm.group_size(), comm.group_rank()
    q, k, v, w = _inputs()
    out = {"attn": {}, "bytes": {}, "flops": {}, "seconds": {}, "memory": {}}
    for layout in LAYOUTS:
        for causal in (True, False):
            for variant in VARIANTS:
                ql, kl, vl = (cpm.shard_sequence(t, r, c, layout, dim=2).requires_grad_() for t in (q, k, v))
                mark = len(trace.events())
                with FlopCounterMode(display=False) as fc:
                    o, lse = cpm.context_attention(ql, kl, vl, None, causal, layout, variant)
                    fwd_flops = fc.get_total_flops()
                    mid = len(trace.events())
                    (o * cpm.shard_sequence(w, r, c, layout, dim=2)).sum().backward()
                bwd_flops = fc.get_total_flops() - fwd_flops
                evs = trace.events()
                sent = lambda es: sum(e["bytes_sent"] for e in es              # noqa: E731
                                      if e["kind"] == "comm" and e["name"] != "ulysses_lse")
                key = (layout, causal, variant)
                out["attn"][key] = [o.detach(), lse.detach(), ql.grad, kl.grad, vl.grad]
                out["bytes"][key] = (sent(evs[mark:mid]), sent(evs[mid:]))
                out["flops"][key] = (fwd_flops, bwd_flops)
                out["seconds"][key] = sum(e["end"] - e["start"] for e in evs[mark:]
                                          if e["name"] in ("attention", "attention_backward"))
    for variant in VARIANTS:
        for Tm in MEM_T:
            cfg = GPTConfig(vocab_size=32, block_size=Tm, n_layer=1, n_head=H, n_embd=32)
            m = cpm.parallelize(GPT(cfg, seed=0), None, variant, "zigzag")
            cpm.set_positions(m, cpm.sequence_positions(Tm, r, c, "zigzag"))
            h = m.embed(torch.randint(0, 32, (B, Tm // c))).detach().requires_grad_()
            out["memory"][(variant, Tm)] = _saved_bytes(m, h)
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["cp2", "cp4"])
def checks(request):
    return request.param, minipar.launch(_rank_checks, request.param, timeout=120)


def test_shard_and_unshard_round_trip_and_positions_follow_tokens():
    """Contiguous and zigzag shards put back give the sequence; each token keeps its position."""
    x = torch.arange(3 * 16).view(3, 16)
    for c in (1, 2, 4):
        for layout in LAYOUTS:
            shards = [cpm.shard_sequence(x, r, c, layout) for r in range(c)]
            assert torch.equal(cpm.unshard_sequence(shards, layout), x)
            for r, s in enumerate(shards):
                assert torch.equal(s[0], cpm.sequence_positions(16, r, c, layout))
    assert cpm.shard_sequence(x, 1, 4, "zigzag")[0].tolist() == [2, 3, 12, 13]      # chunks 1 and 6 of 8
    assert cpm.shard_sequence(x, 0, 2, "contiguous")[0].tolist() == list(range(8))


def test_uneven_blocks_are_rejected():
    """T not divisible by cp (contiguous) or 2·cp (zigzag) is a plain error; so is cp ∤ heads for Ulysses."""
    with pytest.raises(ValueError, match="2·cp"):
        cpm.shard_sequence(torch.zeros(1, 12), 0, 4, "zigzag")
    with pytest.raises(ValueError, match="divisible by 3"):
        cpm.check_sequence(16, 3, "contiguous")
    cpm.check_sequence(12, 3, "contiguous")
    with pytest.raises(ValueError, match="n_head=4 is not divisible by cp=3"):
        cpm.check_heads(4, 3)


def test_merge_of_two_halves_is_attention_on_both():
    """merge_partials of the two key halves equals attention over all keys (O and lse)."""
    q, k, v, _ = _inputs()
    o, lse = cpm.attention_block(q, k, v)
    o_a, l_a = cpm.attention_block(q, k[..., :10, :], v[..., :10, :])
    o_b, l_b = cpm.attention_block(q, k[..., 10:, :], v[..., 10:, :])
    o_m, l_m = cpm.merge_partials(o_a, l_a, o_b, l_b)
    torch.testing.assert_close(o_m, o, **TOL)
    torch.testing.assert_close(l_m, lse, **TOL)


def test_merge_is_stable_for_large_logits():
    """Scores in the thousands (queries scaled by 300: each row's lse is far above 88, where exp
    overflows in fp32): the merge of the two key halves is finite and still equals attention
    over all keys: lse within the usual tolerance, O within 2e-4 (a score near 3000 is itself
    rounded by ~2e-4 in fp32, and each block's softmax sees its own rounding: observed 7e-5); and
    merging lse 1000 with 1000 gives 1000 + log 2."""
    q, k, v, _ = _inputs()
    q = 300 * q
    o, lse = cpm.attention_block(q, k, v)
    assert lse.min() > 200
    o_a, l_a = cpm.attention_block(q, k[..., :10, :], v[..., :10, :])
    o_b, l_b = cpm.attention_block(q, k[..., 10:, :], v[..., 10:, :])
    o_m, l_m = cpm.merge_partials(o_a, l_a, o_b, l_b)
    assert torch.isfinite(o_m).all() and torch.isfinite(l_m).all()
    torch.testing.assert_close(o_m, o, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(l_m, lse, **TOL)
    ones = torch.ones(1, 4)
    o2, l2 = cpm.merge_partials(ones, torch.tensor([1000.0]), 3 * ones, torch.tensor([1000.0]))
    torch.testing.assert_close(l2, torch.tensor([1000.0 + math.log(2)]))
    torch.testing.assert_close(o2, 2 * ones)


def test_attention_variants_equal_full_attention(checks):
    """Ring, all-gather and Ulysses: O, lse, dQ, dK, dV equal full attention, both layouts, causal or not."""
    c, results = checks
    q, k, v, w = _inputs()
    worst = 0.0
    for causal in (True, False):
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = cpm.masked_attention(qf, kf, vf, causal=causal)
        (o * w).sum().backward()
        want = [o.detach(), lse.detach(), qf.grad, kf.grad, vf.grad]
        for layout in LAYOUTS:
            for variant in VARIANTS:
                for i, name in enumerate(("O", "lse", "dQ", "dK", "dV")):
                    got = cpm.unshard_sequence([res["attn"][(layout, causal, variant)][i] for res in results],
                                               layout, dim=2)
                    where = f"{variant} {layout} causal={causal} {name}"
                    torch.testing.assert_close(got, want[i], **TOL, msg=lambda m, w=where: f"{w}: {m}")
                    worst = max(worst, (got - want[i]).abs().max().item())
    assert worst < 10 * TOL["atol"]


def test_recorded_bytes_equal_the_formulas(checks):
    """Bytes each rank sent, forward and backward, equal cost.cp_comm_bytes exactly."""
    c, results = checks
    for (layout, causal, variant), (fwd, bwd) in results[0]["bytes"].items():
        want = cost.cp_comm_bytes(variant, B, T, H * D, c)
        for res in results:
            assert res["bytes"][(layout, causal, variant)] == (want["forward"], want["backward"]), \
                (variant, layout, causal)


def test_ring_flops_per_rank_match_the_prediction(checks):
    """Measured matmul FLOPs of every rank's ring attention equal cost.attention_flops_per_rank:
    causal contiguous grows with the rank (rank c-1 does c times rank 0's work), zigzag is flat."""
    c, results = checks
    for layout in LAYOUTS:
        for causal in (True, False):
            fwd = cost.attention_flops_per_rank(B, T, H, D, c, layout, causal)
            bwd = cost.attention_flops_per_rank(B, T, H, D, c, layout, causal, backward=True)
            got = [res["flops"][(layout, causal, "ring")] for res in results]
            assert got == list(zip(fwd, bwd)), (layout, causal, got)
    contiguous = [res["flops"][("contiguous", True, "ring")][0] for res in results]
    assert contiguous[-1] == c * contiguous[0]
    assert len({res["flops"][("zigzag", True, "ring")] for res in results}) == 1
    assert cost.cp_imbalance(c, "zigzag") == 1.0 < cost.cp_imbalance(c, "contiguous")


def test_activation_memory_follows_the_formula_as_T_grows(checks):
    """Saved activation bytes of one block per rank equal cost.cp_activation_bytes at every T;
    ring's grow in proportion to T/c, all-gather's and Ulysses' faster."""
    c, results = checks
    for res in results:
        for (variant, Tm), got in res["memory"].items():
            assert got == cost.cp_activation_bytes(variant, B, Tm, 32, H, c), (variant, Tm, c)
    m = results[0]["memory"]
    assert m[("ring", 128)] == 2 * m[("ring", 64)] == 4 * m[("ring", 32)]   # proportional to T/c
    assert m[("ulysses", 128)] > 2 * m[("ring", 128)]


def _train_case(world_size, **options):
    batches = data.batches(data.synthetic_tokens(4000, 32), 3, 4, 32)
    want = reference.train_reference(GPT(CFG, seed=0), batches, reference.sgd(0.1))
    got = cpm.run(GPT(CFG, seed=0), batches, world_size, optimizer=reference.sgd(0.1), **options)
    reference.assert_same_training(got, want)
    return got


@pytest.mark.parametrize("world_size, options", [
    (2, dict(variant="ring", layout="zigzag")),
    (4, dict(variant="ring", layout="contiguous")),
    (4, dict(variant="all_gather", layout="zigzag")),
    (4, dict(variant="ulysses", layout="zigzag")),
    (4, dict(variant="ring", layout="zigzag", dp=2)),
    (8, dict(variant="ring", layout="zigzag", dp=2)),
], ids=["cp2-ring-zigzag", "cp4-ring-contiguous", "cp4-all_gather", "cp4-ulysses", "dp2xcp2", "dp2xcp4"])
def test_training_matches_one_process(world_size, options):
    """The CP GPT trains like one process: losses every step and final parameters."""
    got = _train_case(world_size, **options)
    dp = options.get("dp", 1)
    cp = world_size // dp
    per_layer = cost.cp_comm_bytes(options["variant"], 4 // dp, 32, 32, cp)["total"]
    psi = sum(p.numel() for p in GPT(CFG).parameters())
    for m in got.measured:
        by_name = dict(m["bytes_by_name"])
        grads = by_name.pop("cp_grads")   # the loss record is not the step's traffic
        assert sum(by_name.values()) == CFG.n_layer * per_layer          # attention, every layer
        assert grads == cost.collective_bytes("all_reduce", 4 * psi, world_size)


def test_bad_setups_fail_before_launch():
    """Ulysses with cp ∤ heads, zigzag with 2·cp ∤ T, dp ∤ world, bad recompute: plain errors."""
    batches = data.batches(data.synthetic_tokens(4000, 32), 1, 4, 24)
    with pytest.raises(ValueError, match="n_head=4 is not divisible by cp=8"):
        cpm.check(GPT(CFG), batches, 8, variant="ulysses", layout="contiguous")
    with pytest.raises(ValueError, match="T=24"):
        cpm.check(GPT(CFG), batches, 8, variant="ring", layout="zigzag")
    with pytest.raises(ValueError, match="dp=3"):
        cpm.check(GPT(CFG), batches, 4, dp=3)
    with pytest.raises(ValueError, match="recompute must be one of"):
        cpm.check(GPT(CFG), batches, 2, recompute="sometimes")


def test_the_context_parallel_modules_are_the_gpts_with_one_seam_overridden():
    """The CP attention is the GPT's attention overriding only its core (``attend``), the positioned
    embedding the GPT's embedding overriding only ``positions``: their forward is the GPT's, not a
    copy; parallelize keeps every parameter (the same objects under the same names)."""
    from minipar.models import gpt
    pairs = {cpm.ContextParallelAttention: (gpt.CausalSelfAttention, {"attend"}),
             cpm.PositionedEmbedding: (gpt.Embedding, {"positions"})}
    for cls, (single, seam) in pairs.items():
        assert issubclass(cls, single), cls
        defined = {k for k in vars(cls) if not k.startswith("__")}
        assert defined == seam, f"{cls.__name__} defines {defined}, not only {seam}"
        assert cls.forward is single.forward
    model = GPT(CFG, seed=0)
    before = dict(model.named_parameters())
    cpm.parallelize(model, None, "ring", "zigzag")
    assert isinstance(model.embed, cpm.PositionedEmbedding)
    assert all(isinstance(b.attn, cpm.ContextParallelAttention) for b in model.blocks)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    for layers, same, heads in minipar.launch(_cp_over_tp, 2, timeout=60):   # CP × TP
        assert layers == ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding")
        assert same and heads == CFG.n_head // 2


def _cp_over_tp():
    """The tensor-parallel GPT made context-parallel: its attention keeps the column- and
    row-parallel projections and this rank's heads, every parameter object kept."""
    from minipar import tensor_parallel
    model = tensor_parallel.TensorParallelGPT(CFG)
    before = dict(model.named_parameters())
    cpm.parallelize(model, None, "ring", "zigzag")
    attn, after = model.blocks[0].attn, dict(model.named_parameters())
    same = after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    layers = tuple(type(m).__name__ for m in (attn.qkv, attn.proj, model.embed.wte))
    return layers, same and isinstance(attn, cpm.ContextParallelAttention), attn.n_head


def test_mesh_has_cp_between_tp_and_dp():
    """rank = p·(dp·cp·tp) + d·(cp·tp) + c·tp + t; cp groups and dp_cp groups tile the grid."""
    mesh = ProcessMesh(dp=2, pp=2, tp=2, cp=2, world_size=16)
    for r in range(16):
        c = mesh.coordinates(r)
        assert ((c["pp"] * 2 + c["dp"]) * 2 + c["cp"]) * 2 + c["tp"] == r
        assert mesh.rank_of(c) == r
    assert mesh.members(5, "cp") == [5, 7] and mesh.members(5, "tp") == [4, 5]
    assert mesh.members(5, "dp") == [1, 5] and mesh.members(5, "pp") == [5, 13]
    assert mesh.members(5, "dp_cp") == [1, 3, 5, 7]
    assert sorted(r for g in mesh.all_groups("cp") for r in g) == list(range(16))
    assert ProcessMesh(dp=2, pp=1, tp=2).coordinates(3) == {"pp": 0, "dp": 1, "tp": 1, "cp": 0}
    with pytest.raises(ValueError, match="world_size is 8"):
        ProcessMesh(dp=2, cp=2, tp=1, world_size=8)


@pytest.mark.parametrize("options", [
    dict(dp=2, cp=2), dict(cp=2, tp=2), dict(dp=2, cp=2, tp=2),
    dict(cp=2, tp=2, pp=2, microbatches=2), dict(dp=2, cp=2, tp=2, variant="ulysses", layout="contiguous"),
], ids=["dp2xcp2", "cp2xtp2", "dp2xcp2xtp2", "cp2xpp2xtp2", "dp2xcp2xtp2-ulysses"])
def test_cp_on_the_hybrid_mesh_matches_one_process(options):
    """dp × cp, cp × tp (4 ranks) and dp × cp × tp, cp × pp × tp (8 ranks) through minipar.hybrid
    train like one process; cp traffic is labelled "cp" and equals the formula."""
    batches = data.batches(data.synthetic_tokens(4000, 32), 3, 4, 32)
    want = reference.train_reference(GPT(CFG, seed=0), batches, reference.sgd(0.1))
    got = hybrid.run(GPT(CFG, seed=0), batches, math.prod(options.get(d, 1) for d in ("dp", "pp", "tp", "cp")), optimizer=reference.sgd(0.1),
                     **options)
    reference.assert_same_training(got, want)
    dp, cp, tp = options.get("dp", 1), options["cp"], options.get("tp", 1)
    per_layer = cost.cp_comm_bytes(options.get("variant", "ring"), 4 // dp, 32, 32 // tp, cp)["total"]
    layers = CFG.n_layer // options.get("pp", 1)
    for m in got.measured:
        assert m["coords"]["cp"] in range(cp)
        assert m["bytes_by_dim"]["cp"] == layers * per_layer


def test_hybrid_checks_cp_before_launch():
    """On the mesh: 2·cp ∤ T for zigzag and cp ∤ heads per tp rank for Ulysses are plain errors."""
    batches = data.batches(data.synthetic_tokens(4000, 32), 1, 4, 24)
    with pytest.raises(ValueError, match="T=24"):
        hybrid.check(GPT(CFG), batches, 8, dp=1, cp=8, layout="zigzag")
    with pytest.raises(ValueError, match="2 per tp rank"):
        hybrid.check(GPT(CFG), batches, 8, cp=4, tp=2, variant="ulysses", layout="contiguous")
    with pytest.raises(ValueError, match="world_size is 4"):
        hybrid.check(GPT(CFG), batches, 4, dp=2, cp=4, layout="contiguous")


# ------------------------------------------------------------------ activation recomputation
RC_CASES = (("ring", "zigzag"), ("all_gather", "contiguous"), ("ulysses", "zigzag"))
RC_MODES = ("none", "selective", "full")


def _recompute_checks(batches):
    """At cp = 2, one launch: train the CP GPT under "selective" and "full" for every variant
    (ring/zigzag, all-gather/contiguous, Ulysses/zigzag), and measure one block's saved
    activations (SavedActivations) under every mode at T = 32 and 64."""
    from minipar.activations import SavedActivations
    c, r = comm.group_size(), comm.group_rank()
    out = {"train": {}, "memory": {}}
    for variant, layout in RC_CASES:
        for mode in ("selective", "full"):
            out["train"][(variant, mode)] = strategy.on_device(cpm.train, GPT(CFG, seed=0), batches,
                                                               optimizer=reference.sgd(0.1), variant=variant,
                                                               layout=layout, recompute=mode)
        for mode in RC_MODES:
            for Tm in (32, 64):
                cfg = GPTConfig(vocab_size=32, block_size=Tm, n_layer=1, n_head=H, n_embd=32)
                m = cpm.parallelize(GPT(cfg, seed=0).set_recompute(mode), None, variant, layout)
                cpm.set_positions(m, cpm.sequence_positions(Tm, r, c, layout))
                h = m.embed(torch.randint(0, 32, (B, Tm // c))).detach().requires_grad_()
                with SavedActivations(m) as saved:
                    m.blocks[0](h)
                out["memory"][(variant, mode, Tm)] = saved.bytes
    return out


def test_recompute_trains_like_one_process_and_keeps_what_the_formula_says():
    """Selective and full recomputation at cp = 2 (three variants): losses and parameters of one
    process with the same recompute, the communication rerun under full, memory = formula."""
    batches = data.batches(data.synthetic_tokens(4000, 32), 3, 4, 32)
    results = minipar.launch(_recompute_checks, 2, args=(batches,), timeout=120)
    for mode in ("selective", "full"):
        one = GPT(CFG, seed=0).set_recompute(mode)
        want = reference.train_reference(one, batches, reference.sgd(0.1))
        for variant, _ in RC_CASES:
            got = strategy.TrainResult.merge([res["train"][(variant, mode)] for res in results])
            reference.assert_same_training(got, want)
            bytes_ = cost.cp_comm_bytes(variant, 4, 32, 32, 2)   # full: the forward's traffic twice
            attn = bytes_["total"] + (bytes_["forward"] if mode == "full" else 0)
            for res in results:
                by_name = dict(res["train"][(variant, mode)]["measured"]["bytes_by_name"])
                by_name.pop("cp_grads")
                assert sum(by_name.values()) == CFG.n_layer * attn, (variant, mode)
    for res in results:
        for (variant, mode, Tm), got in res["memory"].items():
            want = cost.cp_activation_bytes(variant, B, Tm, 32, H, 2, recompute=mode)
            assert got == want, (variant, mode, Tm)
            assert got < res["memory"][(variant, "none", Tm)] or mode == "none" or \
                (variant, mode) == ("ring", "selective")
        for Tm in (32, 64):   # full keeps the block's input: 2sbh at 4 bytes, s = T/c
            assert res["memory"][("ring", "full", Tm)] == cost.recompute_activation_bytes(
                Tm // 2, B, 32, H, recompute="full", bytes_per_element=4)
            # ring attention already keeps no scores: selective saves nothing more there
            assert res["memory"][("ring", "selective", Tm)] == res["memory"][("ring", "none", Tm)]


@pytest.mark.parametrize("options", [dict(dp=2, cp=2, recompute="full"),
                                     dict(cp=2, tp=2, recompute="selective", variant="ulysses")],
                         ids=["dp2xcp2-full", "cp2xtp2-ulysses-selective"])
def test_recompute_on_the_hybrid_mesh_matches_one_process(options):
    """Recomputation through hybrid.run with cp = 2 at 4 ranks trains like one process (same recompute)."""
    batches = data.batches(data.synthetic_tokens(4000, 32), 3, 4, 32)
    want = reference.train_reference(GPT(CFG, seed=0).set_recompute(options["recompute"]), batches,
                                     reference.sgd(0.1))
    got = hybrid.run(GPT(CFG, seed=0), batches, math.prod(options.get(d, 1) for d in ("dp", "pp", "tp", "cp")), optimizer=reference.sgd(0.1),
                     **options)
    reference.assert_same_training(got, want)
    dp, tp = options.get("dp", 1), options.get("tp", 1)
    b = cost.cp_comm_bytes(options.get("variant", "ring"), 4 // dp, 32, 32 // tp, 2)
    per_layer = b["total"] + (b["forward"] if options["recompute"] == "full" else 0)
    for m in got.measured:
        assert m["bytes_by_dim"]["cp"] == CFG.n_layer * per_layer
