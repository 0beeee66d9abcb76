"""An LSTM language model: embedding -> LSTM -> dense head.

The model of the classic model-parallel examples (the LSTM language models of Zaremba
et al. 2014 and of GNMT): on two devices the embedding and LSTM sit on one and the
large vocabulary head on the other.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .gpt import lm_loss


class LSTMLM(nn.Module):
    def __init__(self, vocab_size: int = 65, n_embd: int = 32, hidden: int = 64,
                 num_layers: int = 1, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab_size, n_embd)
            self.lstm = nn.LSTM(n_embd, hidden, num_layers=num_layers, batch_first=True)
            self.head = nn.Linear(hidden, vocab_size)

    def forward(self, idx, targets=None):
        h, _ = self.lstm(self.embed(idx))
        logits = self.head(h)
        return logits if targets is None else lm_loss(logits, targets)
