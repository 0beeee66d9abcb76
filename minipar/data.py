"""Data for the course: a small real corpus, a synthetic one, and deterministic batches.

* :func:`corpus` — public-domain English verse and prose shipped with the package (Shakespeare's
  sonnets and soliloquies, Lincoln's Gettysburg Address), read per character by :class:`CharTokenizer`.
* :func:`synthetic_tokens` — a learnable sequence of any length, without a file.
* :func:`get_batch` — batch ``step`` of a run is a pure function of ``(seed, step)``, so a single
  process and any number of ranks draw exactly the same global batch.
* :func:`shard` — the slice of a global batch that one data-parallel rank sees.
"""
from __future__ import annotations

from importlib import resources

import torch


def corpus() -> str:
    """The shipped public-domain text (about 6 KB)."""
    return resources.files("minipar").joinpath("assets/corpus.txt").read_text(encoding="utf-8")


class CharTokenizer:
    """Characters <-> integer ids, the vocabulary being the sorted set of characters."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long, device="cpu")

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def corpus_tokens() -> tuple[torch.Tensor, CharTokenizer]:
    """The corpus encoded at the character level, with its tokenizer."""
    text = corpus()
    tok = CharTokenizer(text)
    return tok.encode(text), tok


def synthetic_tokens(n: int = 20_000, vocab_size: int = 32, seed: int = 0) -> torch.Tensor:
    """``n`` tokens from a fixed random Markov chain (each token has 3 likely successors)."""
    cpu = dict(generator=torch.Generator().manual_seed(seed), device="cpu")  # the same everywhere
    succ = torch.randint(0, vocab_size, (vocab_size, 3), **cpu)
    out = torch.empty(n, dtype=torch.long, device="cpu")
    out[0] = 0
    picks = torch.randint(0, 3, (n,), **cpu)
    noise = torch.rand(n, **cpu) < 0.1
    rand_tok = torch.randint(0, vocab_size, (n,), **cpu)
    for i in range(1, n):
        out[i] = rand_tok[i] if noise[i] else succ[out[i - 1], picks[i]]
    return out


def get_batch(tokens: torch.Tensor, batch_size: int, block_size: int, step: int,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step``: ``x`` (B, T) token windows and ``y`` the same shifted by one."""
    if len(tokens) <= block_size:
        raise ValueError(f"need more than block_size={block_size} tokens, have {len(tokens)}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - block_size, (batch_size,), generator=g, device="cpu")
    x = torch.stack([tokens[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + 1 + block_size] for s in starts.tolist()])
    return x, y


def batches(tokens: torch.Tensor, steps: int, batch_size: int, block_size: int,
            seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[get_batch(..., step) for step in range(steps)]``."""
    return [get_batch(tokens, batch_size, block_size, s, seed) for s in range(steps)]


def regression_batches(steps: int, batch_size: int, d_in: int = 16, d_out: int = 4,
                       seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of a fixed random nonlinear map ``y = tanh(x W1) W2`` plus noise (for the MLP)."""
    cpu = dict(generator=torch.Generator().manual_seed(seed), device="cpu")  # the same everywhere
    w1, w2 = torch.randn(d_in, 32, **cpu), torch.randn(32, d_out, **cpu) / 4
    xs = (torch.randn(batch_size, d_in, **cpu) for _ in range(steps))  # drawn one by one, with the noise
    return [(x, torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(batch_size, d_out, **cpu)) for x in xs]


def shard(t: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``t`` along ``dim`` (which ``world_size`` must divide).
    The shards of all ranks in rank order concatenate to ``t``: together the ranks see exactly
    the single-process batch."""
    if t.shape[dim] % world_size:
        raise ValueError(f"size {t.shape[dim]} along dim {dim} is not divisible by {world_size} ranks")
    return t.chunk(world_size, dim)[rank]
