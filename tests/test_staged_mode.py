"""The shared GPU's placement, taken on the CPU: ``transport="gloo-staged"``.

Ranks that share a GPU talk over Gloo through a host copy out and back; launched with
``transport="gloo-staged"`` (or ``MINIPAR_TRANSPORT=gloo-staged``) CPU ranks make the same
copies, with the same events and labels, so CI runs that path. Here: what the placement says,
and that a staged run counts and measures what the unstaged one does (a host copy is a
``staging`` event, never an operation: ZeRO per parameter's step makes 3 collectives per unit,
staged or not, where the shared GPU once counted 9).
"""
import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import data
from minipar.models import GPT, GPTConfig
from minipar.runtime import backend, trace
from minipar.runtime.backend import BackendError, place
from minipar.zero import fully_shard, padded_unit_sizes

# collected through tests/test_gpu_paths.py (the devices job of course.py test --gpu)
__all__ = ["test_the_placement_is_decided_once_and_every_transport_is_chosen_by_name",
           "test_the_ranks_read_the_placement_launch_decided",
           "test_a_staged_copy_is_not_counted_as_a_collective"]

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def test_the_placement_is_decided_once_and_every_transport_is_chosen_by_name(monkeypatch):
    cpu, staged = place(2, "cpu"), place(2, "cpu", transport="gloo-staged")
    assert (cpu.transport, cpu.clock, cpu.synchronize) == ("gloo", "host", False)
    assert (staged.transport, staged.clock, staged.device, staged.backend) == ("gloo-staged", "host", "cpu", "gloo")
    assert "transport='gloo-staged'" in staged.reason
    shared, nccl = place(4, "cuda", gpus=1), place(2, "cuda", gpus=2)
    assert (shared.transport, shared.clock, shared.synchronize) == ("gloo-staged", "host", True)
    assert (nccl.transport, nccl.clock) == ("nccl", "device")
    assert place(2, "cuda", gpus=2, transport="gloo-staged").transport == "gloo-staged"
    with pytest.raises(BackendError, match="transport='nccl' cannot carry"):
        place(2, "cpu", transport="nccl")
    with pytest.raises(BackendError, match="transport='gloo' cannot carry"):
        place(4, "cuda", gpus=1, transport="gloo")
    with pytest.raises(BackendError, match="transport must be one of"):
        place(2, "cpu", transport="tcp")
    monkeypatch.setenv(backend.TRANSPORT_ENV, "staged")
    with pytest.raises(BackendError, match="MINIPAR_TRANSPORT must be one of"):
        minipar.launch(_placement, 2, device="cpu")


def _placement():
    p = backend.current()
    return p.transport, p.clock


def test_the_ranks_read_the_placement_launch_decided(monkeypatch):
    monkeypatch.delenv(backend.TRANSPORT_ENV, raising=False)
    assert list(minipar.launch(_placement, 2, device="cpu")) == [("gloo", "host")] * 2
    res = minipar.launch(_placement, 2, device="cpu", transport="gloo-staged")
    assert list(res) == [("gloo-staged", "host")] * 2 and res.placement.transport == "gloo-staged"
    monkeypatch.setenv(backend.TRANSPORT_ENV, "gloo-staged")  # read once, by launch
    assert list(minipar.launch(_placement, 2, device="cpu")) == [("gloo-staged", "host")] * 2


def _per_parameter_step():
    """Rank function: one step of a GPT under fully_shard; its comm and staging events."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = fully_shard(GPT(CFG, seed=0))
    x, y = data.batches(data.synthetic_tokens(500), 1, 4, CFG.block_size)[0]
    mark = trace.mark()
    model(data.shard(x, r, n), data.shard(y, r, n)).backward()
    evs = trace.since(mark)
    return {"units": len(padded_unit_sizes(model)),
            "calls": sum(e["kind"] == "comm" for e in evs),
            "sent": sum(e["bytes_sent"] for e in evs if e["kind"] == "comm"),
            "staging": sum(e["kind"] == "staging" for e in evs)}


def test_a_staged_copy_is_not_counted_as_a_collective():
    plain = minipar.launch(_per_parameter_step, 2, device="cpu", transport="gloo")
    staged = minipar.launch(_per_parameter_step, 2, device="cpu", transport="gloo-staged")
    for got, was in zip(staged, plain):
        assert got["calls"] == was["calls"] == 3 * got["units"]  # per unit: 2 all-gathers, 1 reduce-scatter
        assert got["sent"] == was["sent"] > 0
        assert was["staging"] == 0 and got["staging"] == 2 * got["calls"]  # out and back, each
