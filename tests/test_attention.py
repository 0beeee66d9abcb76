"""Fused attention (PyTorch's kernels) against the written-out reference, and every strategy on it.

Tolerances (fp32 on CPU): the fused and materialised paths agree within rtol 1e-5, atol 1e-6 on
outputs, lse and every gradient (dQ, dK, dV; a GPT's loss and parameter gradients), causal and
not, with a positions' mask, and block by block as ring attention uses them (observed ≤ 1e-6):
the two sum in different orders, so not bit for bit. Strategies run with ``attention="sdpa"``
against one process with ``attention="sdpa"``, within each strategy's own test tolerance
(rtol 1e-5, atol 1e-6).
"""
import logging

import pytest
import torch

import minipar
from minipar import context_parallel as cpm
from minipar import data, data_parallel, expert_parallel, hybrid, pipeline, reference
from minipar import tensor_parallel as tp
from minipar.models import GPT, GPTConfig
from minipar.models import attention as attn
from minipar.zero import run as zero_run

TOL = reference.tolerance(kind="kernel")  # tensors on minipar.device(): the GPU under `course.py test --gpu`
CFG = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=4, n_embd=32, attention="sdpa")


def _qkv(B=2, H=3, Tq=24, Tk=24, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, d, generator=g).to(minipar.device(), dtype) for T in (Tq, Tk, Tk, Tq))


