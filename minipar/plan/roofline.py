"""Compute time from a roofline: every operation of a layer, each at the rate its shape allows.

The roofline (Williams, Waterman and Patterson 2009, "Roofline: an insightful visual
performance model", CACM 52(4); Austin et al. 2025, *How to Scale Your Model*, ch. 1): an
operation doing F FLOPs on B bytes of memory traffic has arithmetic intensity ``I = F/B``
and can run at most at ``min(peak, I · HBM bandwidth)``. The two meet at the ridge
``I* = peak / bandwidth`` (A100 153, H100 295 FLOP/byte in bf16).

* **GEMMs** (m × k by k × n: ``2mnk`` FLOPs, ``e(mk + kn + mn)`` bytes, ``I = 2/(e(1/m + 1/n + 1/k))``,
  set by the smallest dimension) run at ``min(peak, I·bw) · f(I)``, with the achievable
  fraction a saturating function of the intensity in units of the ridge, ``x = I/I*``:

      f(x) = f_max · x / (x + x_½)

  times the **wave efficiency** of its output tiles: cuBLAS computes C in tiles (here
  :data:`TILE` = 128 × 128) spread over the chip's SMs in waves, and a last wave that is only
  partly full wastes the rest, ``tiles / (⌈tiles/SMs⌉ · SMs)`` (NVIDIA, "Matrix Multiplication
  Background User's Guide", sections "Tile quantization" and "Wave quantization"). Small or
  skinny GEMMs (a tensor-parallel shard's k = h/t, a context-parallel micro-batch of few
  tokens) fall away from peak through both terms. The two numbers ``f_max``, ``x_½`` are
  fitted on Narayanan et al.'s Table 1 (:data:`TABLE1_FIT`, :func:`minipar.plan.calibrate.fit_roofline`);
  in units of the ridge they carry over to other chips. Table 1's GEMMs all lie five ridges
  or more above the ridge, where the curve is flat: the fit finds ``x_½ = 0`` (it identifies
  ``f_max`` only), and on these GPUs the shape enters through the roofline's ``I·bw`` and the
  waves. A CPU's ``x_½`` is measured (:func:`minipar.plan.calibrate.measure_machine`).
* **Memory-bound operations** (layer norms, activations, softmax, dropout, residual adds,
  the loss, the optimizer step) move their bytes at the HBM bandwidth.
* **Attention** (:data:`ATTENTION`): ``"flash"`` (Dao et al. 2022, FlashAttention; every
  current training run, and ``scaled_dot_product_attention`` on a GPU) is one fused kernel
  whose memory traffic is Q, K, V, O and the per-row log-sum-exp (the tiles of K and V stay
  in on-chip memory and L2): compute-bound, at ``f_max``; its backward recomputes the scores
  from Q, K and the log-sum-exp: five s²-sized matmuls instead of the forward's two, 2.5×
  the forward's FLOPs. ``"materialized"`` (Megatron-LM 2021, Korthikanti et al.'s count):
  ``QKᵀ`` and ``P·V`` as batched GEMMs per head (k = s or d = h/a: skinny), the a·s² scores
  written, soft-maxed (one fused kernel: read, write) and dropped out (read, write, 1-byte
  mask) in HBM.
* **Backward.** Each GEMM ``(m, n, k)`` becomes its two gradients, ``(m, k, n)`` for the
  input and ``(k, n, m)`` for the weight; a memory-bound operation moves twice its bytes
  (read the saved input and the incoming gradient, write the gradient).

FLOPs are *counted* as Narayanan et al. count them (:func:`minipar.plan.step_flops`: what
TFLOP/s and MFU report); the *time* is this module's. The course's own GPT differs: on a CPU
``GPTConfig(attention="materialized")`` builds the s² scores as below, and
``GPTConfig(attention="sdpa")`` calls ``scaled_dot_product_attention``, whose CPU kernels may
still materialise them; the planner's ``"auto"`` picks ``"materialized"`` for a CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

ATTENTION = ("flash", "materialized")
TILE = (128, 128)        # output tile of a GEMM (rows, columns) for the wave count
FLASH_BWD = 2.5          # flash backward / forward FLOPs (5 matmuls of QKᵀ's size against 2)
ADAM_BYTES = 28          # per element: read grad 2, master 4, m 4, v 4; write master, m, v, 16-bit param


@dataclass(frozen=True)
class Efficiency:
    """``f(x) = f_max · x/(x + x_half)`` of a GEMM at intensity ``x`` ridges (module docstring);
    ``x_half = 0``: the same fraction ``f_max`` for every shape."""
    f_max: float
    x_half: float = 0.0

    def fraction(self, intensity: float, ridge: float) -> float:
        x = intensity / ridge
        return self.f_max * x / (x + self.x_half)


# fitted on Table 1 rows 1, 5 and 10 (1.7B, 39.1B, 1T) by minipar.plan.calibrate.fit_roofline;
# tests/test_plan.py refits and checks these numbers
TABLE1_FIT = Efficiency(0.694, 0.0)


@dataclass(frozen=True)
class Op:
    """One operation, ``count`` times: FLOPs and HBM bytes of one occurrence; a GEMM's (m, n, k)."""
    name: str
    kind: str                       # "gemm", "attention" (flash's fused kernel) or "memory"
    flops: float
    bytes: float
    count: float = 1.0
    shape: tuple | None = None

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def gemm(name: str, m: float, n: float, k: float, e: int, count: float = 1.0) -> Op:
    return Op(name, "gemm", 2 * m * n * k, e * (m * k + k * n + m * n), count, (m, n, k))


