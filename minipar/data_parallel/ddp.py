"""``DistributedDataParallel``: replicate a module, average its gradients during backward.

What the wrapper does (Li et al., "PyTorch Distributed", VLDB 2020):

1. At wrap time, broadcast every parameter and buffer from group rank 0, so all replicas
   start equal.
2. Register a hook on every trainable parameter that fires when its gradient has been
   accumulated. The hooks feed the :class:`~minipar.data_parallel.reducer.Reducer`, which
   all-reduces buckets of gradients (during backward with ``overlap=True``).
3. Queue a callback at the end of the backward pass that waits for the last all-reduce
   and writes the averages into ``.grad``: when ``loss.backward()`` returns, every rank
   holds ``1/n Σ_r g_r``, the gradient of the global mean loss.

Three versions, from the same class (see :data:`VERSIONS`):

* naive      ``bucket_cap_mb=None``:               one all-reduce per parameter, after backward
* bucketed   ``bucket_cap_mb=c,    overlap=False``: flat buckets of ~c MB, after backward
* overlapped ``bucket_cap_mb=c,    overlap=True``:  a bucket's all-reduce starts as it fills

Frozen parameters (``requires_grad=False``) get no hook and no all-reduce; a parameter
shared by two layers (tied weights) is one tensor, hooked and reduced once.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from .naive import allreduce_gradients, broadcast_module, trainable
from .reducer import Reducer

VERSIONS = {"naive": dict(bucket_cap_mb=None, overlap=False),
            "bucketed": dict(bucket_cap_mb=25.0, overlap=False),
            "overlapped": dict(bucket_cap_mb=25.0, overlap=True)}


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: ``DistributedDataParallel(model, group=None, bucket_cap_mb=25)``.
    ``group``: the replicas' process group (default: the world; ranks are group-local).
    ``bucket_cap_mb``: bucket size in MB (2**20 bytes); ``None`` is the naive version (one
    all-reduce per parameter after backward, whatever ``overlap`` says). ``overlap``: launch
    bucket all-reduces from the gradient hooks during backward. ``all_reduce_fn(tensor, group)``:
    sum in place with your own collective instead of the backend's. ``.module`` is the wrapped
    model; ``named_parameters()``, ``parameters()`` and ``state_dict()`` are its own."""

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float | None = 25.0,
                 overlap: bool = True, all_reduce_fn=None):
        super().__init__()
        if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb must be None (naive) or >= 0, got {bucket_cap_mb}")
        if all_reduce_fn is not None and not callable(all_reduce_fn):
            raise TypeError("all_reduce_fn must be a function (tensor, group) -> None")
        self.module, self.group, self.all_reduce_fn = module, group, all_reduce_fn
        self.bucket_cap_mb, self.overlap = bucket_cap_mb, overlap
        self._params = trainable(module.parameters())
        broadcast_module(module, src=0, group=group)
        self.reducer = None if bucket_cap_mb is None else Reducer(  # None: naive
            self._params, group, bucket_cap_mb or 0.0, overlap, all_reduce_fn)
        self.require_sync = True
        self._attach()

    # Contract:
    # Given: ``__init__`` has set ``self.module``, ``self.group``, ``self.all_reduce_fn``,
    #     ``self._params`` (the trainable parameters, each once), ``self.reducer`` (a ``Reducer``,
    #     or None for the naive version: ``allreduce_gradients`` after the backward) and
    #     ``self.require_sync`` (False inside ``no_sync()``), then calls ``_attach()`` once;
    #     ``remove_hooks()`` removes the handles in ``self._hooks``. The contract of the
    #     reducer's part (ex02.C) is on ``Reducer.__init__``; these methods are how DDP learns
    #     that a gradient is final and that a backward is over, also one that raised.
    def _attach(self) -> None:
        """Hook every trainable parameter (``self._hooks``, the handles :meth:`remove_hooks`
        removes) so that the reducer hears of each final gradient, and set up the state one
        backward needs."""
        # >>> ex02 C
        self._finish_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in self._params]
        # <<< ex02 C

    def _grad_hook(self, p: torch.Tensor) -> None:
        """``p.grad`` is final (accumulated): feed the reducer, once per backward make sure
        :meth:`_finish` runs when the backward ends; nothing under :meth:`no_sync`."""
        # >>> ex02 C
        if not self.require_sync:
            return
        if not self._finish_queued:  # first gradient of this backward pass
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if self.reducer is not None:
            self.reducer.grad_ready(p)
        # <<< ex02 C

    def _finish(self) -> None:
        """End of backward: every rank's gradients become the average."""
        # >>> ex02 C
        self._finish_queued = False
        if self.reducer is None:
            allreduce_gradients(self._params, self.group, self.all_reduce_fn)
        else:
            self.reducer.finish()
        # <<< ex02 C

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: inside, backward only accumulates into ``.grad`` locally;
        the first backward outside all-reduces the accumulated sum."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def forward(self, *args, **kwargs):
        # >>> ex02 C
        if self._finish_queued:  # the last backward raised before its end: forget it
            self._finish_queued = False
            if self.reducer is not None:
                self.reducer.reset()
        # <<< ex02 C
        return self.module(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    def remove_hooks(self) -> None:
        """Detach from the module (it keeps training as a plain, unsynchronised model)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