def _grads(fn, q, k, v, w):
    """``(O, lse, dQ, dK, dV)`` of ``fn(q, k, v) -> (O, lse)``, backward from ``(O · w).sum()``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v)
    (o * w).sum().backward()
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def _close(got, want, what):
    for name, a, b in zip(("O", "lse", "dQ", "dK", "dV"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} {name}: {m}")


def test_the_fused_kernels_have_the_signatures_minipar_calls():
    """The aten kernels minipar calls exist on this torch with the arguments it passes."""
    ops = torch.ops.aten
    for op, args in [(ops._scaled_dot_product_flash_attention_for_cpu,
                      ("dropout_p", "is_causal", "attn_mask")),
                     (ops._scaled_dot_product_flash_attention_for_cpu_backward,
                      ("grad_out", "out", "logsumexp", "is_causal", "attn_mask")),
                     (ops._scaled_dot_product_efficient_attention,
                      ("attn_bias", "compute_log_sumexp", "is_causal")),
                     (ops._scaled_dot_product_efficient_attention_backward,
                      ("grad_out_", "logsumexp", "philox_seed", "grad_input_mask", "is_causal"))]:
        names = [a.name for a in op.default._schema.arguments]
        assert all(a in names for a in args), (op, names)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_equals_materialized_outputs_lse_and_gradients(causal):
    """masked_attention fused and written out: O, lse, dQ, dK, dV within fp32 rounding."""
    q, k, v, w = _qkv()
    want = _grads(lambda *t: cpm.masked_attention(*t, causal=causal), q, k, v, w)
    got = _grads(lambda *t: cpm.masked_attention(*t, causal=causal, attention="sdpa"), q, k, v, w)
    _close(got, want, f"causal={causal}")


def test_fused_with_a_positions_mask_equals_materialized():
    """Queries and keys at shuffled global positions (all-gather's mask, zigzag): the fused
    kernel with the mask as an additive bias equals the written-out masked attention."""
    q, k, v, w = _qkv(Tq=12, Tk=24)
    k_pos = torch.randperm(24, generator=torch.Generator().manual_seed(1)).to(minipar.device())
    q_pos = k_pos[6:18]
    ref = _grads(lambda *t: cpm.masked_attention(*t, q_pos, k_pos, True), q, k, v, w)
    got = _grads(lambda *t: cpm.masked_attention(*t, q_pos, k_pos, True, "sdpa"), q, k, v, w)
    _close(got, ref, "positions mask")


def test_ulysses_head_attention_in_sequence_order_equals_the_masked_one():
    """Ulysses' fused path sorts the tokens into sequence order for the plain causal kernel: the
    same O, lse and gradients as the materialised attention masked by the zigzag positions."""
    from minipar.context_parallel.ulysses import head_attention
    q, k, v, w = _qkv(Tq=32, Tk=32)
    pos = torch.cat([cpm.sequence_positions(32, r, 2, "zigzag") for r in range(2)]).to(minipar.device())
    ref = _grads(lambda *t: head_attention(*t, pos, True, "materialized"), q, k, v, w)
    got = _grads(lambda *t: head_attention(*t, pos, True, "sdpa"), q, k, v, w)
    _close(got, ref, "ulysses order")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_blocks_merge_and_backward_like_the_written_out_ones(causal):
    """Ring attention's use of a block: two key blocks' (O, lse) merged, then each block's backward
    from the final O and lse; fused and written-out blocks agree, and their sum is full attention's."""
    q, k, v, w = _qkv(Tq=16, Tk=16)
    o_full, lse_full, *grads = _grads(lambda *t: cpm.masked_attention(*t, causal=causal), q, k, v, w)
    for a in ("materialized", "sdpa"):
        # keys 0..7 are all before queries 8..15, so with the causal mask block a is "full" for
        # the back half of the queries and "causal" for the front: use the diagonal halves here
        blocks = [(slice(0, 8), slice(0, 8), causal), (slice(8, 16), slice(8, 16), causal),
                  (slice(8, 16), slice(0, 8), False)] if causal else \
                 [(slice(None), slice(0, 8), False), (slice(None), slice(8, 16), False)]
        o, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), device=minipar.device())
        for rows, cols, c in blocks:
            o_b, lse_b = cpm.attention_block(q[..., rows, :], k[..., cols, :], v[..., cols, :], c, a)
            o[..., rows, :], lse[..., rows] = cpm.merge_partials(o[..., rows, :], lse[..., rows], o_b, lse_b)
        _close((o, lse), (o_full, lse_full), f"{a} forward")
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, cols, c in blocks:
            g = cpm.attention_block_backward(q[..., rows, :], k[..., cols, :], v[..., cols, :],
                                             o[..., rows, :], lse[..., rows], w[..., rows, :], c, attention=a)
            dq[..., rows, :] += g[0]
            dk[..., cols, :] += g[1]
            dv[..., cols, :] += g[2]
        _close((o, lse, dq, dk, dv), (o_full, lse_full, *grads), f"{a} backward")


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_gpt_fused_equals_materialized_loss_and_every_gradient(recompute):
    """A GPT with attention="sdpa" and one with "materialized": the same loss and parameter
    gradients within fp32 rounding, under every recomputation mode; "auto" is the device's default."""
    x = torch.randint(0, 32, (4, 32), generator=torch.Generator().manual_seed(0)).to(minipar.device())
    out = {}
    for a in ("sdpa", "materialized", "auto"):
        m = GPT(GPTConfig(**{**CFG.__dict__, "attention": a, "recompute": recompute}), seed=0).to(minipar.device())
        loss = m(x, x)
        loss.backward()
        out[a] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(out["sdpa"][0], out["materialized"][0], **TOL)
    for n, g in out["materialized"][1].items():
        torch.testing.assert_close(out["sdpa"][1][n], g, **TOL, msg=lambda m: f"{n}: {m}")
    default = attn.default_attention(minipar.device())
    assert torch.equal(out["auto"][0], out[default][0])
    # placement-free: the defaults of named devices, whatever this one is
    assert attn.default_attention("cuda") == "sdpa" and attn.resolve("auto", "cpu") == attn.CPU_DEFAULT
    with pytest.raises(ValueError, match="attention must be one of"):
        GPT(GPTConfig(attention="flash"))


def test_fused_attention_keeps_no_score_sized_tensor():
    """The fused path saves no T × T tensor for the backward; the written-out one does."""
    from minipar.activations import SavedActivations
    x = torch.randint(0, 32, (2, 16))    # T = 16: the scores would be (B, heads, 16, 16)
    shapes = {}
    for a in ("sdpa", "materialized"):
        m = GPT(GPTConfig(**{**CFG.__dict__, "attention": a}), seed=0)
        with SavedActivations(m) as saved:
            m(x, x)
        shapes[a] = [s for s, _, _ in saved.tensors if s == (2, 4, 16, 16)]
    assert shapes["materialized"] and not shapes["sdpa"], shapes