def memory(name: str, nbytes: float, count: float = 1.0) -> Op:
    return Op(name, "memory", 0.0, nbytes, count)


def as_efficiency(efficiency, accelerator=None) -> Efficiency:
    """``None``: the accelerator's own (measured) or :data:`TABLE1_FIT`; a float: one fraction."""
    if efficiency is None:
        efficiency = getattr(accelerator, "efficiency", None) or TABLE1_FIT
    return efficiency if isinstance(efficiency, Efficiency) else Efficiency(float(efficiency))


def waves(op: Op, sms: int) -> float:
    """Wave efficiency of a GEMM's output tiles on ``sms`` SMs (1 without a count, or for a non-GEMM)."""
    if not sms or op.kind != "gemm":
        return 1.0
    m, n, _ = op.shape
    tiles = math.ceil(m / TILE[0]) * math.ceil(n / TILE[1]) * max(1, round(op.count))
    return tiles / (math.ceil(tiles / sms) * sms)


def rate(op: Op, accelerator, efficiency) -> float:
    """FLOP/s (bytes/s for a memory-bound op) the roofline allows ``op``."""
    bw = accelerator.hbm_bw
    if op.kind == "memory":
        return bw
    eff = as_efficiency(efficiency, accelerator)
    ridge = accelerator.peak_flops / bw
    return (min(accelerator.peak_flops, op.intensity * bw) * eff.fraction(op.intensity, ridge)
            * waves(op, accelerator.sms))


def op_time(op: Op, accelerator, efficiency=None) -> float:
    work = op.bytes if op.kind == "memory" else op.flops
    return op.count * work / rate(op, accelerator, efficiency)


def backward(ops: list[Op]) -> list[Op]:
    """The backward of forward ops (module docstring)."""
    out = []
    for op in ops:
        if op.kind == "gemm":
            m, n, k = op.shape
            e = op.bytes / (m * k + k * n + m * n)
            out += [gemm(op.name + " dX", m, k, n, e, op.count), gemm(op.name + " dW", k, n, m, e, op.count)]
        elif op.kind == "attention":
            out.append(Op(op.name + " backward", "attention", FLASH_BWD * op.flops, FLASH_BWD * op.bytes, op.count))
        else:
            out.append(memory(op.name + " backward", 2 * op.bytes, op.count))
    return out


