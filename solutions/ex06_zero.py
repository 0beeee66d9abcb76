"""Exercise 06, solved: ZeRO stage 1's sharded step, stage 3's gather and free.

See ``exercises/ex06_zero.py`` for the statement and ``minipar/zero/stage1.py`` and
``minipar/zero/stage3.py`` for the library's versions.
"""
import torch

from minipar.comm import all_gather, group_rank, reduce_scatter


def sharded_step(flat_params, flat_grads, shards, optimizer, group=None) -> None:
    """One ZeRO-1 step over the units u (lists of the same length, same order on every rank).

    ``flat_params[u]``, ``flat_grads[u]``: the unit's full flat padded vectors (N·k
    elements); ``shards[u]``: the k-element leaf tensor the ``optimizer`` owns. Afterwards
    ``flat_params[u]`` holds every rank's updated shard.
    """
    r = group_rank(group)
    for grad, shard in zip(flat_grads, shards):
        k = shard.numel()
        mine = grad[r * k:(r + 1) * k]                  # this rank's slice, a view
        reduce_scatter(mine, grad, op="avg", group=group)
        shard.grad = mine.to(shard.dtype)               # no copy when the dtypes agree
    optimizer.step()                                    # state exists for the shards only
    for full, shard in zip(flat_params, shards):
        all_gather(full, shard.detach().to(full.dtype), group=group)


def gather_unit(full: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False, **labels):
    """Re-allocate ``full``'s storage and all-gather every rank's ``shard`` into it;
    return the all-gather's Handle if ``async_op``."""
    full.untyped_storage().resize_(full.numel() * full.element_size())
    return all_gather(full, shard.detach().to(full.dtype), group=group, async_op=async_op, **labels)


def free_unit(full: torch.Tensor) -> None:
    """Release ``full``'s memory, keeping the tensor (and views into it) for the next gather."""
    full.untyped_storage().resize_(0)
