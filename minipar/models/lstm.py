"""An LSTM language model, embedding -> LSTM -> dense head: the model of the classic
model-parallel examples (Zaremba et al. 2014, GNMT; :mod:`minipar.model_parallel`)."""
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
        logits = self.head(self.lstm(self.embed(idx))[0])
        return logits if targets is None else lm_loss(logits, targets)