def attention_ops(model, layout, seq_len: int, attention: str) -> list[Op]:
    """The attention core of one layer, one micro-batch, one GPU (its s/cp queries against all s keys)."""
    L, e = layout, layout.bytes_per_element
    sq, s, b, t = seq_len // L.cp, seq_len, L.micro_batch, L.tp
    heads, d = model.n_head / t, model.hidden // model.n_head
    if attention == "flash":
        flops = 4 * b * sq * s * model.hidden / t          # as counted: QKᵀ and P·V, 2·2·s·h per query
        nbytes = e * b * (2 * sq * model.hidden + 2 * s * model.kv_dim) / t + 4 * b * heads * sq
        return [Op("flash attention", "attention", flops, nbytes)]
    scores, drop = b * heads * sq * s, model.dropout
    ops = [gemm("QKᵀ", sq, s, d, e, b * heads), memory("softmax", 2 * e * scores)]
    if drop:
        ops.append(memory("attention dropout", (2 * e + 1) * scores))
    return ops + [gemm("P·V", sq, d, s, e, b * heads)]


def layer_ops(model, layout, seq_len: int, attention: str = "flash") -> list[Op]:
    """Every forward operation of one transformer layer on one GPU for one micro-batch."""
    L, e, h, t = layout, layout.bytes_per_element, model.hidden, layout.tp
    T = L.micro_batch * seq_len // L.cp                        # tokens of this GPU's micro-batch
    rep = t if L.sp else 1                                     # sequence parallelism splits the rest
    act, ffn = T * h / rep, model.ffn_width
    drop = [memory("dropout", (2 * e + 1) * act)] if model.dropout else []
    ops = [memory("layer norm 1", 2 * e * act), gemm("QKV", T, (h + 2 * model.kv_dim) / t, h, e)]
    ops += attention_ops(model, L, seq_len, attention)
    ops += [gemm("attention out", T, h, h / t, e), *drop, memory("residual add", 3 * e * act),
            memory("layer norm 2", 2 * e * act)]
    n_local = max(1, model.n_experts // L.ep)                  # experts on this GPU
    m = T * model.top_k * L.ep / model.n_experts if model.n_experts > 1 else T
    up = ffn * (2 if model.gated else 1) / t
    ops += [gemm("MLP up", m, up, h, e, n_local),
            memory("SwiGLU" if model.gated else "GeLU", (3 if model.gated else 2) * e * m * n_local * ffn / t),
            gemm("MLP down", m, h, ffn / t, e, n_local), *drop, memory("residual add", 3 * e * act)]
    return ops


def embedding_ops(model, layout, seq_len: int) -> list[Op]:
    """The embedding lookup of one micro-batch (on the first pipeline stage)."""
    e, T = layout.bytes_per_element, layout.micro_batch * seq_len // layout.cp
    return [memory("embedding", 2 * e * T * model.hidden)]


def head_ops(model, layout, seq_len: int) -> list[Op]:
    """Final norm, the vocabulary GEMM and the loss of one micro-batch (fp32 logits; on the last stage)."""
    L, e, h = layout, layout.bytes_per_element, model.hidden
    T = L.micro_batch * seq_len // L.cp
    V = model.vocab / L.tp
    return [memory("final norm", 2 * e * T * h), gemm("head", T, V, h, e), memory("cross-entropy", (e + 4) * T * V)]


def optimizer_op(elements: float) -> Op:
    """AdamW on the elements this GPU updates: :data:`ADAM_BYTES` per element, memory-bound."""
    return memory("optimizer step", ADAM_BYTES * elements)


def ops_time(ops: list[Op], accelerator, efficiency=None) -> float:
    return sum(op_time(op, accelerator, efficiency) for op in ops)


def bottleneck(ops: list[Op], accelerator, efficiency=None) -> dict[str, float]:
    """Seconds of ``ops`` by what bounds them: ``{"compute", "memory"}`` (a GEMM below the ridge
    counts as memory-bound)."""
    ridge = accelerator.peak_flops / accelerator.hbm_bw
    out = {"compute": 0.0, "memory": 0.0}
    for op in ops:
        out["memory" if op.kind == "memory" or op.intensity < ridge else "compute"] += \
            op_time(op, accelerator, efficiency)
    return out
