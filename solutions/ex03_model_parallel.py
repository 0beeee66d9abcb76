"""Exercise 03, solved: activations forward and gradients back between pipeline stages.

See ``exercises/ex03_model_parallel.py`` for the statement and
``minipar/pipeline/stage_comm.py`` for the library's version.
"""
import torch

from minipar.comm import Handle, irecv, isend


def send_activation(y: torch.Tensor, dst: int, group=None, tag: int = 0, **labels) -> Handle:
    """Start sending the values of stage output ``y`` to group rank ``dst``; return the Handle."""
    # only the values travel: the graph that produced y stays here for y.backward(grad)
    return isend(y.detach(), dst, group, name="send_activation", tag=tag, **labels)


def recv_activation(shape, src: int, group=None, dtype=torch.float32, device=None,
                    tag: int = 0, **labels) -> torch.Tensor:
    """Receive a stage input of ``shape`` from group rank ``src``: a leaf tensor that requires
    grad, so that after the backward its ``.grad`` is the gradient to send back."""
    x = torch.empty(shape, dtype=dtype, device=device)
    irecv(x, src, group, name="recv_activation", tag=tag, **labels).wait()
    return x.requires_grad_()   # a leaf: this stage's graph starts here


def send_grad(grad: torch.Tensor, dst: int, group=None, tag: int = 0, **labels) -> Handle:
    """Start sending ``grad`` (the ``.grad`` of a received activation) to group rank ``dst``."""
    return isend(grad.detach(), dst, group, name="send_grad", tag=tag, **labels)


def recv_grad(shape, src: int, group=None, dtype=torch.float32, device=None,
              tag: int = 0, **labels) -> torch.Tensor:
    """Receive the gradient of this stage's output (``shape``) from group rank ``src``."""
    g = torch.empty(shape, dtype=dtype, device=device)
    irecv(g, src, group, name="recv_grad", tag=tag, **labels).wait()
    return g
