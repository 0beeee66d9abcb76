"""Labels are one record, passed once: a pipeline's own ``stage`` label and the host staging
of a shared GPU's messages live side by side in one event.

Ranks that share a GPU talk over Gloo through host memory (``minipar.runtime.staging``): every
message is copied out and back, and each copy is an event with the operation's labels plus the
reserved ``staged`` key. A pipeline labels its messages with ``stage`` (its own stage number);
once, staging added ``stage=<operation>`` as a keyword beside them and every pipeline on a
shared GPU died with ``record() got multiple values for keyword argument 'stage'``. Here the
staged path runs on the CPU, with the pipeline's labels, and must train like one process.
"""
import pytest
import torch

import minipar
from minipar import data, reference
from minipar import model_parallel as mp
from minipar import pipeline as pp
from minipar.comm import p2p
from minipar.models import GPT, GPTConfig
from minipar.runtime import trace

# collected through tests/test_gpu_paths.py (the devices job of course.py test --gpu)
__all__ = ["staged",
           "test_a_staged_pipeline_trains_like_one_process",
           "test_staging_events_keep_the_pipelines_labels_and_add_their_own",
           "test_a_reserved_label_is_refused_by_name"]

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
BATCH, STEPS = 8, 2


def _batches():
    return data.batches(data.synthetic_tokens(1000), STEPS, BATCH, CFG.block_size)


def _staged_pipelines():
    """Rank function: a 1F1B pipeline and the naive model-parallel split, their messages
    staged through host memory (as on a shared GPU); the results and the staging events."""
    mark = trace.mark()
    out = {"1f1b": pp.train(GPT(CFG, seed=0), _batches(), reference.sgd(0.5), schedule="1f1b", microbatches=2),
           "naive": mp.train(GPT(CFG, seed=0), _batches(), reference.sgd(0.5))}
    out["events"] = [e for e in trace.since(mark) if "staged" in e["labels"]]
    return out


@pytest.fixture(scope="module")
def staged():
    return minipar.launch(_staged_pipelines, 2, device="cpu", transport="gloo-staged")


def test_a_staged_pipeline_trains_like_one_process(staged):
    want = reference.train_reference(GPT(CFG, seed=0), _batches(), reference.sgd(0.5), device="cpu")
    for name in ("1f1b", "naive"):
        got = {"losses": staged[1][name]["losses"],
               "params": {**staged[0][name]["params"], **staged[1][name]["params"]}}
        reference.assert_same_training(got, want, rtol=1e-5, atol=1e-6)


def test_staging_events_keep_the_pipelines_labels_and_add_their_own(staged):
    for r, out in enumerate(staged):
        evs = out["events"]
        assert {e["name"] for e in evs} == {"stage to host", "stage to device"}
        assert {e["kind"] for e in evs} == {"staging"}  # a copy, not an operation of its own
        ops = {e["labels"]["staged"] for e in evs}
        assert ops >= {"isend", "irecv"}, ops
        piped = [e for e in evs if "stage" in e["labels"]]  # the pipeline's own label, kept
        assert piped and {e["labels"]["stage"] for e in piped} <= {0, 1, 2, 3}, piped[:2]
        assert all(e["labels"]["dim"] for e in evs)


def _reserved():
    try:
        p2p.labels_for(None, {"staged": "mine"})
    except ValueError as e:
        return str(e)


def test_a_reserved_label_is_refused_by_name():
    assert "'staged' is reserved" in minipar.launch(_reserved, 1, device="cpu")[0]
