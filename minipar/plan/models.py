"""Model shapes the planner knows, each with its source; add your own in one line.

A :class:`ModelSpec` is what the formulas need: layers l, hidden size h, heads a (and key-value
heads for grouped-query attention), the MLP's width and whether it is gated (SwiGLU: three
matrices, not two), vocabulary V, and for a mixture of experts the number of experts and how
many each token visits (top-k). Parameter counts follow (biases and norms left out, as the
papers count them)::

    MODELS["my-7b"] = ModelSpec("my-7b", n_layer=32, hidden=4096, n_head=32, vocab=32000,
                                source="my notes")
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layer: int             # l
    hidden: int              # h
    n_head: int              # a
    vocab: int               # V
    seq_len: int = 2048      # the length it was trained at (the planner's default s)
    ffn: int | None = None   # MLP width (default 4h)
    n_kv_head: int | None = None   # grouped-query attention (default: a)
    gated: bool = False      # SwiGLU MLP (3 matrices)
    n_experts: int = 1       # experts per MoE layer (1: dense)
    top_k: int = 1           # experts each token visits
    tied: bool = False       # output head shares the embedding
    dropout: bool = True     # stores dropout masks (Korthikanti et al.'s count); Llama has none
    source: str = field(default="", compare=False)

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_dim(self) -> int:
        return self.hidden if self.n_kv_head is None else self.n_kv_head * (self.hidden // self.n_head)

    def attention_params(self) -> int:
        """Q and the output projection h×h each, K and V h×kv_dim each."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim

    def expert_params(self) -> int:
        """One expert's (or the dense MLP's) matrices: 2 or 3 of h × ffn."""
        return (3 if self.gated else 2) * self.hidden * self.ffn_width

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def num_params(self) -> int:
        """Ψ: embeddings + l·(attention + experts·MLP)."""
        per_layer = self.attention_params() + self.n_experts * self.expert_params()
        return self.embedding_params() + self.n_layer * per_layer

    def active_params(self) -> int:
        """Parameters one token passes through (top-k of the experts)."""
        per_layer = self.attention_params() + self.top_k * self.expert_params()
        return self.embedding_params() + self.n_layer * per_layer

    def forward_flops_per_token(self, s: int | None = None) -> float:
        """2 FLOPs per active weight of the layers and the head, plus ``4·s·h`` per layer for ``QKᵀ``
        and ``attn·V`` (Narayanan et al. 2021's count; for a GPT ``(24lh² + 4lsh + 2hV)`` per token)."""
        return (2 * (self.active_params() - self.embedding_params()) + self.attention_core_flops_per_token(s)
                + 2 * self.hidden * self.vocab)

    def attention_core_flops_per_token(self, s: int | None = None) -> float:
        """``QKᵀ`` and ``attn·V`` of all layers per token, ``4·s·h·l`` (selective recomputation's)."""
        return 4 * self.n_layer * (s or self.seq_len) * self.hidden


def gpt(name, l, h, a, V=50257, s=2048, source=""):
    return ModelSpec(name, l, h, a, V, s, tied=True, source=source)


_GPT3 = "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1"
_LLAMA3 = "Llama Team 2024, 'The Llama 3 Herd of Models', Table 3"

MODELS: dict[str, ModelSpec] = {
    "gpt3-125m": gpt("gpt3-125m", 12, 768, 12, source=_GPT3),
    "gpt3-350m": gpt("gpt3-350m", 24, 1024, 16, source=_GPT3),
    "gpt3-760m": gpt("gpt3-760m", 24, 1536, 16, source=_GPT3),
    "gpt3-1.3b": gpt("gpt3-1.3b", 24, 2048, 24, source=_GPT3),
    "gpt3-2.7b": gpt("gpt3-2.7b", 32, 2560, 32, source=_GPT3),
    "gpt3-6.7b": gpt("gpt3-6.7b", 32, 4096, 32, source=_GPT3),
    "gpt3-13b": gpt("gpt3-13b", 40, 5140, 40, source=_GPT3),
    "gpt3-175b": gpt("gpt3-175b", 96, 12288, 96, source=_GPT3),
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 128256, 8192, ffn=14336, n_kv_head=8,
                           gated=True, dropout=False, source=_LLAMA3),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 128256, 8192, ffn=28672, n_kv_head=8,
                            gated=True, dropout=False, source=_LLAMA3),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 128256, 8192, ffn=53248, n_kv_head=8,
                             gated=True, dropout=False, source=_LLAMA3),
    "nemotron4-15b": ModelSpec("nemotron4-15b", 32, 6144, 48, 256000, 4096, ffn=24576, n_kv_head=8,
                               dropout=False, source="Parmar et al. 2024, 'Nemotron-4 15B Technical Report', "
                               "Table 1 (squared-ReLU MLP of 4h, as NVIDIA's benchmark configuration sets it)"),
    "nemotron4-340b": ModelSpec("nemotron4-340b", 96, 18432, 96, 256000, 4096, ffn=73728, n_kv_head=8,
                                dropout=False, source="NVIDIA 2024, 'Nemotron-4 340B Technical Report', Table 1 "
                                "(squared-ReLU MLP of 4h, as NVIDIA's benchmark configuration sets it)"),
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 32, 4096, 32, 32000, 4096, ffn=14336, n_kv_head=8,
                              gated=True, n_experts=8, top_k=2, dropout=False,
                              source="Jiang et al. 2024, 'Mixtral of Experts', Table 1"),
    # the course's own GPT (minipar.models.GPTConfig defaults)
    "course-gpt": ModelSpec("course-gpt", 2, 32, 2, 65, 32, dropout=False,
                            source="minipar.models.GPTConfig defaults"),
}


def from_gpt_config(config, name: str = "gpt") -> ModelSpec:
    """The spec of a :class:`minipar.models.GPTConfig` (for predictions of the course's runs). A
    mixture of experts (``moe_every``) is counted as experts in every block, as the spec has no
    other: with ``moe_every`` > 1 the prediction counts more expert work than the model does."""
    moe = {"n_experts": config.n_experts, "top_k": config.top_k} if getattr(config, "moe_every", 0) else {}
    return ModelSpec(name, config.n_layer, config.n_embd, config.n_head, config.vocab_size,
                     config.block_size, tied=config.tie_weights,
                     dropout=bool(config.dropout), source="minipar.models.GPTConfig", **moe)


def get_model(model) -> ModelSpec:
    """A spec, from a spec or a catalogue name (plain error listing the names otherwise)."""
    if isinstance(model, ModelSpec):
        return model
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; the catalogue has {sorted(MODELS)} "
                         "(add yours: plan.MODELS['name'] = plan.ModelSpec(...))")
    return MODELS[model]
