"""Moving activations and gradients between pipeline stages, so autograd spans ranks.

Autograd cannot follow a tensor from one process to another, so the graph is cut at each
stage boundary and stitched by hand (Huang et al. 2019; Narayanan et al. 2019):

the activation goes forward, its gradient comes back, and each stage's backward continues
the chain rule where the next stage's left off (notebook 03, "Autograd across ranks"). Ranks
are group-local and every transfer is recorded by :mod:`minipar.comm` with its bytes.
"""
from __future__ import annotations

import torch

from ..comm import Handle, irecv, isend


# Contract:
# ex03.A.async: ``send_activation`` and ``send_grad`` start a send of the tensor's values and
#     return its ``Handle`` without waiting for it.
# ex03.*.recorded: every transfer goes through ``minipar.comm`` (``isend``/``irecv``) and is
#     waited on before the step ends, so the trace records its bytes.
# ex03.*.group: every transfer runs over ``group``, with ``src``/``dst`` its ranks, passing ``tag``
#     and ``**labels`` through.
def send_activation(y: torch.Tensor, dst: int, group=None, tag: int = 0, **labels) -> Handle:
    """Start sending the values of stage output ``y`` to group rank ``dst``."""
    # >>> ex03 A
    return isend(y.detach(), dst, group, name="send_activation", tag=tag, **labels)
    # <<< ex03 A


# Contract:
# ex03.A.leaf: ``recv_activation`` returns, once it has arrived, a leaf that requires grad, so
#     that after this stage's backward its ``.grad`` is ∂L/∂(this input); ``recv_grad`` returns
#     the gradient itself.
# ex03.A.dtype: both receives return ``shape`` in the ``dtype`` asked, on ``device``.
def recv_activation(shape, src: int, group=None, dtype=torch.float32, device=None,
                    tag: int = 0, **labels) -> torch.Tensor:
    """Receive a stage input from group rank ``src``: a leaf tensor that requires grad, so
    that after the backward its ``.grad`` is the gradient to send back."""
    # >>> ex03 A
    x = torch.empty(shape, dtype=dtype, device=device)
    irecv(x, src, group, name="recv_activation", tag=tag, **labels).wait()
    return x.requires_grad_()
    # <<< ex03 A


# Contract:
# Given: as ``send_activation`` (ex03.A.async), for the gradient of a received activation.
def send_grad(grad: torch.Tensor, dst: int, group=None, tag: int = 0, **labels) -> Handle:
    """Start sending ``grad`` (the ``.grad`` of a received activation) back to group rank ``dst``."""
    # >>> ex03 A
    return isend(grad.detach(), dst, group, name="send_grad", tag=tag, **labels)
    # <<< ex03 A


# Contract:
# Given: as ``recv_activation`` (ex03.A.leaf, ex03.A.dtype), for the gradient of this stage's
#     output.
def recv_grad(shape, src: int, group=None, dtype=torch.float32, device=None,
              tag: int = 0, **labels) -> torch.Tensor:
    """Receive the gradient of this stage's output from group rank ``src`` (no grad needed)."""
    # >>> ex03 A
    g = torch.empty(shape, dtype=dtype, device=device)
    irecv(g, src, group, name="recv_grad", tag=tag, **labels).wait()
    return g
    # <<< ex03 A
