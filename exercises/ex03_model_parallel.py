"""Exercise 03: send activations forward and gradients back between pipeline stages.

Implement the four functions of ``minipar.pipeline.stage_comm`` (same names and
signatures). Autograd cannot follow a tensor from one process to another, so the graph is
cut at every stage boundary and stitched by hand:

* forward: stage s sends the *values* of its output ``y`` to stage s+1; stage s+1 receives
  them into a fresh tensor ``x`` that is a **leaf requiring grad**, and runs its layers on it;
* backward: after stage s+1's backward, ``x.grad`` is ∂L/∂x = ∂L/∂y; it is sent back, and
  stage s receives it and calls ``y.backward(grad)``, continuing the chain rule.

Move data only with ``minipar.comm.isend`` / ``minipar.comm.irecv`` (they return a Handle
with ``.wait()`` and record every transfer's bytes in the trace). Pass ``tag`` and
``**labels`` through to them. Sends must not block (return the Handle); receives return
only once the data is there. ``device=None`` means the CPU.

The naive model-parallel split (``minipar.model_parallel``) and the pipeline executor
(``minipar.pipeline.Pipeline``) both take ``comm=`` a module with these four functions,
so your code can drive them. Grade it with ``python -m minipar.grade ex03``.
"""
import torch

from minipar.comm import Handle, irecv, isend  # noqa: F401 - for your code


def send_activation(y: torch.Tensor, dst: int, group=None, tag: int = 0, **labels) -> Handle:
    """Start sending the values of stage output ``y`` to group rank ``dst``; return the Handle."""
    raise NotImplementedError("Exercise 03: implement send_activation (see the module docstring)")


def recv_activation(shape, src: int, group=None, dtype=torch.float32, device=None,
                    tag: int = 0, **labels) -> torch.Tensor:
    """Receive a stage input of ``shape`` from group rank ``src``: a leaf tensor that requires
    grad, so that after the backward its ``.grad`` is the gradient to send back."""
    raise NotImplementedError("Exercise 03: implement recv_activation (see the module docstring)")


def send_grad(grad: torch.Tensor, dst: int, group=None, tag: int = 0, **labels) -> Handle:
    """Start sending ``grad`` (the ``.grad`` of a received activation) to group rank ``dst``."""
    raise NotImplementedError("Exercise 03: implement send_grad (see the module docstring)")


def recv_grad(shape, src: int, group=None, dtype=torch.float32, device=None,
              tag: int = 0, **labels) -> torch.Tensor:
    """Receive the gradient of this stage's output (``shape``) from group rank ``src``."""
    raise NotImplementedError("Exercise 03: implement recv_grad (see the module docstring)")
