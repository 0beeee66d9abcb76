"""The straggler's layer costs under data parallelism: a layer runs on every replica of its
stage, and a synchronous step waits for the slowest, so its cost is the slowest replica's time,
not the replicas' sum (a sum would make a stage with more replicas look slower than it is, and
move layers for nothing). Observed on fixed clock readings, so nothing here depends on timing."""
import torch.distributed as dist

import minipar
from minipar.adapt import straggler


class _Readings:
    """A layer clock with readings set by hand: seconds by global layer index."""

    def __init__(self, seconds):
        self.seconds = seconds


def _costs():
    # dp2·pp2 on 4 ranks: ranks 0, 1 run layers 0-1 (replicas), ranks 2, 3 layers 2-3; rank 1 is slow
    r = dist.get_rank()
    mine = {0: [1.0, 2.0, 0, 0], 1: [3.0, 6.0, 0, 0], 2: [0, 0, 1.0, 1.0], 3: [0, 0, 2.0, 1.5]}[r]
    return straggler.costs(_Readings(mine), steps=2)


def test_a_layers_cost_is_its_slowest_replicas_time_per_step():
    """Per step (2 steps read): layers 0-1 cost rank 1's 1.5 and 3.0 s, layers 2-3 rank 3's 1.0
    and 0.75 s, on every rank."""
    for got in minipar.launch(_costs, 4):
        assert got == [1.5, 3.0, 1.0, 0.75], got
