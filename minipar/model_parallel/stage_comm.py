"""Moving activations and gradients between pipeline stages, so autograd spans ranks.

Autograd cannot follow a tensor from one process to another, so the graph is cut at each
stage boundary and stitched by hand (Huang et al. 2019; Narayanan et al. 2019):

the activation goes forward, its gradient comes back, and each stage's backward continues
the chain rule where the next stage's left off (notebook 03, "Autograd across ranks"). Ranks
are group-local and every transfer is recorded by :mod:`minipar.comm` with its bytes.

Sender and receiver agree on a message's bytes from one place, without exchanging them: its
shape is the boundary's (:func:`~minipar.model_parallel.partition.boundary_shapes`, the same on
every rank) and its dtype :func:`message_dtype` (the stages' parameters', whatever autocast
computes in).
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
