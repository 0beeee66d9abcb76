"""The course GPT's size on this machine: small on 2 CPU cores, bigger on a GPU.

:func:`gpt_config` picks the row of :data:`SIZES` for the device
(:func:`minipar.runtime.gpu.model_size`), so that a chapter takes about the same time on a
laptop as on a Colab T4 (16 GB, ~8 TFLOP/s fp32)."""
from __future__ import annotations

from ..runtime.gpu import model_size
from .gpt import GPTConfig

SIZES = {
    "cpu": dict(n_layer=2, n_head=4, n_embd=32, block_size=32),
    "gpu": dict(n_layer=4, n_head=8, n_embd=256, block_size=128),
}


def gpt_config(vocab_size: int = 64, device=None, **overrides) -> GPTConfig:
    """The course GPT's :class:`~minipar.models.GPTConfig` for ``device`` (``None``: this
    machine's default), with ``overrides``."""
    return GPTConfig(vocab_size=vocab_size, **{**SIZES[model_size(device)], **overrides})