def _batches():
    return data.batches(data.synthetic_tokens(4000, 32), 2, 4, 32)


MOE = dict(moe_every=1, n_experts=4, top_k=2)
STRATEGIES = {
    "dp": (data_parallel.run, 2, {}, {}),
    "pipeline 1f1b": (pipeline.run, 2, dict(schedule="1f1b", microbatches=2), {}),
    "tp sequence-parallel": (tp.run, 2, dict(sequence_parallel=True), {}),
    "zero-3": (zero_run, 2, dict(stage=3), {}),
    "cp ring": (cpm.run, 2, dict(variant="ring", layout="zigzag"), {}),
    "cp all_gather": (cpm.run, 2, dict(variant="all_gather", layout="zigzag"), {}),
    "cp ulysses": (cpm.run, 2, dict(variant="ulysses", layout="zigzag"), {}),
    "ep 2": (expert_parallel.run, 2, dict(ep=2), MOE),
    "hybrid dp2 x tp2 (selective)": (hybrid.run, 4, dict(dp=2, tp=2, recompute="selective"), {}),
    "hybrid tp2 x cp2 ring": (hybrid.run, 4, dict(tp=2, cp=2), {}),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_trains_like_one_process_on_fused_attention(name):
    """Each strategy with attention="sdpa" against one process with attention="sdpa"."""
    run, world, options, extra = STRATEGIES[name]
    cfg = GPTConfig(**{**CFG.__dict__, **extra})
    batches = _batches()
    got = run(GPT(cfg, seed=0), batches, world, optimizer=reference.sgd(0.1), **options)
    model = GPT(cfg, seed=0)
    if options.get("recompute"):
        model.set_recompute(options["recompute"])
    want = reference.train_reference(model, batches, reference.sgd(0.1))
    reference.assert_same_training(got, want)   # the table's "sgd" on the devices they ran on


def test_selective_recomputation_on_fused_attention_is_the_kernels_own():
    """Fused, the scores are never kept, so "selective" adds no checkpoint: the same saved bytes as
    "none", fewer than written out; written out, "selective" drops the score-sized tensors."""
    from minipar.activations import SavedActivations
    x = torch.randint(0, 32, (2, 32))
    saved = {}
    for a in ("sdpa", "materialized"):
        for mode in ("none", "selective"):
            m = GPT(GPTConfig(**{**CFG.__dict__, "attention": a}), seed=0).set_recompute(mode)
            with SavedActivations(m) as s:
                m(x, x)
            saved[a, mode] = s.bytes
    assert saved["sdpa", "selective"] == saved["sdpa", "none"] < saved["materialized", "none"]
    assert saved["materialized", "selective"] < saved["materialized", "none"]


HALF_TOL = {t: reference.tolerance(None, t, "kernel") for t in (torch.float16, torch.bfloat16)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask", ["causal", "positions"])
def test_fused_in_half_precision_equals_the_fp32_written_out_one(dtype, mask):
    """Fused in fp16/bf16 (the path bf16 CP takes: each block's O, lse and backward from the final
    O) against the written-out attention in fp32 on the same rounded inputs, within the half
    type's rounding. On a GPU this runs the CUDA kernels (and, below sm80, bf16's fp32 fallback)."""
    q, k, v, w = _qkv(Tq=40, Tk=40, dtype=dtype)
    pos = (torch.randperm(40, generator=torch.Generator().manual_seed(2)).to(minipar.device()),) * 2 \
        if mask == "positions" else (None, None)
    ref = _grads(lambda *t: cpm.masked_attention(*t, *pos, True), *(t.float() for t in (q, k, v, w)))
    got = _grads(lambda *t: cpm.masked_attention(*t, *pos, True, "sdpa"), q, k, v, w)
    assert got[0].dtype == dtype and got[2].dtype == dtype
    for name, a, b in zip(("O", "lse", "dQ", "dK", "dV"), got, ref):
        torch.testing.assert_close(a.float(), b, **HALF_TOL[dtype], msg=lambda m: f"{mask} {name}: {m}")


class CudaKernels:
    """The two CUDA kernels replaced by recorders on meta tensors: what the CUDA branch passes
    (dtypes, O's strides, is_causal), answered with tensors laid out as the kernels lay them out."""

    def __init__(self, monkeypatch, capability=(9, 0)):
        import torch._dynamo  # noqa: F401  (imported lazily by masked_fill; it reads the real kernels)
        self.calls = []
        monkeypatch.setattr(attn, "uses_cuda_kernel", lambda t: True)
        monkeypatch.setattr(attn, "compute_capability", lambda device: capability)
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", self.forward)
        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", self.backward)

    def forward(self, q, k, v, bias, compute_lse, dropout_p, is_causal):
        self.calls.append(dict(op="forward", dtype=q.dtype, causal=is_causal, bias=bias))
        B, H, T, d = q.shape
        o = torch.empty(B, T, H, d, dtype=q.dtype, device="meta").transpose(1, 2)  # (B, T, H, d) in memory
        lse = torch.empty(B, H, T + (-T % 32), device="meta")
        return o, lse, None, None

    def backward(self, do, q, k, v, bias, o, lse, seed, offset, dropout_p, mask, is_causal):
        self.calls.append(dict(op="backward", dtype=q.dtype, o_dtype=o.dtype, causal=is_causal,
                               o_rows=o.stride(2), do_rows=do.stride(2), row=q.shape[1] * q.shape[3]))
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _meta_qkv(dtype, B=2, H=4, T=24, d=8):
    return [torch.empty(B, H, T, d, dtype=dtype, device="meta", requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_the_cuda_backward_gets_o_in_the_forwards_layout_and_the_causal_flag(monkeypatch, dtype):
    """On sm90 the kernels get the tensors' own dtype, is_causal as asked (forward and backward),
    and O (and dO) with the forward's row stride H·d, both for the O the forward returned and for
    an O merged by ring attention in plain (B, H, T, d) layout (a reading past the buffer else)."""
    kernels = CudaKernels(monkeypatch)
    q, k, v = _meta_qkv(dtype)
    for causal in (True, False):
        o, _ = attn.fused_attention(q, k, v, causal)
        o.sum().backward()
    merged = torch.empty(2, 4, 24, 8, dtype=dtype, device="meta")  # contiguous (B, H, T, d)
    attn.fused_backward(merged, q, k, v, merged, torch.empty(2, 4, 24, device="meta"), True)
    fwd = [c for c in kernels.calls if c["op"] == "forward"]
    bwd = [c for c in kernels.calls if c["op"] == "backward"]
    assert [c["causal"] for c in fwd] == [True, False] and [c["causal"] for c in bwd] == [True, False, True]
    assert all(c["dtype"] == dtype for c in kernels.calls)
    assert all(c["o_rows"] == c["do_rows"] == c["row"] == 32 for c in bwd), bwd


def test_bf16_below_sm80_computes_the_block_in_fp32_and_says_so_once(monkeypatch, caplog):
    """On sm75 (a T4) the kernels have no bf16 variant: they get fp32 tensors (bias too), the
    outputs and gradients come back in bf16, and the fallback is logged once; fp16 is kept."""
    kernels = CudaKernels(monkeypatch, capability=(7, 5))
    monkeypatch.setattr(attn, "_FELL_BACK", set())
    q, k, v = _meta_qkv(torch.bfloat16)
    pos = torch.arange(24, device="meta")
    with caplog.at_level(logging.WARNING, logger=attn.__name__):
        for _ in range(2):
            o, lse = attn.fused_attention(q, k, v, False, pos, pos)
            o.sum().backward()
    assert o.dtype == q.grad.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert all(c["dtype"] == torch.float32 for c in kernels.calls) and len(kernels.calls) == 4
    assert kernels.calls[0]["bias"].dtype == torch.float32
    assert [r.getMessage() for r in caplog.records if "compute capability 7.5" in r.getMessage()] == [
        "fused attention: no torch.bfloat16 kernel on compute capability 7.5 (needs 8.0); "
        "computing those blocks in float32"]
    kernels.calls.clear()
    q, k, v = _meta_qkv(torch.float16)
    attn.fused_attention(q, k, v, True)[0].sum().backward()
    assert [c["dtype"] for c in kernels.calls] == [torch.float16] * 2
