"""Context parallelism: the sequence split across ranks for the whole model.

Only attention needs the other ranks' tokens. The pieces, one file each::

    sharding   shard_sequence / unshard_sequence / sequence_positions, "contiguous" or "zigzag"
               (two of 2c chunks per rank, the same causal work), zigzag_chunks, check_sequence
    blockwise  attention_block, merge_partials (the online-softmax merge), attention_block_backward
    ring       ring_attention (RingAttention: K/V around the ring, backward written out), schedule
    allgather  all_gather_attention (Llama 3)
    ulysses    ulysses_attention (DeepSpeed-Ulysses: all-to-all, sequence <-> heads), check_heads
    attention  context_attention(q, k, v, group, causal, layout, variant) -> (O, lse) of this rank's
               tokens (B, H, T/c, d), equal to full attention; recomputation with every variant
    model      parallelize(gpt, group, variant, layout), local_loss, all_reduce_grads
    saved_activation_bytes (re-exported from minipar.activations: what autograd keeps; cost.cp_activation_bytes)
    train      check / train / run (minipar.strategy's shape), dp × cp on a ProcessMesh;
               check_config (what minipar.hybrid checks for its cp dimension)

Its figures (the ring's schedule, the attention matrix it covers) are in
:mod:`minipar.study.plots.context_parallel`.
"""
from .allgather import all_gather_attention
from .attention import VARIANTS, ContextParallelAttend, context_attention
from .blockwise import attention_block, attention_block_backward, masked_attention, merge_partials
from ..activations import saved_activation_bytes
from .model import (ContextParallelAttention, apply_cp, PositionedEmbedding, all_reduce_grads, local_loss,
                    parallelize, set_positions)
from .ring import RingAttention, ring_attention, ring_step, schedule
from .sharding import (LAYOUTS, check_sequence, chunk_ids, sequence_positions, shard_sequence,
                       unshard_sequence, zigzag_chunks)
from .train import check, check_config, run, train
from .ulysses import check_heads, ulysses_attention

__all__ = ["apply_cp", "shard_sequence", "unshard_sequence", "sequence_positions", "zigzag_chunks", "chunk_ids",
           "check_sequence", "LAYOUTS", "attention_block", "attention_block_backward", "masked_attention",
           "merge_partials", "ring_attention", "RingAttention", "ring_step", "schedule",
           "all_gather_attention", "ulysses_attention", "check_heads", "context_attention",
           "ContextParallelAttend", "VARIANTS", "parallelize", "local_loss", "all_reduce_grads",
           "set_positions", "ContextParallelAttention", "PositionedEmbedding", "saved_activation_bytes",
           "check", "check_config", "train", "run"]
