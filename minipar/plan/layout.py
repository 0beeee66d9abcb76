"""One parallel layout, and the checks that reject it before anything is predicted.

A :class:`Layout` is every knob of a training run: the five parallel sizes (data dp, tensor
tp, pipeline pp with v virtual stages, context cp, expert ep), the ZeRO stage, the micro-batch
b, the recomputation, the precision, and what the framework overlaps (``overlap_dp``, ``overlap_tp``:
:mod:`minipar.plan.overlap`). The world is ``dp·tp·pp·cp`` GPUs; expert parallelism
splits the experts over ``ep`` of the ``dp·cp`` data ranks (as Megatron-LM does): no more GPUs.
Ranks are numbered tp fastest, then cp, dp, pp (Megatron-LM's order): a dimension's group
spans that many consecutive GPUs, which decides its link (:meth:`minipar.plan.Cluster.link`).

ZeRO-3 takes the library's two further knobs (:class:`minipar.hybrid.Parallelism`):
``reshard_after_forward`` (``"auto"``: kept gathered across a step's micro-batches under a
pipeline, resharded after every use without one; ``"always"``; ``"never"``) and HSDP's
``dp_shard`` (S: stage 3 within blocks of S·cp data ranks, the blocks' gradient shards
all-reduced across the dp/S = ``dp_replicate`` blocks; ``None``: S = dp, plain ZeRO-3).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..cost.flops import RECOMPUTE
from ..cost.pipeline import SCHEDULES
from .models import ModelSpec

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _is_gpu(accelerator) -> bool:
    """Where ``"auto"`` settings resolve: a GPU, or (no accelerator named, or a CPU) not."""
    return getattr(accelerator, "kind", "cpu") == "gpu"


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    v: int = 1                   # virtual stages per pipeline rank (interleaved 1F1B)
    cp: int = 1
    ep: int = 1
    zero: int = 0                # ZeRO stage over the dp·cp ranks
    micro_batch: int = 1         # b, sequences per micro-batch
    recompute: str = "none"
    dtype: str = "bf16"
    schedule: str = "1f1b"
    sequence_parallel: bool = True   # with tp > 1 (Korthikanti et al. 2022)
    overlap_dp: bool = True          # gradient reduction overlapped with the last micro-batch's backward
    overlap_tp: object = "auto"      # SP's gathers and scatters behind their GEMMs: True, False, "auto" (on a GPU)
    attention: str = "auto"          # "flash", "materialized", or "auto": flash on a GPU, else materialized
    reshard_after_forward: str = "auto"   # ZeRO-3: "always", "never", or "auto" (kept gathered with pp > 1)
    dp_shard: int | None = None      # HSDP: ZeRO-3 within blocks of dp_shard (None: all of dp)

    def attention_on(self, accelerator=None) -> str:
        """The attention kernel this layout runs: ``"auto"`` is ``"flash"`` on a GPU (as every
        current training run and ``scaled_dot_product_attention`` there) and ``"materialized"``
        (Korthikanti et al.'s count) on a CPU or when no accelerator is named."""
        if self.attention != "auto":
            return self.attention
        return "flash" if _is_gpu(accelerator) else "materialized"

    def tp_overlap_on(self, accelerator=None) -> bool:
        """Whether sequence parallelism's gathers and scatters run behind their GEMMs
        (:mod:`minipar.plan.overlap`): ``"auto"`` is on for a GPU with tp > 1 and sequence
        parallelism (Megatron-Core's ``--tp-comm-overlap``, PyTorch's async TP), off on a CPU (the
        course's own tensor parallelism does not overlap)."""
        if not self.sp:
            return False
        if self.overlap_tp != "auto":
            return bool(self.overlap_tp)
        return _is_gpu(accelerator)

    @property
    def kept_gathered(self) -> bool:
        """ZeRO-3 keeps a stage's units gathered across its micro-batches and reduce-scatters once
        (:func:`minipar.hybrid.sharding.reshard_policy`'s rule)."""
        return self.zero == 3 and (self.reshard_after_forward == "never"
                                   or (self.reshard_after_forward == "auto" and self.pp > 1))

    @property
    def hsdp(self) -> bool:
        return self.zero == 3 and self.dp_shard is not None and self.dp_shard < self.dp

    @property
    def dp_replicate(self) -> int:
        """R, the blocks HSDP replicates across (1 without HSDP)."""
        return self.dp // self.dp_shard if self.hsdp else 1

    @property
    def zero_ranks(self) -> int:
        """N, the ranks ZeRO shards the dense states over (one HSDP block's under HSDP)."""
        return (self.dp // self.dp_replicate) * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def bytes_per_element(self) -> int:
        return DTYPES[self.dtype]

    def span(self, dim: str) -> int:
        """How many consecutive GPUs one group of ``dim`` spans (tp, cp, dp, pp order)."""
        return {"tp": self.tp, "cp": self.tp * self.cp, "ep": self.tp * self.cp * self.ep,
                "dp": self.tp * self.cp * self.dp, "pp": self.world, "dp_shard": self.tp * self.zero_ranks,
                "dp_replicate": self.tp * self.cp * self.dp}[dim]

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def replace(self, **changes) -> "Layout":
        return replace(self, **changes)

    def __str__(self) -> str:
        dims = [f"{k}{getattr(self, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        extra = [f"b={self.micro_batch}", self.dtype] + ([f"ZeRO-{self.zero}"] if self.zero else [])
        extra += [{"gpipe": "GPipe", "zb-h1": "ZB-H1"}.get(self.schedule, self.schedule)] \
            if self.schedule not in ("1f1b", "interleaved") else []      # interleaved: the v above
        extra += [f"{self.recompute} recompute"] if self.recompute != "none" else []
        extra += [f"{self.attention} attention"] if self.attention != "auto" else []
        extra += ["TP overlapped"] if self.overlap_tp is True and self.sp else []
        extra += [f"HSDP {self.dp_replicate}×{self.dp // self.dp_replicate}"] if self.hsdp else []
        extra += [{"always": "resharded", "never": "kept gathered"}[self.reshard_after_forward]] \
            if self.zero == 3 and self.reshard_after_forward in ("always", "never") else []
        v = f" v{self.v}" if self.v > 1 else ""
        return f"{'·'.join(dims) or '1 GPU'}{v} ({', '.join(extra)})"


def problems(model: ModelSpec, layout: Layout, global_batch: int, seq_len: int) -> list[str]:
    """Why ``layout`` cannot run ``model`` (empty when it can), in plain words."""
    L, knobs = layout, ("dp", "tp", "pp", "v", "cp", "ep", "micro_batch")
    out = [f"{k} must be a positive int, got {getattr(L, k)!r}" for k in knobs
           if not isinstance(getattr(L, k), int) or getattr(L, k) < 1]
    if out:
        return out
    if L.recompute not in RECOMPUTE:
        out.append(f"recompute must be one of {RECOMPUTE}, got {L.recompute!r}")
    if L.dtype not in DTYPES:
        out.append(f"dtype must be one of {sorted(DTYPES)}, got {L.dtype!r}")
    if L.schedule not in SCHEDULES:
        out.append(f"schedule must be one of {SCHEDULES}, got {L.schedule!r}")
    if L.attention not in ("auto", "flash", "materialized"):
        out.append(f"attention must be 'auto', 'flash' or 'materialized', got {L.attention!r}")
    if L.zero not in (0, 1, 2, 3):
        out.append(f"zero must be 0-3, got {L.zero!r}")
    if model.n_head % L.tp or (model.n_kv_head or model.n_head) % L.tp:
        out.append(f"tp={L.tp} does not divide the {model.n_head} heads "
                   f"({model.n_kv_head or model.n_head} key-value heads)")
    if L.pp * L.v > model.n_layer:
        out.append(f"pp·v={L.pp * L.v} stages for {model.n_layer} layers")
    if L.v > 1 and L.schedule != "interleaved":
        out.append(f"v={L.v} needs the interleaved schedule")
    if seq_len % L.cp:
        out.append(f"cp={L.cp} does not divide the sequence length {seq_len}")
    if L.sp and (seq_len // L.cp) % L.tp:
        out.append(f"sequence parallelism needs s/cp={seq_len // L.cp} divisible by tp={L.tp}")
    if model.n_experts % L.ep or (L.dp * L.cp) % L.ep:
        out.append(f"ep={L.ep} must divide the {model.n_experts} experts and dp·cp={L.dp * L.cp}")
    if global_batch % (L.dp * L.micro_batch):
        out.append(f"global batch {global_batch} is not a multiple of dp·b={L.dp * L.micro_batch}")
    elif L.schedule == "interleaved" and (m := L.microbatches(global_batch)) % L.pp:
        out.append(f"interleaved 1F1B needs m={m} micro-batches to be a multiple of pp={L.pp}")
    if L.overlap_tp not in (True, False, "auto"):
        out.append(f"overlap_tp must be True, False or 'auto', got {L.overlap_tp!r}")
    elif L.overlap_tp is True and L.tp > 1 and not L.sequence_parallel:
        out.append("overlap_tp splits sequence parallelism's gathers and scatters: it needs "
                   "sequence_parallel=True")
    if L.pp > 1 and L.zero == 2:
        out.append("ZeRO-2 with pipeline parallelism reduce-scatters every micro-batch's gradients; "
                   "the planner leaves it out")
    if L.reshard_after_forward not in ("auto", "always", "never"):
        out.append(f"reshard_after_forward must be 'auto', 'always' or 'never', got {L.reshard_after_forward!r}")
    elif L.reshard_after_forward != "auto" and L.zero != 3:
        out.append(f"reshard_after_forward={L.reshard_after_forward!r} is ZeRO-3's policy, got zero={L.zero}")
    if L.dp_shard is not None:
        if not isinstance(L.dp_shard, int) or L.dp_shard < 1 or L.dp % L.dp_shard:
            out.append(f"dp_shard={L.dp_shard!r} must be a positive divisor of dp={L.dp} (dp = dp_replicate·dp_shard)")
        elif L.dp_shard < L.dp and L.zero != 3:
            out.append(f"dp_shard={L.dp_shard} < dp={L.dp} (HSDP) shards parameters: it needs zero=3, got zero={L.zero}")
        elif L.dp_shard < L.dp and L.ep > 1:
            out.append(f"dp_shard={L.dp_shard} < dp={L.dp} with ep={L.ep}: HSDP shards dense models only")
    return out


def check(model: ModelSpec, layout: Layout, global_batch: int, seq_len: int) -> None:
    """Raise a plain ``ValueError`` listing :func:`problems`."""
    found = problems(model, layout, global_batch, seq_len)
    if found:
        raise ValueError(f"layout {layout} cannot run {model.name}: " + "; ".join(found))
