"""Adaptive re-partitioning (minipar.pipeline.adaptive): re-cut a pipeline mid-training.

A GPT with a large-vocabulary head (the loss over 4096 classes costs several blocks) and a
deliberately bad first cut (rank 0 holds only the embedding) trains 2 steps, times its
layers on their ranks, re-partitions by time, moves the layers (parameters and SGD
momentum) point-to-point and trains 2 more steps. Checked: losses every step and final
parameters equal the uninterrupted single-process run (rtol 1e-5, atol 1e-6: the cut only
changes where the arithmetic runs), the new cut is partition() of the measured times on
every rank, and the bytes sent under "repartition" are exactly those of the moved layers'
parameters and momentum. (Step times before/after are measured, not asserted: they are
the notebook's and the report's, on a quiet machine.)
"""
import torch

from minipar import data
from minipar.models import GPT, GPTConfig
from minipar import pipeline
from minipar.pipeline import adaptive, partition
from minipar.reference import assert_same_training, train_reference

CFG = GPTConfig(vocab_size=4096, block_size=32, n_layer=6, n_head=2, n_embd=32)
BATCHES = data.batches(data.synthetic_tokens(8000, CFG.vocab_size), 4, 8, CFG.block_size)
BAD = [0, 1, CFG.n_layer + 2]


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_repartition_keeps_training_and_moves_layers():
    """Re-cut after 2 steps: same losses and parameters as one process; new cut = partition(times); bytes moved = the layers'."""
    res = pipeline.run(GPT(CFG, seed=0), BATCHES, 2, optimizer=sgd_momentum, microbatches=2,
                       probe_steps=2, bounds=BAD)
    want = train_reference(GPT(CFG, seed=0), BATCHES, sgd_momentum)
    assert_same_training(res, want, 1e-5, 1e-6)
    m0, m1 = res.measured
    assert m0["bounds_before"] == BAD and m0["bounds_after"] == m1["bounds_after"]
    assert m0["layer_times"] == m1["layer_times"]
    new = m0["bounds_after"]
    assert new == partition(m0["layer_times"], 2) and new != BAD
    layers = GPT(CFG).layers()
    moved = [j for j in range(len(layers)) if adaptive.owners(BAD, 2)[j] != adaptive.owners(new, 2)[j]]
    want_bytes = 2 * sum(q.numel() * 4 for j in moved for q in layers[j].parameters())   # param + momentum
    sent = sum(e["bytes_sent"] for r in res.trace.ranks for e in r if e.get("name") == "repartition")
    assert sent == want_bytes > 0
