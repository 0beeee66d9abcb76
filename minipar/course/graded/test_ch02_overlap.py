"""Challenge 02: hide the gradient all-reduce behind the backward.

Write ``GradSync(model, group=None)`` (hooks on the parameters) and ``GradSync.finish()`` in
``exercises/challenges/ch02_overlap.py``. On 2 ranks training exercise 02's small GPT for 3
steps: training equal to one process (rtol 1e-5, atol 1e-6) with every gradient all-reduced
once; per step, at most 25% of the gradient bytes in collectives started after the last
gradient became final (the grader's own hooks timestamp each one), and at most 8 recorded
communication calls. The synchronisation is yours: a trace that shows minipar's own reducer or
DDP (events named ``grad_all_reduce``, or the replicas' ``broadcast``) does not count.

Grade it alone with ``python -m minipar.grade ch02`` (``minipar.hint("ch02")`` for the next of
three hint tiers).
"""

import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, reference
from minipar.runtime import trace
from minipar.data_parallel import shard_batch
from minipar.course import grading
from minipar.course.grading import expect_equal, fail_if, observes
from minipar.models import GPT, GPTConfig

CHALLENGE = "ch02_overlap"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNpVjLENgDAMBFfxAOzAGNQmNthKSJDtKOsTIRqqL+7uN9EkcBqScg0HauwQwrBjygON4NCqLnPMY'
        'wGsBEMwILVe6DUrx2iWZzqJFv7nqV13j+/U2GN9AJVLKlg=',
        'sealed:eNotjkGOwzAIRa/yd9NKzVwgB5hzUIfUVlyIADfK7Wu3swLBg//+TNuOnYyeHGyOIqEgrHzg3tLGM'
        'UYwfvUlQ21hm3Fklg59gR9HJQ88jJbCEiCz8mLHhbCrx0QptWerFDwNBll1u97gQRYoPYBqnYyXlhjkp6RsK'
        'tq8nreRHZnhXe8/7usAFQynE0ayzViLFM+XKw4aH1e1z10mWWpX6QVJ99LbO6Xt9w2/Vlmq',
        'sealed:eNpFjjsOwkAMRK/iDpAiqGhANJyBHjmbWRJlf/J6+dweJ0KisTTPY89cm5uhlbIn7nNT0qwcDkfqP'
        '4pKXnIkHUGBq1Jh4QiFmGulfhLDM1D+pn79SDVyCLRdMN4lVwzLue6I07Cane0tAK8zuRzj3uRdMDSHbd+8h'
        '3SUy2XDz8emI66f5O6mb9Kwo2IV7KgEK/ML7GhKlGWAnK1Wmup4sj4tuXFNE1SzvHiy2VJhN3cLg+6/4MVcA'
        'A==',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT
N, STEPS = 2, 3
RTOL, ATOL = 1e-5, 1e-6
EXPOSED_GOAL = 0.25
CALLS_GOAL = 8
LIBRARY = ("grad_all_reduce", "broadcast")   # the events of minipar's Reducer and DDP
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
TOKENS = data.synthetic_tokens(3000)


def _train(GradSync, model, batches):
    ready = {}
    for p in model.parameters():   # registered first: runs before the challenge's own hooks
        p.register_post_accumulate_grad_hook(lambda p: ready.__setitem__(id(p), trace.now()))
    mark = trace.mark()
    sync = GradSync(model, None)
    built = sorted({e["name"] for e in trace.since(mark) if e.get("kind") == "comm" and e["name"] in LIBRARY})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, steps = [], []
    for x, y in batches:
        x, y = shard_batch((x, y))
        ready.clear()
        opt.zero_grad(set_to_none=True)
        mark = trace.mark()
        loss = model(x, y)
        loss.backward()
        sync.finish()
        evs = [e for e in trace.since(mark) if e["kind"] == "comm"]
        last = max(ready.values())
        steps.append({"sent": sum(e["bytes_sent"] for e in evs), "calls": len(evs),
                      "exposed": sum(e["bytes_sent"] for e in evs if e["start"] >= last),
                      "library": sorted({e["name"] for e in evs if e["name"] in LIBRARY})})
        opt.step()
        t = loss.detach().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "steps": steps, "built": built}


def _launch(challenge):
    batches = data.batches(TOKENS, STEPS, 8, CFG.block_size)
    return minipar.launch(_train, N, args=(challenge.GradSync, GPT(CFG, seed=1), batches), timeout=TIMEOUT)


@observes('ch02.*.training', 'ch02.*.recorded')
def test_trains_like_one_process(challenge):
    """3 SGD steps on 2 ranks equal one process on the whole batch; every gradient all-reduced once."""
    results = _launch(challenge)
    batches = data.batches(TOKENS, STEPS, 8, CFG.block_size)
    want = reference.train_reference(GPT(CFG, seed=1), batches, reference.sgd(0.5))
    psi = sum(p.numel() for p in GPT(CFG, seed=1).parameters())
    per_step = cost.ddp_bytes_per_step(psi, N)
    for rank, got in enumerate(results):
        library = sorted(set(got["built"]).union(*(s["library"] for s in got["steps"])))
        fail_if(library, f"rank {rank}: the trace holds minipar's own reducer or DDP (events named "
                 f"{', '.join(library)}), not a synchronisation of your own")
        expect_equal([s["sent"] for s in got["steps"]], [per_step] * STEPS,
                     f"rank {rank}: gradient bytes sent per step (all-reduce of {psi} floats once)", "step")
        reference.assert_same_training(got, want, rtol=RTOL, atol=ATOL)


@observes('ch02.*.exposed')
def test_exposed_communication_goal(challenge):
    """Per step, at most 25% of the gradient bytes start after the last gradient is final."""
    for rank, got in enumerate(_launch(challenge)):
        for step, s in enumerate(got["steps"]):
            share = s["exposed"] / s["sent"] if s["sent"] else 1.0
            fail_if(share > EXPOSED_GOAL,
                     f"exposed: rank {rank}, step {step}: {s['exposed']} of {s['sent']} gradient bytes "
                     f"({100 * share:.0f}%) went into collectives started after the backward's last "
                     f"gradient; the goal is at most {100 * EXPOSED_GOAL:.0f}%")


@observes('ch02.*.calls')
def test_calls_goal(challenge):
    """At most 8 recorded communication calls per step."""
    for rank, got in enumerate(_launch(challenge)):
        calls = [s["calls"] for s in got["steps"]]
        fail_if(max(calls) > CALLS_GOAL,
                 f"calls: rank {rank} made {calls} recorded communication calls per step; the goal is "
                 f"at most {CALLS_GOAL} (each call pays the link's latency)")
