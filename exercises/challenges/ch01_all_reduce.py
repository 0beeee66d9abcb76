"""Challenge 01: an all-reduce that beats gather-to-one, in bytes and in modelled time.

Write ``all_reduce(tensor, group=None)``: sum ``tensor`` over the ranks of ``group`` in
place (every rank ends with the same sum, shape kept) and return it. Move data only with
``minipar.comm``'s recorded point-to-point calls (``exchange``, ``send``/``recv``,
``isend``/``irecv``), so that the trace holds every byte; any algorithm is welcome.

Measured on 4 ranks, one all-reduce of a 1 MiB fp32 tensor, from the recorded trace:

* **bandwidth**: the busiest rank sends at most 2(n-1)/n of the tensor's bytes
  (1.5 MiB at n = 4). Gather-to-one (notebook 01's ``naive_all_reduce``) sends 3 MiB from
  rank 0.
* **modelled time**: at most half the naive's. Each recorded call of a rank costs
  α + β·max(bytes sent, bytes received) in that call (α = 5 µs, 1/β = 10 GB/s, a
  fast link); a rank's time is the sum over its calls, the all-reduce's is the slowest rank's.
  The naive's rank 0 makes 2(n-1) calls of the whole tensor.
* **your own**: the trace must not show minipar's collectives (``comm.ring_all_reduce`` and
  the other ring and tree functions of exercise 01, or a native collective such as
  ``comm.all_reduce``): the library already has a ring; the challenge is to write one, or
  another algorithm, yourself.
* **correct**: on 2 and 4 ranks, for sizes that 4 does not divide (10 and 3 elements too),
  within fp32 rounding (rtol 1e-5), and every rank receives at least the tensor's size
  (the data really moved through ``minipar.comm``).

Grade it with ``python -m minipar.grade ch01`` (``minipar.hint("ch01")`` if stuck).
"""
import torch

from minipar import comm


def all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    raise NotImplementedError("Challenge 01: all_reduce")
