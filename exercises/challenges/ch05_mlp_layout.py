"""Challenge 05: lay out an MLP over 4 ranks: a quarter of the memory, one activation's traffic.

The MLP is y = gelu(x W1ᵀ + b1) W2ᵀ + b2 with W1 (4h, h), b1 (4h), W2 (h, 4h), b2 (h);
h = 32. Every rank gets the whole input x (4, 8, h) and must return the whole output y.
Write two functions:

* ``shard(w1, b1, w2, b2, rank, t)``: what rank ``rank`` of ``t`` keeps (a tuple of tensors,
  any layout you choose);
* ``forward(x, shards, group=None)``: y on this rank, differentiable: ``y.backward(dy)`` must
  leave ∂L/∂x in ``x.grad``, the same on every rank. Communicate only with ``minipar.comm``'s
  recorded calls (``minipar.tensor_parallel``'s operators f, g, gather, ... use them too; its
  layers are the answer, and a file that imports them is refused).

Measured on t = 4 ranks, one forward and one backward:

* **correct**: y and ∂L/∂x equal the single-device MLP's (rtol 1e-5, atol 1e-5);
* **memory**: the tensors ``shard`` keeps take at most a quarter of W1, b1 and W2, plus b2
  whole: 8,448 bytes (the replicated MLP: 33,408);
* **traffic**: each rank sends at most 12,288 bytes in the forward and backward together,
  the cost of one all-reduce of the activation x per direction (2(t-1)/t · 4,096 B each).

Notebook 05, "Two ways to split Y = XA" and "Column then row", has the ideas.
Grade it with ``python -m minipar.grade ch05`` (``minipar.hint("ch05")`` if stuck).
"""
import torch

from minipar import comm


def shard(w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, rank: int, t: int):
    raise NotImplementedError("Challenge 05: shard")


def forward(x: torch.Tensor, shards, group=None) -> torch.Tensor:
    raise NotImplementedError("Challenge 05: forward")
