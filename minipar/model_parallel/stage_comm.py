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

Sender and receiver must agree on a message's bytes without exchanging them: its shape is
the boundary's (:func:`~minipar.model_parallel.partition.boundary_shapes`, computed from the
same model on every rank) and its dtype is :func:`message_dtype`, the stages' parameters'
whatever autocast computes in (an LSTM's output is bf16 under bf16 autocast, a GPT's
residual stream stays fp32): the sender casts to it, the receiver allocates it.
"""
from __future__ import annotations

import torch

from ..comm import Handle, irecv, isend


def message_dtype(*stages: torch.nn.Module) -> torch.dtype:
    """The dtype every message across a stage boundary travels in, activations forward and
    gradients back: the stages' floating-point parameters' (fp32 master weights under mixed
    precision, float64 for a float64 model; fp32 for a stage without parameters). Every
    user of this module reads it here, on both sides of every boundary. Stages whose
    parameters disagree are refused: there would be no one dtype to agree on."""
    kinds = {p.dtype for s in stages for p in s.parameters() if p.is_floating_point()}
    if len(kinds) > 1:
        raise ValueError(f"stage parameters in {sorted(map(str, kinds))}: a pipeline's messages need one dtype")
    return kinds.pop() if kinds else torch.float32


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
