"""A small GPT (decoder-only transformer), the model most chapters train.

GPT-2 (Radford et al. 2019) as in nanoGPT: token and position embeddings, ``n_layer`` pre-norm
blocks ``x + attn(ln(x))``, ``x + mlp(ln(x))``, a final layer norm and a linear head to the
vocabulary. Attention is ``GPTConfig.attention``: PyTorch's fused kernel (``"sdpa"``) or written
out (``"materialized"``, the readable reference), :mod:`.attention`; tensor parallelism splits it by heads.
Pipeline parallelism can cut the three parts anywhere: ``embed`` (tokens -> hidden states),
``blocks`` (hidden -> hidden), ``head`` (hidden -> logits), flat in ``model.layers()``.
Initialisation is deterministic given ``seed`` and leaves the global random state alone.

The seams a parallel GPT uses to stay this model (Megatron-LM's way: the model is the model, its
layers are swapped for parallel ones): each module takes its layers as optional arguments
(``CausalSelfAttention(c, qkv=, proj=, n_head=)``, ``FeedForward(c, fc=, proj=)``,
``Block(c, attn=, mlp=, norm=)``, ``Embedding(c, wte=, wpe=)``, ``Head(c, ln_f=, lm_head=)``),
the attention's core ``CausalSelfAttention.attend(q, k, v)``, the embedding's ``positions(idx)``,
:meth:`GPT.parts` builds the three parts and :meth:`GPT.loss` is the loss of the head's
logits. :mod:`minipar.tensor_parallel` overrides those two and passes its parallel layers;
:mod:`minipar.context_parallel` overrides ``attend`` and ``positions``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import causal_attention, check_attention, resolve
from .moe import MoE, moe_loss
from .recompute import check_mode, run, set_recompute


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 32      # longest sequence
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32          # hidden size h
    tie_weights: bool = False  # share the embedding matrix with the output head
    dropout: float = 0.0
    recompute: str = "none"   # activation recomputation: "none" | "selective" | "full" (.recompute)
    attention: str = "auto"   # "sdpa" (fused) | "materialized" (written out) | "auto" (.attention):
    #                           "sdpa" on a GPU, "materialized" on the CPU
    # Mixture of experts (minipar.models.moe): every moe_every-th block's MLP (blocks
    # moe_every-1, 2·moe_every-1, ...) becomes n_experts experts, top_k per token. 0 = dense.
    moe_every: int = 0
    n_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = None  # None = dropless
    aux_loss_coef: float = 0.01           # load-balancing loss E·Σ f_i P_i
    z_loss_coef: float = 0.0              # router z-loss


class CausalSelfAttention(nn.Module):
    """``proj(attend(qkv(x)))`` over ``n_head`` heads. ``qkv``, ``proj`` and ``n_head`` default
    to the whole layer; tensor parallelism passes its column- and row-parallel projections and
    this rank's share of the heads (:class:`minipar.tensor_parallel.ParallelAttention`)."""

    def __init__(self, c: GPTConfig, qkv: nn.Module | None = None, proj: nn.Module | None = None,
                 n_head: int | None = None):
        super().__init__()
        if c.n_embd % c.n_head:
            raise ValueError(f"n_embd={c.n_embd} is not divisible by n_head={c.n_head}")
        self.n_head, self.head_dim = n_head or c.n_head, c.n_embd // c.n_head
        self.qkv = qkv if qkv is not None else nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = proj if proj is not None else nn.Linear(c.n_embd, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.recompute = check_mode(c.recompute)
        self.attention = check_attention(getattr(c, "attention", "auto"))

    def attend(self, q, k, v):
        """softmax(q kᵀ / √d + causal mask) v, per head; (B, heads, T, d) tensors; with
        selective recomputation only q, k, v are kept for backward (fused, the kernel itself keeps
        only q, k, v, O, lse and recomputes the scores in backward: nothing more to drop)."""
        fused = resolve(self.attention, q.device) == "sdpa"
        return run(self._attend, self.recompute == "selective" and not fused, q, k, v)

    def _attend(self, q, k, v):
        if resolve(self.attention, q.device) == "sdpa":   # the fused kernel
            return causal_attention(q, k, v, "sdpa", self.drop.p if self.training else 0.0)
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        return att @ v

    def forward(self, x):
        qkv = self.qkv(x)        # (B, T, 3·width), T the full length (sequence parallelism gathers it)
        B, T, _ = qkv.shape
        width = self.n_head * self.head_dim   # h, or this rank's h/t with tensor parallelism
        q, k, v = qkv.split(width, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v).transpose(1, 2).reshape(B, T, width)
        return self.drop(self.proj(y))


class FeedForward(nn.Module):
    """``proj(GeLU(fc(x)))``; ``fc`` and ``proj`` default to ``nn.Linear`` (tensor parallelism:
    column- then row-parallel)."""

    def __init__(self, c: GPTConfig, fc: nn.Module | None = None, proj: nn.Module | None = None):
        super().__init__()
        self.fc = fc if fc is not None else nn.Linear(c.n_embd, 4 * c.n_embd)
        self.proj = proj if proj is not None else nn.Linear(4 * c.n_embd, c.n_embd)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``. ``attn``, ``mlp`` and the layer norms'
    class ``norm`` default to the single-device ones (block ``index``'s MLP an MoE layer where
    ``GPTConfig.moe_every`` says); a parallel block passes its own."""

    def __init__(self, c: GPTConfig, index: int | None = None, *, attn: nn.Module | None = None,
                 mlp: nn.Module | None = None, norm=nn.LayerNorm):
        super().__init__()
        moe = c.moe_every and index is not None and index % c.moe_every == c.moe_every - 1
        self.ln1, self.attn = norm(c.n_embd), attn if attn is not None else CausalSelfAttention(c)
        self.ln2 = norm(c.n_embd)
        self.mlp = mlp if mlp is not None else (
            MoE(c.n_embd, c.n_experts, c.top_k, c.capacity_factor, c.aux_loss_coef, c.z_loss_coef)
            if moe else FeedForward(c))
        self.recompute = check_mode(c.recompute)

    def forward(self, x):
        """With full recomputation only ``x`` is kept; the block runs again in backward."""
        return run(self._forward, self.recompute == "full", x)

    def _forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """``wte(tokens) + wpe(positions)``; tensor parallelism passes the vocabulary-parallel
    ``wte`` and a ``wpe`` that looks up its sequence shard's positions; context parallelism
    overrides :meth:`positions` (its tokens' global positions)."""

    def __init__(self, c: GPTConfig, wte: nn.Module | None = None, wpe: nn.Module | None = None):
        super().__init__()
        self.wte = wte if wte is not None else nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = wpe if wpe is not None else nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)

    def positions(self, idx):
        """The positions of the tokens ``idx`` (B, T): ``0 .. T-1``."""
        return torch.arange(idx.shape[1], device=idx.device)

    def forward(self, idx):
        return self.drop(self.wte(idx) + self.wpe(self.positions(idx)))


class Head(nn.Module):
    """``lm_head(ln_f(x))``: the logits (tensor parallelism: this rank's vocabulary slice)."""

    def __init__(self, c: GPTConfig, ln_f: nn.Module | None = None, lm_head: nn.Module | None = None):
        super().__init__()
        self.ln_f = ln_f if ln_f is not None else nn.LayerNorm(c.n_embd)
        self.lm_head = lm_head if lm_head is not None else nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit layer norms."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None, seed: int = 0, **overrides):
        super().__init__()
        self.config = c = config or GPTConfig(**overrides)
        if config is not None and overrides:
            raise ValueError("pass either a GPTConfig or keyword overrides, not both")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            embed, blocks, head = self.parts(c)
            self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head
            init_weights(self)
        if c.tie_weights:
            self.head.lm_head.weight = self.embed.wte.weight

    def parts(self, c: GPTConfig) -> tuple[nn.Module, list[nn.Module], nn.Module]:
        """``(embed, blocks, head)`` for config ``c``, built in that order: the one place the GPT
        names its layers' classes (a parallel GPT overrides it to build its parallel layers)."""
        return Embedding(c), [Block(c, i) for i in range(c.n_layer)], Head(c)

    def layers(self) -> list[nn.Module]:
        """``[embed, block_0, ..., block_{L-1}, head]``: applied in order, tokens -> logits."""
        return [self.embed, *self.blocks, self.head]

    def set_recompute(self, mode) -> "GPT":
        """``"none"``, ``"selective"`` or ``"full"`` recomputation in every block (:mod:`.recompute`)."""
        self.config = replace(self.config, recompute=check_mode(mode))   # copies made from the config follow
        return set_recompute(self, mode)

    def set_attention(self, attention) -> "GPT":
        """``"sdpa"``, ``"materialized"`` or ``"auto"`` attention in every block (:mod:`.attention`)."""
        self.config = replace(self.config, attention=check_attention(attention))
        return set_attention(self, attention)

    def forward(self, idx, targets=None):
        """Logits ``(B, T, vocab)``; with ``targets``, the mean cross-entropy loss instead."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        loss = self.loss(logits, targets)
        return loss + moe_loss(self) if self.config.moe_every else loss  # + the MoE layers' aux losses

    def loss(self, logits, targets):
        """The mean cross-entropy of the head's ``logits`` (:func:`lm_loss`); the vocabulary-parallel
        GPT overrides it (its head returns a slice of the vocabulary)."""
        return lm_loss(logits, targets)


def set_attention(model: nn.Module, attention) -> nn.Module:
    """Set ``attention`` on every attention of ``model`` (single-device, tensor- or context-parallel)."""
    attention = check_attention(attention)
    for m in model.modules():
        if hasattr(m, "attention"):
            m.attention = attention
    return model


def lm_loss(logits, targets):
    """Mean next-token cross-entropy over all B·T positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
