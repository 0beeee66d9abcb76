"""The tensor-parallel GPT, and conversion to and from the single-device GPT.

:class:`TensorParallelGPT` is :class:`minipar.models.GPT` (a subclass: the same forward,
blocks and recomputation) built from parallel layers, split over the ranks of a
tensor-parallel ``group`` (Megatron-LM), optionally with sequence parallelism; only its parts
(:meth:`~TensorParallelGPT.parts`) and its loss differ. Parameter names are those of the
single-device model, each holding this rank's shard:

    embed.wte.weight        rows (vocabulary)            VocabParallelEmbedding
    blocks.i.attn.qkv.*     this rank's heads' rows of q, of k and of v (the fused weight
                            is (3h, h) = [q; k; v], so the shard takes three slices)
    blocks.i.attn.proj.w    columns (input features); its bias replicated
    blocks.i.mlp.fc.*       rows (output features)
    blocks.i.mlp.proj.w     columns; its bias replicated
    head.lm_head.weight     rows (vocabulary), shared with embed.wte when tied
    everything else         replicated (embed.wpe, the layer norms ln1, ln2, ln_f)

:func:`shard_state_dict` and :func:`unshard_state_dict` are that table as code;
:func:`from_gpt`, :func:`full_state_dict` and :func:`to_gpt` move weights between the two
forms exactly. ``layers()`` is ``[embed, block_0, ..., head]`` as in the GPT, so pipeline
parallelism can place these layers on its stages; the head returns this rank's vocabulary
slice of the logits, and :meth:`TensorParallelGPT.loss` is the vocabulary-parallel loss.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .. import comm
from ..models.gpt import GPT, Embedding, GPTConfig, Head
from ..models.moe import MoE
from .block import ParallelBlock
from .config import check_config
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear
from .ops import gather, size_and_rank
from .sequence import LayerNorm, PositionEmbedding


# ------------------------------------------------------------------ weight layout
def weight_layout(name: str):
    """How parameter ``name`` is split: ``("rows"|"cols"|"qkv")`` or ``None`` (replicated)."""
    if name.endswith(("wte.weight", "lm_head.weight", "mlp.fc.weight", "mlp.fc.bias")):
        return "rows"
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return "qkv"
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return "cols"
    return None


_DIM = {"rows": 0, "cols": 1}  # the dimension a "rows" or "cols" parameter is split along


def shard(name: str, full: torch.Tensor, t: int, r: int) -> torch.Tensor:
    """Rank ``r``'s shard (of ``t``) of the single-device tensor ``full`` called ``name``."""
    kind = weight_layout(name)
    if kind == "qkv":  # (3h, ...) = [q; k; v]: this rank's heads in each of q, k and v
        three = full.reshape(3, full.shape[0] // 3, *full.shape[1:])
        return three.chunk(t, 1)[r].reshape(-1, *full.shape[1:]).clone()
    return full.chunk(t, _DIM[kind])[r].clone() if kind else full.clone()


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The single-device tensor ``name`` from every rank's shard, in rank order."""
    kind, s = weight_layout(name), shards[0]
    if kind == "qkv":
        parts = [x.reshape(3, s.shape[0] // 3, *s.shape[1:]) for x in shards]
        return torch.cat(parts, 1).reshape(-1, *s.shape[1:])
    return torch.cat(shards, _DIM[kind]) if kind else s.clone()


def shard_state_dict(state_dict: dict, t: int, r: int) -> dict:
    """Rank ``r``'s state dict of the tensor-parallel model from a single-device one."""
    return {k: shard(k, v, t, r) for k, v in state_dict.items()}


def unshard_state_dict(shards: list[dict]) -> dict:
    """The single-device state dict from every rank's state dict (rank order)."""
    return {k: unshard(k, [s[k] for s in shards]) for k in shards[0]}


# ------------------------------------------------------------------ the model
class ParallelEmbedding(Embedding):
    """The GPT's embedding with the vocabulary-parallel token embedding and a (replicated)
    position embedding; with sequence parallelism both give this rank's tokens."""

    def __init__(self, c: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__(c, wte=VocabParallelEmbedding(c.vocab_size, c.n_embd, group, sequence_parallel),
                         wpe=PositionEmbedding(c.block_size, c.n_embd, group, sequence_parallel))


class ParallelHead(Head):
    """The GPT's head, final layer norm then the column-parallel output layer: this rank's
    vocabulary slice of the logits, (B, T, V/t), for all T positions."""

    def __init__(self, c: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__(c, ln_f=LayerNorm(c.n_embd, group, sequence_parallel),
                         lm_head=ColumnParallelLinear(c.n_embd, c.vocab_size, bias=False, group=group,
                                                      sequence_parallel=sequence_parallel))


class TensorParallelGPT(GPT):
    """:class:`minipar.models.GPT` split over the ranks of ``group`` (``None``: the world): the
    GPT itself (its forward, ``layers()``, recomputation, tied head) built from the parallel
    parts (:meth:`parts`), with the vocabulary-parallel loss (:meth:`loss`). Initialised exactly
    as ``GPT(config, seed=seed)`` and sharded; ``seed=None`` leaves the weights to be loaded
    (:func:`from_gpt` does)."""

    def __init__(self, config: GPTConfig, group=None, sequence_parallel: bool = False,
                 seed: int | None = 0):
        check_config(config, size_and_rank(group)[0])
        self.group, self.sequence_parallel = group, sequence_parallel  # read by parts(), inside GPT's __init__
        super().__init__(config)
        if seed is not None:
            self.load_full_state_dict(GPT(config, seed=seed).state_dict())

    def parts(self, c: GPTConfig):
        """The GPT's three parts, tensor-parallel over ``self.group``."""
        kw = dict(group=self.group, sequence_parallel=self.sequence_parallel)
        return (ParallelEmbedding(c, **kw), [ParallelBlock(c, **kw) for _ in range(c.n_layer)],
                ParallelHead(c, **kw))

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load this rank's shards of a single-device GPT's ``state_dict``."""
        self.load_state_dict(shard_state_dict(state_dict, *size_and_rank(self.group)))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of this rank's vocabulary slice of the logits (no gather)."""
        return vocab_parallel_cross_entropy(logits, targets, self.group)

    def forward(self, idx, targets=None):
        """The GPT's forward: the mean loss with ``targets``; without, the full logits
        (B, T, V), all-gathered from the ranks' vocabulary slices."""
        out = super().forward(idx, targets)
        return out if targets is not None else gather(out, -1, self.group)


def from_gpt(model: GPT, group=None, sequence_parallel: bool = False) -> TensorParallelGPT:
    """This rank's part of ``model`` (call on every rank of ``group`` with the same model): its
    dense layers split over ``group``; a mixture-of-experts model's MoE layers stay the model's
    own modules, whole on every rank (:mod:`minipar.expert_parallel` and :mod:`minipar.hybrid`
    then spread their experts)."""
    with torch.device(next(model.parameters()).device):  # built where the model lives
        tp = TensorParallelGPT(replace(model.config, moe_every=0), group, sequence_parallel, seed=None)
    for block, full in zip(tp.blocks, model.blocks):
        if isinstance(full.mlp, MoE):
            block.mlp = full.mlp
    tp.load_full_state_dict(model.state_dict())
    return tp


def gather_shards(tensors: dict, group) -> list[dict]:
    """Every rank's ``tensors`` (same names and shapes on every rank), one flat all-gather;
    :func:`unshard_state_dict` of them is the single-device state dict."""
    t, _ = size_and_rank(group)
    flat = torch.cat([v.detach().reshape(-1).float() for v in tensors.values()])
    out = torch.empty(t * flat.numel(), dtype=flat.dtype, device=flat.device)
    comm.all_gather(out, flat, group=group, name="gather_state")
    sizes = [v.numel() for v in tensors.values()]
    return [{k: x.view_as(v).to(v.dtype) for (k, v), x in zip(tensors.items(), row.split(sizes))}
            for row in out.view(t, -1)]


def full_state_dict(model: TensorParallelGPT, grads: bool = False) -> dict:
    """The single-device state dict (or, with ``grads=True``, the gradients by parameter
    name) assembled from every rank's shards; a collective, every rank gets it."""
    tensors = ({k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in model.named_parameters()}
               if grads else model.state_dict())
    return unshard_state_dict(gather_shards(tensors, model.group))


def replica_drift(model: TensorParallelGPT) -> float:
    """Largest difference between the ranks' copies of a replicated parameter (0 when the
    group keeps them in step); a collective."""
    reps = {k: p for k, p in model.named_parameters() if weight_layout(k) is None}
    shards = gather_shards(reps, model.group)
    return max((float((s[k] - shards[0][k]).abs().max()) for s in shards[1:] for k in reps), default=0.0)


def to_gpt(model: TensorParallelGPT) -> GPT:
    """A single-device :class:`GPT` with the tensor-parallel model's weights (a collective)."""
    with torch.device(next(model.parameters()).device):
        gpt = GPT(model.config)
    gpt.load_state_dict(full_state_dict(model))
    return gpt


def apply_tp(model: GPT, groups: dict, plan) -> GPT:
    """The composition's first step (:func:`minipar.hybrid.parallelize`): the GPT's dense layers
    split over ``groups["tp"]``, Megatron's column-then-row pairs (with sequence parallelism if
    ``plan.sequence_parallel``); the model itself on a group of one rank."""
    return from_gpt(model, groups["tp"], plan.sequence_parallel) if comm.group_size(groups["tp"]) > 1 else model
