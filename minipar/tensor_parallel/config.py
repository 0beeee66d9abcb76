"""What a GPT must satisfy to be split over t tensor-parallel ranks (Megatron-LM's rules).

Attention heads, the hidden size and the vocabulary are cut into t equal parts (Shoeybi et al.
2019, §3: every rank holds n_head/t heads, 4h/t columns of the MLP, V/t rows of the embedding);
sequence parallelism (Korthikanti et al. 2022) also cuts the sequence into t parts. The
strategy's :func:`~minipar.tensor_parallel.check` and :class:`~minipar.tensor_parallel.TensorParallelGPT`
both apply :func:`check_config`.
"""
from __future__ import annotations


def check_config(config, t: int, sequence_parallel: bool = False, seq_len: int | None = None) -> None:
    """A plain ``ValueError`` naming every rule the GPT ``config`` breaks when split over ``t``
    ranks (sequence length ``seq_len``, else ``block_size``, with sequence parallelism)."""
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"the tensor-parallel size t must be a positive int, got {t!r}")
    problems = [f"{name}={value} is not divisible by t={t}" for name, value in
                (("n_head", config.n_head), ("n_embd", config.n_embd), ("vocab_size", config.vocab_size))
                if value % t]
    if config.vocab_size % t:
        problems.append("pad the vocabulary to a multiple of t (Megatron-LM pads it)")
    if sequence_parallel and (seq_len or config.block_size) % t:
        problems.append(f"sequence length {seq_len or config.block_size} is not divisible by t={t} "
                        "(sequence parallelism splits it)")
    if config.dropout:
        problems.append(f"dropout={config.dropout} is not supported (it needs a random state shared "
                        "by the tensor-parallel group); use dropout=0")
    if problems:
        raise ValueError(f"cannot split this GPT over t={t} ranks: " + "; ".join(problems))
