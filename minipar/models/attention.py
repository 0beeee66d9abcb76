"""Two ways to compute attention, one interface: the materialised reference and PyTorch's fused kernels.

For queries Q (B, H, Tq, d), keys and values K, V (B, H, Tk, d) and an additive mask M (0 or -inf):

    S = Q Kᵀ / √d + M,    lse = log Σ_k exp(S_qk),    O = exp(S - lse) V     (Vaswani et al. 2017, eq. 1)

* ``"materialized"`` writes it out: S, then softmax, then ``@ V``. It holds the Tq × Tk scores of
  every head in memory and keeps them for the backward; the readable reference.
* ``"sdpa"`` runs a fused kernel (FlashAttention, Dao et al. 2022, Alg. 1-2): S is computed a tile
  at a time and never stored; the backward recomputes P = exp(S - lse) from Q, K, V, O and lse.

Which fused kernels (schemas identical on torch 2.9, the lowest supported, and 2.13;
``tests/test_attention.py`` checks them on the installed torch):

* plain causal attention (the GPT, the tensor-parallel block):
  ``torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p, is_causal=True)``; on the
  CPU it dispatches to the flash kernel below, on CUDA to flash or memory-efficient attention;
* a block whose lse is needed (ring attention's merge and written-out backward, the lse that
  all-gather and Ulysses return): on the CPU (and meta)
  ``aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)
  -> (output, logsumexp)`` and ``aten::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out,
  q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale) -> (dq, dk, dv)``; on CUDA
  ``aten::_scaled_dot_product_efficient_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p,
  is_causal, *, scale)`` and its ``_backward`` (it takes fp32 and an additive mask, which CUDA's
  flash kernel does not). The backward is given the *final* O and lse of the queries (over all
  key blocks), exactly as the written-out :func:`minipar.context_parallel.attention_block_backward`.
  The CUDA backward reads O with the row stride of the layout its forward returns, (B, T, H, d) in
  memory viewed as (B, H, T, d) (:func:`forward_layout`); an O merged by ring attention is put back
  into that layout first. The CUDA kernels have no bf16 variant below compute capability 8.0 (a
  T4): there a block is computed in fp32 and cast back (:func:`kernel_dtype`, logged once).

The default, ``"auto"``, is :func:`default_attention` of the tensors' device: ``"sdpa"`` on a GPU,
``"materialized"`` on the CPU. Measured on torch 2.13 CPU (``tests/test_attention.py``): the two
agree in fp32 to ~5e-7 (outputs, lse and every gradient, causal and not, observed), and every
strategy trains like one process with either (a representative subset is run with both). The
course's *exact* comparisons hold only for the written-out path: the activation bytes that
:mod:`minipar.cost` predicts (Korthikanti et al.'s ``5as/h`` score terms), and the matmul FLOPs
that ``FlopCounterMode`` counts (it has no formula for the CPU flash kernel, and reports 0). So the
CPU default is ``"materialized"``; pass ``attention="sdpa"`` for speed and memory. Dropout differs
between the two (different masks from the same seed): exact comparisons with dropout use one path.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

ATTENTIONS = ("sdpa", "materialized")
CPU_DEFAULT = "materialized"
MIN_CAPABILITY = {torch.bfloat16: (8, 0)}  # the CUDA kernels' dtypes that need a newer GPU
log = logging.getLogger(__name__)
_FELL_BACK: set = set()  # (dtype, capability) pairs already logged


def check_attention(attention) -> str:
    """``attention`` (``None`` is ``"auto"``), or a plain ``ValueError``."""
    attention = "auto" if attention is None else attention
    if attention not in ("auto", *ATTENTIONS):
        raise ValueError(f"attention must be one of {('auto', *ATTENTIONS)}, got {attention!r}")
    return attention


def default_attention(device) -> str:
    """``"sdpa"`` on a GPU, :data:`CPU_DEFAULT` elsewhere (the module docstring says why)."""
    return "sdpa" if torch.device(device).type == "cuda" else CPU_DEFAULT


def resolve(attention, device) -> str:
    """``"sdpa"`` or ``"materialized"``: ``attention``, with ``"auto"`` the default of ``device``."""
    attention = check_attention(attention)
    return default_attention(device) if attention == "auto" else attention


def causal_attention(q, k, v, attention="auto", dropout_p: float = 0.0):
    """``O`` of causal self-attention (query i sees keys 0..i), by autograd; (B, H, T, d) tensors.
    ``dropout_p``: dropout on the attention weights (pass 0.0 outside training)."""
    if resolve(attention, q.device) == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return F.dropout(att, dropout_p) @ v


def position_bias(q_pos, k_pos, dtype):
    """The additive causal mask by global positions: 0 where ``k_pos[j] <= q_pos[i]``, else -inf."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device).masked_fill(~allowed, float("-inf"))


