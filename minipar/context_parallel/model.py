"""The course GPT with context parallelism: every layer but attention on the local tokens.

Each cp rank holds T/c tokens of every sequence (:func:`shard_sequence`) and the whole model
(or its tensor-parallel share). Everything but attention is position-wise (embeddings, norms,
projections, MLPs, head) and runs on the local tokens at their global positions
(:func:`sequence_positions`). :func:`parallelize` swaps two modules for the GPT's own with one
seam overridden, keeping their layers (parameters and names): each block's attention becomes
:class:`ContextParallelAttention`, the GPT's causal self-attention whose core ``attend`` is
ring, all-gather or Ulysses attention over the cp group; the embedding becomes
:class:`PositionedEmbedding`, the GPT's embedding whose ``positions`` are this rank's global
ones (set per batch).

The global batch's loss is the mean over all B·T tokens; every rank holds as many, so
``L = 1/c Σ_r L_r`` with ``L_r`` the local mean. Each rank back-propagates ``L_r / c`` (times
1/dp with data parallelism), the attention backward carries the cross-rank terms, and every
replicated parameter's gradient is the **sum** over the ranks: one all-reduce over cp, or over
the combined dp × cp group (Megatron-LM).
"""
from __future__ import annotations

import torch

from .. import comm
from ..models.gpt import CausalSelfAttention, Embedding, GPTConfig
from .attention import ContextParallelAttend


class ContextParallelAttention(CausalSelfAttention):
    """The GPT's causal self-attention (its projections, reshape and forward) on this rank's
    T/c tokens, with a context-parallel core: ``attend`` runs over the cp ``group``. Takes over
    ``attn``'s ``qkv``, ``proj`` and heads (a GPT block's, or a tensor-parallel block's: this
    rank's heads and its column- and row-parallel projections), its recomputation and its
    attention kernel."""

    def __init__(self, c: GPTConfig, attn: CausalSelfAttention, group=None, variant: str = "ring",
                 layout: str = "zigzag"):
        super().__init__(c, qkv=attn.qkv, proj=attn.proj, n_head=attn.n_head)
        self.drop, self.recompute, self.attention = attn.drop, attn.recompute, attn.attention
        self.core = ContextParallelAttend(group, variant, layout)

    def attend(self, q, k, v):
        """This rank's queries (B, heads, T/c, d) against the whole sequence; ``"selective"``
        recomputes the local core, never the communication (:mod:`.attention`)."""
        return self.core(q, k, v, selective=self.recompute == "selective", attention=self.attention)


class PositionedEmbedding(Embedding):
    """The GPT's token plus position embedding of this rank's tokens at their global positions
    ``self.global_positions`` (:func:`set_positions`); takes over ``embed``'s ``wte``,
    ``wpe`` and dropout."""

    def __init__(self, c: GPTConfig, embed: Embedding):
        super().__init__(c, wte=embed.wte, wpe=embed.wpe)
        self.drop, self.global_positions = embed.drop, None

    def positions(self, idx):
        """The global positions of this rank's tokens ``idx`` (B, T/c), set for this batch."""
        pos = self.global_positions
        if pos is None or pos.numel() != idx.shape[1]:
            raise RuntimeError("set the global positions of this rank's tokens first (set_positions)")
        return pos.to(idx.device)


def parallelize(model, group=None, variant: str = "ring", layout: str = "zigzag"):
    """Make the GPT ``model`` (or a tensor-parallel GPT) context-parallel over ``group``, in
    place: attention and embedding swapped, parameters and their names kept. Returns it."""
    for block in model.blocks:
        block.attn = ContextParallelAttention(model.config, block.attn, group, variant, layout)
    model.embed = PositionedEmbedding(model.config, model.embed)
    return model


def set_positions(model, positions: torch.Tensor) -> None:
    """The global positions of the tokens this rank feeds ``model`` next."""
    model.embed.global_positions = positions


def local_loss(model, idx, targets, positions):
    """Mean cross-entropy of this rank's tokens ``idx`` (B, T/c) at global ``positions``."""
    set_positions(model, positions)
    return model(idx, targets)   # the model's own loss (GPT.loss)


def all_reduce_grads(params, group=None, name: str = "cp_grads", dim: str = "cp") -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat all-reduce."""
    comm.all_reduce_gradients(params, group=group, missing="skip", in_place=True, name=name, dim=dim)


def apply_cp(model, groups: dict, plan):
    """The composition's second step: every attention of ``model`` over ``groups["cp"]`` (ring,
    all-gather or Ulysses, ``plan.variant``; sequences cut by ``plan.layout``), in place; nothing
    without a cp group."""
    if "cp" in groups and comm.group_size(groups["cp"]) > 1:
        parallelize(model, groups["cp"], plan.variant, plan.layout)
    return model
