"""Cost of data parallelism: bytes per step, step time with and without overlap, staleness.

* Bytes. Averaging Ψ gradient values of b bytes with a ring all-reduce sends, per rank
  and per step (Patarasuk & Yuan 2009; Sergeev & Del Balso, "Horovod", 2018):

      2 (n-1)/n · Ψ · b

  the same whether it is done per parameter, per bucket or in one piece; only the number
  of messages (and so the latency term α) changes.
* Time. With K buckets of sizes N_k, the α-β model gives T_comm = Σ_k (2(n-1)α + 2(n-1)/n·N_k·β).
  Without overlap a step costs T_f + T_b + T_comm. With overlap (Li et al., VLDB 2020)
  the all-reduces run during backward, except the last bucket's, which can only start
  when backward ends: T ≈ T_f + max(T_b + T_last, T_comm).
* Staleness. In asynchronous SGD with W equally fast workers and one server, W-1 other
  updates land between a worker's pull and its push, so τ ≈ W-1 on average (Dean et al.
  2012; Lian et al., "Asynchronous Parallel Stochastic Gradient for Nonconvex
  Optimization", 2015, assume τ bounded by T and show a linear speed-up while T ≲ √K).
"""
from __future__ import annotations

from .collectives import alpha_beta_time, collective_bytes


def ddp_bytes_per_step(num_params: int, world_size: int, bytes_per_param: int = 4) -> float:
    """Bytes each rank sends to average ``num_params`` gradients once: 2(n-1)/n·Ψ·b."""
    return collective_bytes("all_reduce", num_params * bytes_per_param, world_size)


def ddp_comm_time(bucket_bytes: list[float], world_size: int, alpha: float, beta: float) -> float:
    """α-β time of all-reducing buckets of the given sizes one after another (seconds)."""
    return sum(alpha_beta_time("all_reduce", b, world_size, alpha, beta) for b in bucket_bytes)


def ddp_step_time(t_forward: float, t_backward: float, t_comm: float, t_last_bucket: float = 0.0,
                  overlap: bool = True) -> float:
    """Step time: ``T_f + T_b + T_comm`` without overlap, ``T_f + max(T_b + T_last, T_comm)`` with."""
    if not overlap:
        return t_forward + t_backward + t_comm
    return t_forward + max(t_backward + t_last_bucket, t_comm)


def expected_staleness(num_workers: int) -> float:
    """Mean staleness τ of asynchronous SGD with ``num_workers`` equally fast workers: W-1."""
    if num_workers < 1:
        raise ValueError("need at least one worker")
    return float(num_workers - 1)