def uses_cuda_kernel(t) -> bool:
    """Whether ``t``'s device runs the CUDA kernels (the tests play a GPU with meta tensors)."""
    return t.device.type == "cuda"


def compute_capability(device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def kernel_dtype(dtype, device):
    """The dtype the CUDA kernel computes a block in: ``dtype``, or fp32 where this GPU has no
    kernel for it (bf16 below sm80: "cutlassF: no kernel found to launch!"), logged once."""
    need = MIN_CAPABILITY.get(dtype)
    if need is None or compute_capability(device) >= need:
        return dtype
    if (dtype, compute_capability(device)) not in _FELL_BACK:
        _FELL_BACK.add((dtype, compute_capability(device)))
        log.warning("fused attention: no %s kernel on compute capability %d.%d (needs %d.%d); "
                    "computing those blocks in float32", dtype, *compute_capability(device), *need)
    return torch.float32


def forward_layout(t):
    """``t`` (B, H, T, d) as the CUDA kernel's forward lays O out: (B, T, H, d) in memory, row
    stride H·d, the stride its backward assumes for O (a copy only if ``t`` is laid out otherwise)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _cuda_bias(bias, q):
    """The memory-efficient kernel reads the bias with its rows aligned to 16 elements (padded, then
    sliced back, as SDPA does), broadcast over batch and heads."""
    if bias is None:
        return None
    pad = -bias.shape[-1] % 16
    aligned = F.pad(bias, (0, pad))[..., :bias.shape[-1]] if pad else bias
    return aligned.expand(*q.shape[:-2], *bias.shape[-2:])


def _pad32(lse, q):
    """CUDA's memory-efficient kernel keeps lse rows padded to a multiple of 32."""
    pad = -q.shape[-2] % 32
    return F.pad(lse, (0, pad)) if pad else lse


def _cast(dtype, *ts):
    return [None if t is None else t.to(dtype) for t in ts]


def fused_forward(q, k, v, causal: bool = False, bias=None):
    """``(O, lse)`` by the fused kernel (no autograd); ``causal``: query i sees keys 0..i (top left);
    ``bias``: an additive (Tq, Tk) mask, of q's dtype."""
    if uses_cuda_kernel(q):
        kq, kk, kv, kb = _cast(kernel_dtype(q.dtype, q.device), q, k, v, bias)
        o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            kq, kk, kv, _cuda_bias(kb, kq), True, 0.0, causal)
        return o.to(q.dtype), lse[..., :q.shape[-2]]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)


def fused_backward(do, q, k, v, o, lse, causal: bool = False, bias=None):
    """``(dQ, dK, dV)`` by the fused kernel, given the **final** ``o`` and ``lse`` of these queries."""
    if uses_cuda_kernel(q):
        dt = kernel_dtype(q.dtype, q.device)
        kdo, kq, kk, kv, ko, kb = _cast(dt, forward_layout(do), q, k, v, forward_layout(o), bias)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            kdo, kq, kk, kv, _cuda_bias(kb, kq), ko, _pad32(lse.float().contiguous(), q), seed, seed, 0.0,
            [True, True, True, False], causal)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
    do, o, lse = do.contiguous(), o.contiguous(), lse.contiguous()
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, causal, attn_mask=bias)


class FusedAttention(torch.autograd.Function):
    """``O, lse = FusedAttention.apply(q, k, v, causal, q_pos, k_pos)``: the fused kernel under
    autograd (its backward :func:`fused_backward`); ``lse`` is not differentiated. With positions,
    the mask is :func:`position_bias`, built again in backward rather than kept: the Tq × Tk bias
    would be the one score-sized tensor held between forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, q_pos, k_pos):
        bias = None if q_pos is None else position_bias(q_pos, k_pos, q.dtype)
        o, lse = fused_forward(q, k, v, causal, bias)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.pos = causal, (q_pos, k_pos)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        q_pos, k_pos = ctx.pos
        bias = None if q_pos is None else position_bias(q_pos, k_pos, q.dtype)
        return (*fused_backward(do, q, k, v, o, lse, ctx.causal, bias), None, None, None)


def fused_attention(q, k, v, causal: bool = False, q_pos=None, k_pos=None):
    """``(O, lse)`` by the fused kernel, differentiable in O; with ``q_pos``, ``k_pos``: query i sees
    key j iff ``k_pos[j] <= q_pos[i]`` (instead of ``causal``)."""
    return FusedAttention.apply(q, k, v, causal, q_pos, k_pos)
