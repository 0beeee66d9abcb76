"""A multi-layer perceptron: the smallest model with several layers to split or replicate."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """``Linear -> ReLU -> ... -> Linear`` with sizes ``sizes``; deterministic from ``seed``.
    ``model.layers()`` lists the Linear+activation units in order for pipeline splitting."""

    def __init__(self, sizes=(16, 64, 64, 4), seed: int = 0):
        super().__init__()
        if len(sizes) < 2:
            raise ValueError("an MLP needs at least an input and an output size")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hidden = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(sizes[:-2], sizes[1:-1])]
            self.net = nn.Sequential(*hidden, nn.Linear(sizes[-2], sizes[-1]))

    def layers(self) -> list[nn.Module]:
        return list(self.net)

    def forward(self, x, targets=None):
        out = self.net(x)
        return out if targets is None else F.mse_loss(out, targets)
