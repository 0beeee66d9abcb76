"""Exercise 02, solved: naive all-reduce of gradients, buckets, and the overlapping reducer.

See ``exercises/ex02_data_parallel.py`` for the statement and ``minipar/data_parallel/``
for the library's versions.
"""
import torch

from minipar import comm
from minipar.data_parallel.buckets import Bucket
from minipar.data_parallel.naive import trainable


def allreduce_gradients(params, group=None, all_reduce_fn=None) -> None:
    """Average ``p.grad`` over the ranks of ``group`` for every trainable parameter, in place.
    A parameter without a gradient on this rank takes part with zeros."""
    n = comm.group_size(group)
    for p in trainable(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if all_reduce_fn is None:
            comm.all_reduce(p.grad, op="avg", group=group, name="grad_all_reduce")
        else:
            all_reduce_fn(p.grad, group)  # a sum
            p.grad /= n


def assign_buckets(params, bucket_cap_mb: float) -> list[list[torch.nn.Parameter]]:
    """Group ``params`` into buckets of at most ``bucket_cap_mb`` MB, last parameter first."""
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
    cap = bucket_cap_mb * 2**20
    buckets, size = [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class Reducer:
    """Average the gradients of ``params`` over ``group``, bucket by bucket."""

    def __init__(self, params, group=None, bucket_cap_mb: float = 25.0, overlap: bool = True,
                 all_reduce_fn=None):
        self.group, self.overlap, self.all_reduce_fn = group, overlap, all_reduce_fn
        self.n = comm.group_size(group)
        self.buckets = [Bucket(ps) for ps in assign_buckets(params, bucket_cap_mb)]
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.reset()

    def reset(self) -> None:
        """Forget the last backward pass: no gradient ready, no bucket launched."""
        self.pending = [len(b.params) for b in self.buckets]
        self.ready: set[int] = set()
        self.next_bucket = 0
        self.handles: list = []

    def _launch_in_order(self) -> None:
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            bucket = self.buckets[self.next_bucket]
            if self.all_reduce_fn is not None:
                self.all_reduce_fn(bucket.buffer, self.group)  # sums now; divided in finish
            else:
                self.handles.append(comm.all_reduce(bucket.buffer, op="avg", group=self.group,
                                                    async_op=True, name="grad_all_reduce"))
            self.next_bucket += 1

    def grad_ready(self, p: torch.nn.Parameter) -> None:
        """``p.grad`` is final: pack it; with overlap, launch every bucket now complete, in order."""
        if id(p) in self.ready:
            return
        self.ready.add(id(p))
        i = self.bucket_of[id(p)]
        self.buckets[i].pack(p)
        self.pending[i] -= 1
        if self.overlap:
            self._launch_in_order()

    def finish(self) -> None:
        """Pack missing gradients as zeros, launch the rest in order, wait, unpack, reset."""
        for i, bucket in enumerate(self.buckets):
            for p in bucket.params:
                if id(p) not in self.ready:
                    bucket.pack(p)  # zeros when p.grad is None
            self.pending[i] = 0
        self._launch_in_order()
        for h in self.handles:
            h.wait()
        for bucket in self.buckets:
            if self.all_reduce_fn is not None:
                bucket.buffer /= self.n
            bucket.unpack()
        self.reset()
