"""Exercise 02: data parallelism, from a plain all-reduce to overlapped buckets.

Three pieces of ``minipar.data_parallel``, same names and signatures. The library's
``DistributedDataParallel`` uses your code when you pass it in (the notebook does), and
``python -m minipar.grade ex02`` grades it.

A. ``allreduce_gradients(params, group)`` — naive data parallelism. After backward, every
   rank holds the gradient of the mean loss over *its own* shard. Replace each ``p.grad``
   by the average over the ranks of ``group``: with equal shards that is exactly the
   gradient the single process would compute on the whole batch. One all-reduce per
   parameter. Skip frozen parameters (``requires_grad=False``); a tied parameter appears
   once in ``model.parameters()`` already. Use ``minipar.comm.all_reduce(t, op="avg",
   group=group, name="grad_all_reduce")`` (recorded), or ``all_reduce_fn(t, group)`` when
   given (it *sums* in place: divide by n yourself).

B. ``assign_buckets(params, bucket_cap_mb)`` — walk the parameters in **reverse** order
   (backward produces the last layer's gradients first) and fill buckets: start a new one
   when adding a parameter would take the current bucket past ``bucket_cap_mb · 2**20``
   bytes. Every bucket has at least one parameter. Raise ``ValueError`` for a negative cap.

C. ``Reducer`` — all-reduce the buckets *while backward runs*. DDP calls
   ``grad_ready(p)`` from a hook as soon as ``p.grad`` is final, and ``finish()`` when
   backward is over. In ``grad_ready``: copy the gradient into its bucket
   (``bucket.pack(p)``), count it, and when a bucket is complete launch its all-reduce
   asynchronously (``h = minipar.comm.all_reduce(bucket.buffer, op="avg", group=...,
   async_op=True, name="grad_all_reduce")``, keep ``h``) — but only in bucket order 0, 1,
   2, ...: every rank must issue its collectives in the same order. If ``overlap`` is
   False, launch nothing there and reduce every bucket in ``finish``. In ``finish``: pack
   the parameters that got no gradient (zeros), launch what is left in order, ``wait()``
   every handle, copy the buckets back (``bucket.unpack()``) and ``reset()``.
"""
import torch

from minipar import comm  # noqa: F401 - for your code
from minipar.data_parallel.buckets import Bucket
from minipar.data_parallel.naive import trainable  # noqa: F401 - trainable(params): requires_grad, once each


def allreduce_gradients(params, group=None, all_reduce_fn=None) -> None:
    """Average ``p.grad`` over the ranks of ``group`` for every trainable parameter, in place.
    A parameter without a gradient on this rank takes part with zeros."""
    raise NotImplementedError("Exercise 02 A: implement allreduce_gradients (see the module docstring)")


def assign_buckets(params, bucket_cap_mb: float) -> list[list[torch.nn.Parameter]]:
    """Group ``params`` into buckets of at most ``bucket_cap_mb`` MB, last parameter first."""
    raise NotImplementedError("Exercise 02 B: implement assign_buckets (see the module docstring)")


class Reducer:
    """Average the gradients of ``params`` over ``group``, bucket by bucket (see C above)."""

    def __init__(self, params, group=None, bucket_cap_mb: float = 25.0, overlap: bool = True,
                 all_reduce_fn=None):
        self.group, self.overlap, self.all_reduce_fn = group, overlap, all_reduce_fn
        self.n = comm.group_size(group)
        self.buckets = [Bucket(ps) for ps in assign_buckets(params, bucket_cap_mb)]
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.reset()

    def reset(self) -> None:
        """Forget the last backward pass: no gradient ready, no bucket launched."""
        self.pending = [len(b.params) for b in self.buckets]  # gradients still to come
        self.ready: set[int] = set()                          # id(p) of the ready ones
        self.next_bucket = 0                                  # next bucket to launch
        self.handles: list = []                               # in-flight all-reduces

    def grad_ready(self, p: torch.nn.Parameter) -> None:
        """``p.grad`` is final: pack it; with overlap, launch every bucket now complete, in order.
        (With ``all_reduce_fn``, call it instead: it sums synchronously; divide in finish.)"""
        raise NotImplementedError("Exercise 02 C: implement Reducer.grad_ready")

    def finish(self) -> None:
        """Pack missing gradients as zeros, launch the rest in order, wait, unpack, reset."""
        raise NotImplementedError("Exercise 02 C: implement Reducer.finish")
