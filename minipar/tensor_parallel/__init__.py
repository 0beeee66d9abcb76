"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022), written on :mod:`minipar.comm`.

* :mod:`.ops`: the conjugate operators f and g, the all-gather / reduce-scatter pair.
* :mod:`.layers`: ``ColumnParallelLinear``, ``RowParallelLinear``.
* :mod:`.embedding`, :mod:`.cross_entropy`: the vocabulary-parallel input and loss.
* :mod:`.sequence`: sequence-parallel regions (layer norms and residuals on s/t tokens).
* :mod:`.block`, :mod:`.gpt`: the tensor-parallel transformer and the conversion to and
  from :class:`minipar.models.GPT`.
* :mod:`.config`: :func:`check_config`, the splitting rules.
* :mod:`.train`: :func:`check`, :func:`train`, :func:`run`, the API of every strategy
  (:mod:`minipar.strategy`); activation memory is measured with
  :class:`minipar.activations.SavedActivations`.

Every layer and operator takes ``group`` (the tensor-parallel process group, ``None`` for
the world) and uses group-local ranks, so the pieces compose with data and pipeline
parallelism on a process mesh.
"""
from .block import ParallelAttention, ParallelBlock, ParallelMLP
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .gpt import (ParallelEmbedding, apply_tp, ParallelHead, TensorParallelGPT, from_gpt, full_state_dict,
                  gather_shards, replica_drift, shard_state_dict, to_gpt, unshard_state_dict)
from .layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linear, row_parallel_linear
from .ops import all_gather, f, g, gather, reduce_scatter, split, sync_grad
from .sequence import LayerNorm, gather_seq, reduce_scatter_seq, split_seq
from .config import check_config
from .train import check, run, train

__all__ = ["apply_tp", "f", "g", "all_gather", "reduce_scatter", "gather", "split", "sync_grad", "column_parallel_linear",
           "row_parallel_linear", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "gather_seq", "reduce_scatter_seq", "split_seq", "LayerNorm",
           "ParallelAttention", "ParallelMLP", "ParallelBlock", "ParallelEmbedding", "ParallelHead",
           "TensorParallelGPT", "check_config", "check", "train", "run", "from_gpt", "to_gpt", "full_state_dict",
           "gather_shards", "replica_drift", "shard_state_dict", "unshard_state_dict"]
