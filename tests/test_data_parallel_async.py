"""Asynchronous SGD with a parameter server, and the data-sharding sampler.

One launch of 3 ranks (a server and 2 workers) runs: the synchronous server (equal to the
single process on the workers' batches together), the asynchronous server on a sub-group
of one worker (equal to plain sequential SGD, staleness 0), the asynchronous server with
a straggler, unbounded and with ``max_staleness=1``.
"""
import copy
import importlib

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, reference
from minipar.runtime import trace
from minipar.data_parallel import ShardedBatchSampler, parameter_server
from minipar.models import MLP
from minipar.strategy import to_device

RTOL, ATOL = 1e-5, 1e-6
STEPS = 6
_ALL = data.regression_batches(48, 8, seed=1)
BATCHES = _ALL[:40]  # batch i of 8 samples
EVAL = tuple(torch.cat(t) for t in zip(*_ALL[40:]))  # 64 held-out samples, same function


# the synchronous server's step k averages the workers' batches 2k and 2k+1: one global batch of 16
JOINED = [tuple(torch.cat(t) for t in zip(BATCHES[2 * k], BATCHES[2 * k + 1])) for k in range(STEPS)]


def _ps_runs(model):
    """Every run on the rank's device (the GPU under ``course.py test --gpu``): the model, the
    batches and the evaluation batch are moved there, as ``strategy.on_device`` does for ``run``."""
    here = minipar.device()
    model, joined, eval_batch = to_device(model, here), to_device(JOINED, here), to_device(EVAL, here)
    batches = to_device(BATCHES, here)

    def batch_fn(i):
        return batches[i % len(batches)]
    out = {}
    opt = reference.sgd(0.1)
    out["sync"] = parameter_server(copy.deepcopy(model), batch_fn, STEPS, opt, synchronous=True)
    pair = dist.new_group([0, 1])  # every rank creates the group; ranks 0 and 1 use it
    if dist.get_rank() < 2:
        out["single"] = parameter_server(copy.deepcopy(model), batch_fn, STEPS, opt, group=pair)
    dist.barrier()
    since = len(trace.events())
    out["async"] = parameter_server(copy.deepcopy(model), batch_fn, 100, reference.sgd(0.2),
                                    delays=[0.0, 0.04],
                                    eval_batch=eval_batch)
    out["async_sent"] = sum(e["bytes_sent"] for e in trace.events()[since:] if e["name"] == "push")
    out["bounded"] = parameter_server(copy.deepcopy(model), batch_fn, 100, opt, delays=[0.0, 0.04],
                                      max_staleness=1)
    ps = importlib.import_module("minipar.data_parallel.parameter_server")   # the module: its strategy API
    out["train sync"] = ps.train(copy.deepcopy(model), joined, opt, synchronous=True)
    out["train async"] = ps.train(copy.deepcopy(model), joined, opt)
    return out


def test_parameter_server():
    model = MLP(seed=2)
    server, w1, w2 = minipar.launch(_ps_runs, 3, args=(model,), timeout=120)
    # synchronous: step k averages the workers' batches 2k and 2k+1 = one batch of 16
    want = reference.train_reference(copy.deepcopy(model), JOINED, reference.sgd(0.1))
    reference.assert_same_training(server["sync"], want, rtol=RTOL, atol=ATOL)
    # the strategy's train on those global batches, each worker on its half: the same run, bit for bit
    sync = server["train sync"]
    assert sync["losses"] == server["sync"]["losses"] and sync["params"].keys() == server["sync"]["params"].keys()
    assert all(torch.equal(v, server["sync"]["params"][k]) for k, v in sync["params"].items())
    assert w1["train sync"]["losses"] is None and w1["train sync"]["measured"]["gradients"] == STEPS
    assert sync["measured"]["updates"] == STEPS and sync["measured"].bytes_by_dim["dp"] > 0
    # asynchronous: one update per half, 2 per global batch
    async_ = server["train async"]
    assert async_["measured"]["updates"] == len(async_["losses"]) == len(async_["measured"]["staleness"]) == 2 * STEPS
    assert server["sync"]["staleness"] == [0] * 2 * STEPS
    # one worker, asynchronous: plain sequential SGD
    want = reference.train_reference(copy.deepcopy(model), BATCHES[:STEPS], reference.sgd(0.1))
    reference.assert_same_training(server["single"], want, rtol=RTOL, atol=ATOL)
    assert server["single"]["staleness"] == [0] * STEPS
    # a straggler: the fast worker pushes most gradients; staleness is measured per update
    a = server["async"]
    assert a["updates"] == 100 and len(a["staleness"]) == 100 and a["dropped"] == 0
    fast, slow = a["workers"].count(1), a["workers"].count(2)
    assert fast + slow == 100 and fast > 2 * slow, (fast, slow)
    assert max(a["staleness"]) >= 2, "the straggler's gradients should be stale"
    assert a["eval_losses"][-1] < a["eval_losses"][0]
    # the workers push [version, loss, grad]: (Ψ+2)·4 bytes per gradient
    psi = sum(p.numel() for p in model.parameters())
    assert w1["async_sent"] == w1["async"]["gradients"] * (psi + 2) * 4
    # bounded: no applied gradient older than 1 version; too-stale ones were dropped
    b = server["bounded"]
    assert b["updates"] == 100 and max(b["staleness"]) <= 1 and b["dropped"] >= 1, b["dropped"]
    assert cost.expected_staleness(2) == 1.0


def test_sampler_shards_are_the_global_batch():
    n, B, N = 4, 8, 70
    samplers = [ShardedBatchSampler(N, B, rank=r, num_replicas=n, seed=3) for r in range(n)]
    single = ShardedBatchSampler(N, B, rank=0, num_replicas=1, seed=3)
    per_rank = [list(s) for s in samplers]
    assert len(single) == N // B and all(len(p) == N // B for p in per_rank)
    for step, global_batch in enumerate(single):
        shards = [p[step] for p in per_rank]
        assert all(len(s) == B // n for s in shards)
        assert sum(shards, []) == global_batch  # disjoint, in rank order, = single process
    seen = sum((b for b in single), [])
    assert len(set(seen)) == len(seen) == (N // B) * B
    assert [list(s) for s in samplers] == per_rank  # deterministic
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != per_rank[0]
    last = ShardedBatchSampler(N, B, rank=1, num_replicas=n, shuffle=False, drop_last=False)
    assert list(last)[-1] == [65]  # the 6 leftover samples, cut evenly in 4: one each
    loader = torch.utils.data.DataLoader(torch.arange(N) * 10, batch_sampler=samplers[2])
    assert [b.tolist() for b in loader] == [[10 * i for i in s] for s in samplers[2]]
    with pytest.raises(ValueError, match="not divisible"):
        ShardedBatchSampler(N, 6, rank=0, num_replicas=4)
