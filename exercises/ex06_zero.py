"""Exercise 06: ZeRO, the two moves that remove redundancy.

Implement three of minipar.zero's own functions (same names and signatures); the grader
then runs the library's ZeRO stage 1 and stage 3 on *your* code and checks that they
train exactly like one process. Move data only with ``minipar.comm.reduce_scatter`` and
``minipar.comm.all_gather`` (flat tensors; they record the bytes for the grader).

Layout (``minipar/zero/flat.py``). A unit's parameters are one flat vector, zero-padded to
N·k elements, k = ⌈Ψ_u/N⌉; rank r owns elements [r·k, (r+1)·k).

1. ``sharded_step`` — stage 1 (P_os). For every unit u:
   a. reduce-scatter the gradients with ``op="avg"``: this rank's k elements of the mean
      over ranks of ``flat_grads[u]`` (write them into the rank's own slice of
      ``flat_grads[u]``: in place is allowed) and make them ``shards[u].grad``
      (cast to ``shards[u]``'s dtype if it differs);
   then call ``optimizer.step()`` once (it only knows the shards, so its state is 1/N);
   then for every unit all-gather the updated shards (cast to ``flat_params[u]``'s
   dtype) into ``flat_params[u]``.
2. ``gather_unit`` — stage 3, gather-before-use: ``full``'s storage may have been freed;
   give it back its bytes (``full.untyped_storage().resize_(nbytes)``), then all-gather
   every rank's ``shard`` into it. Return the Handle when ``async_op`` (the library
   prefetches the next unit that way), else None. Pass ``**labels`` on to all_gather.
3. ``free_unit`` — stage 3, free-after-use: release ``full``'s memory while keeping the
   tensor itself (the model's parameters are views into it): resize its storage to 0.

Grade with ``python -m minipar.grade ex06``.
"""
import torch

from minipar.comm import all_gather, group_rank, group_size, reduce_scatter  # noqa: F401


def sharded_step(flat_params, flat_grads, shards, optimizer, group=None) -> None:
    """One ZeRO-1 step over the units u (lists of the same length, same order on every rank).

    ``flat_params[u]``, ``flat_grads[u]``: the unit's full flat padded vectors (N·k
    elements); ``shards[u]``: the k-element leaf tensor the ``optimizer`` owns. Afterwards
    ``flat_params[u]`` holds every rank's updated shard.
    """
    raise NotImplementedError("Exercise 06: implement sharded_step (see the module docstring)")


def gather_unit(full: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False, **labels):
    """Re-allocate ``full``'s storage and all-gather every rank's ``shard`` into it;
    return the all-gather's Handle if ``async_op``."""
    raise NotImplementedError("Exercise 06: implement gather_unit (see the module docstring)")


def free_unit(full: torch.Tensor) -> None:
    """Release ``full``'s memory, keeping the tensor (and views into it) for the next gather."""
    raise NotImplementedError("Exercise 06: implement free_unit (see the module docstring)")
