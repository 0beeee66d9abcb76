"""Challenge 05: lay out an MLP over 4 ranks: a quarter of the memory, one activation's traffic.

Write ``shard(w1, b1, w2, b2, rank, t)`` and ``forward(x, shards, group=None)`` in
``exercises/challenges/ch05_mlp_layout.py``. On t = 4 ranks, each given the whole input and
returning the whole output of y = gelu(x W1ᵀ + b1) W2ᵀ + b2 (h = 32): y and ∂L/∂x within
rtol 1e-5 of one device, the kept tensors at most 8,448 bytes per rank (a quarter of W1, b1,
W2 plus b2), and at most 12,288 bytes sent per rank in forward and backward, from the trace.
The library's own tensor-parallel layers (``minipar.tensor_parallel.layers``, ``.block``) are
the answer, so a file that imports them is refused; its operators (f, g, gather, ...) and
``minipar.comm`` are yours to use. Grade it with ``python -m minipar.grade ch05``; stuck?
``minipar.hint("ch05")``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minipar
from minipar import cost
from minipar.runtime import trace
from minipar.course import grading
from minipar.course.grading import expect_close, fail_if, observes

CHALLENGE = "ch05_mlp_layout"
FORBIDDEN = ("minipar.tensor_parallel.layers", "minipar.tensor_parallel.block",
             "minipar.tensor_parallel.column_parallel_linear", "minipar.tensor_parallel.row_parallel_linear",
             "minipar.tensor_parallel.ColumnParallelLinear", "minipar.tensor_parallel.RowParallelLinear",
             "minipar.tensor_parallel.ParallelMLP", "minipar.tensor_parallel.ParallelBlock")
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNoNjM0NgCAMRlf5VtB48uISJp4rVNsoxUCDji/n97MKQzRGNlBwbeSaDVoxwTVxxU3l5AIXMnwzX'
        'tEgqM+tjnxgG0AWsY0wbl1LufWms5395T4tZFddfj6WI/M=',
        'sealed:eNpljkEOgkAQBL/SNyUhJnr0Gx44D7sDTFhmyc5siL+XoB6M10pXpx5rEkd3Rf+EuCFXX6tjYPJa2'
        'HAuebMGpBHd7TsS/d2EnOqi1twxcqqgdT/duWcwhQmFdD4ZLElg5AE+MSaJkRVV97/2ICsVF0qfAgMVhtVl4'
        'YisgdujQRQ9hXmjEg/pXTIWisL6L11erNlP6w==',
        'sealed:eNpljMsOgjAURH9llm0kRFhK3PILLIwhFegjll5yaYP8vWA0LNxNZs6c2SruL2iKvLMpPEXMcJY3v'
        'md4/FdNeVTFlyoraOLlY7G4wgw+iTr3LgyKhRavDIYpTXK7Fy3v3palrLDu8EHaXb8tPxynzZ1hcdFCQ4UeB'
        'pppxOiCmxTncQgzcbtF5f3gIYixUmLQEqBSJMOqR51CFx0Fmb8B+qxKug==',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT
T, H = 4, 32
SHAPE = (4, 8, H)
ACT = 4 * 8 * H * 4                                           # bytes of x (and y)
TRAFFIC_GOAL = 2 * cost.collective_bytes("all_reduce", ACT, T)  # one all-reduce each way
MEMORY_GOAL = (4 * H * H * 2 + 4 * H) * 4 // T + H * 4        # a quarter of W1, b1, W2; b2 whole


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _weights():
    return _randn(4 * H, H, seed=1) * 0.2, _randn(4 * H, seed=2), _randn(H, 4 * H, seed=3) * 0.2, _randn(H, seed=4)


def _inputs():
    return _randn(*SHAPE, seed=5), _randn(*SHAPE, seed=6)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _run(shard, forward):
    r, t = dist.get_rank(), dist.get_world_size()
    shards = shard(*_weights(), r, t)
    kept = sum(x.numel() * x.element_size() for x in {id(x): x for x in _tensors(shards)}.values())
    x, dy = _inputs()
    x.requires_grad_()
    mark = trace.mark()
    y = forward(x, shards)
    forward = sum(e["bytes_sent"] for e in trace.since(mark) if e["kind"] == "comm")
    mark = trace.mark()
    y.backward(dy)
    backward = sum(e["bytes_sent"] for e in trace.since(mark) if e["kind"] == "comm")
    return {"y": y.detach(), "dx": x.grad, "kept": kept, "forward": forward, "backward": backward}


def _reference():
    w1, b1, w2, b2 = _weights()
    x, dy = _inputs()
    x.requires_grad_()
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    y.backward(dy)
    return y.detach(), x.grad


def _launch(challenge):
    return minipar.launch(_run, T, args=(challenge.shard, challenge.forward), timeout=TIMEOUT)


@observes('ch05.*.exact')
def test_output_and_input_gradient(challenge):
    """Every rank returns the whole y and gets the whole ∂L/∂x of the single-device MLP."""
    results = _launch(challenge)
    y, dx = _reference()
    for rank, got in enumerate(results):
        expect_close(got["y"], y, "the MLP's output y", where=f"rank {rank}", rtol=1e-5, atol=1e-5)
        fail_if(got["dx"] is None, f"rank {rank}: x.grad is None after y.backward(dy)")
        expect_close(got["dx"], dx, "the input gradient ∂L/∂x", where=f"rank {rank}", rtol=1e-5, atol=1e-5)


@observes('ch05.*.memory')
def test_memory_goal(challenge):
    """Each rank keeps at most a quarter of W1, b1 and W2, plus b2 (8,448 bytes)."""
    for rank, got in enumerate(_launch(challenge)):
        fail_if(got["kept"] > MEMORY_GOAL,
                 f"memory: rank {rank} keeps {got['kept']} bytes of weights; the goal is at most "
                 f"{MEMORY_GOAL} (the whole MLP is {(4 * H * H * 2 + 4 * H + H) * 4})")


@observes('ch05.*.bytes')
def test_traffic_goal(challenge):
    """Each rank sends at most one all-reduce of the activation per direction (12,288 bytes)."""
    for rank, got in enumerate(_launch(challenge)):
        sent = got["forward"] + got["backward"]
        fail_if(got["forward"] == 0,
                 f"rank {rank} recorded no communication through minipar.comm in forward")
        fail_if(sent > TRAFFIC_GOAL,
                 f"traffic: rank {rank} sent {sent} bytes ({got['forward']} forward, {got['backward']} "
                 f"backward); the goal is at most {TRAFFIC_GOAL:.0f}, one all-reduce of the "
                 f"{ACT}-byte activation each way")
