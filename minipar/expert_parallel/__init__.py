"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

``dispatch`` (counts, split sizes, the permutation), ``all_to_all`` (the differentiable
exchange), ``layer`` (:class:`ExpertParallelMoE`, :func:`shard_experts`), ``groups`` (the ep
groups carved out of the data-parallel ranks), ``train`` (``check``/``train``/``run``: DP × EP,
and EP × TP through ``tensor``), ``imbalance`` (load imbalance, measured); its figures are in
:mod:`minipar.study.plots.expert_parallel`.
The single-device layer is :class:`minipar.models.moe.MoE`.
"""
from .all_to_all import all_to_all
from .dispatch import count_tokens, kept_counts, permutation, split_sizes
from .imbalance import expert_rows, expert_seconds, load_imbalance, time_imbalance
from .groups import build_ep_groups, ep_layout
from .layer import ExpertParallelMoE, exchange_counts, shard_experts
from .train import check, reduce_gradients, run, train

__all__ = ["all_to_all", "count_tokens", "kept_counts", "permutation", "split_sizes", "ExpertParallelMoE",
           "exchange_counts", "shard_experts", "ep_layout", "build_ep_groups", "reduce_gradients", "check",
           "train", "run", "load_imbalance", "expert_seconds", "expert_rows", "time_imbalance"]
