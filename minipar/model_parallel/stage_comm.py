"""Moving activations and gradients between pipeline stages, so autograd spans ranks.

Autograd cannot follow a tensor from one process to another, so the graph is cut at each
stage boundary and stitched by hand (Huang et al. 2019; Narayanan et al. 2019):

* forward: stage s sends its output ``y`` (detached: only values travel) to stage s+1,
  which receives it into a fresh **leaf tensor with requires_grad**, ``x``. Stage s+1's
  graph starts at ``x``.
* backward: after stage s+1's backward, ``x.grad = ∂L/∂x``, which is exactly ``∂L/∂y``
  on stage s. Stage s receives it and calls ``y.backward(grad)``, continuing the chain
  rule where the previous rank left off.

Sends are non-blocking (a :class:`~minipar.comm.Handle` to wait on later) so a stage
never stalls on a slow receiver; receives block until the data is there. Ranks are
group-local and every transfer is recorded by :mod:`minipar.comm` with its bytes.
"""
from __future__ import annotations

import torch

from ..comm import Handle, irecv, isend


def send_activation(y: torch.Tensor, dst: int, group=None, tag: int = 0, **labels) -> Handle:
    """Start sending the values of stage output ``y`` to group rank ``dst``."""
    # >>> ex03 A
    return isend(y.detach(), dst, group, name="send_activation", tag=tag, **labels)
    # <<< ex03 A


def recv_activation(shape, src: int, group=None, dtype=torch.float32, device=None,
                    tag: int = 0, **labels) -> torch.Tensor:
    """Receive a stage input from group rank ``src``: a leaf tensor that requires grad, so
    that after the backward its ``.grad`` is the gradient to send back."""
    # >>> ex03 A
    x = torch.empty(shape, dtype=dtype, device=device)
    irecv(x, src, group, name="recv_activation", tag=tag, **labels).wait()
    return x.requires_grad_()
    # <<< ex03 A


def send_grad(grad: torch.Tensor, dst: int, group=None, tag: int = 0, **labels) -> Handle:
    """Start sending ``grad`` (the ``.grad`` of a received activation) back to group rank ``dst``."""
    # >>> ex03 A
    return isend(grad.detach(), dst, group, name="send_grad", tag=tag, **labels)
    # <<< ex03 A


def recv_grad(shape, src: int, group=None, dtype=torch.float32, device=None,
              tag: int = 0, **labels) -> torch.Tensor:
    """Receive the gradient of this stage's output from group rank ``src`` (no grad needed)."""
    # >>> ex03 A
    g = torch.empty(shape, dtype=dtype, device=device)
    irecv(g, src, group, name="recv_grad", tag=tag, **labels).wait()
    return g
    # <<< ex03 A
