"""``study.stepping.Stepper``: the executor let through one round at a time is the executor.

On 2 ranks, for 1F1B, ZB-H1 (W actions) and interleaved 1F1B (two stages per rank), a step
advanced round by round gives the loss and the gradients of ``Pipeline.step`` run at once on
the same stages, each rank computes in the rounds of the lock-step play
(:func:`minipar.pipeline.posting.rounds`), idle rounds are said to be idle, and the events
drawn are the rank's computes in schedule order.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import data
from minipar import pipeline as pp
from minipar.models import GPT, GPTConfig
from minipar.pipeline.posting import rounds
from minipar.study.stepping import Stepper

CASES = [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]


def _pipe(cfg, x, name, v):
    sched = pp.make_schedule(name, 2, 4, v)
    layers = GPT(cfg, seed=0).layers()
    bounds = pp.partition(pp.layer_costs(layers), sched.n_stages)
    stages = pp.build_stages(layers, bounds, dist.get_rank(), 2)
    shapes = pp.boundary_shapes(layers, bounds, x.chunk(4)[0])
    return pp.Pipeline(stages, sched, shapes.__getitem__)


def _rank():
    tokens, tok = data.corpus_tokens()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=8, n_layer=4, n_head=2, n_embd=16)
    (x, y), = data.batches(tokens, 1, 8, 8)
    out = {}
    for name, v in CASES:
        whole = _pipe(cfg, x, name, v)
        want = whole.step(x, y)
        paced = _pipe(cfg, x, name, v)
        stepper = Stepper(paced, x, y)
        lines = [stepper.advance() for _ in range(stepper.rounds)]
        grads = [(a.grad - b.grad).abs().max().item() for a, b in zip(whole.parameters(), paced.parameters())]
        out[name] = {"loss": (stepper.loss, want), "grad": max(grads), "lines": lines,
                     "at": [int(t) for t, _, _ in stepper.ran], "events": stepper.events(),
                     "computes": [f"{a.op}{a.microbatch}s{a.stage}" for a in stepper.computes],
                     "over": stepper.advance()}
    return out


def test_a_step_advanced_round_by_round_is_the_step():
    res = minipar.launch(_rank, 2, device="cpu")
    for name, v in CASES:
        when, _ = rounds(pp.make_schedule(name, 2, 4, v))
        for r in range(2):
            got = res[r][name]
            if r == 1:  # the last stage's rank has the loss
                assert got["loss"][0] == got["loss"][1], (name, got["loss"])
            assert got["grad"] == 0.0, (name, r, got["grad"])
            assert got["at"] == when[r], (name, r, got["at"], when[r])
            assert sum("idle" in line for line in got["lines"]) == len(got["lines"]) - len(when[r])
            assert [f"{e['labels']['phase']}{e['labels']['microbatch']}s{e['labels']['stage']}"
                    for e in got["events"]] == got["computes"]
            assert [e["start"] for e in got["events"]] == [float(t) for t in when[r]]
            assert got["over"] == "the step is over"
    assert "round 0: idle (its next compute, F0, waits for a message)" in res[1]["1f1b"]["lines"]
