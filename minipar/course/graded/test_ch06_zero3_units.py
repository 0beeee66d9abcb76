"""Challenge 06: choose ZeRO-3's units: a small gathered peak with few gathers.

``units(model)`` returns the modules stage 3 gathers one at a time, for the GPT of
``CONFIG`` (vocabulary 512, 4 blocks of width 32). Two steps on 2 ranks with
``FullyShardedDataParallel(model, units=units(model))`` (prefetch on) must train like one
process (fp32 AdamW, rtol 1e-4, atol 5e-5), keep the peak of gathered parameter bytes at or
under 88,000 (the default units: 118,400) and use at most 28 all-gathers per step, counted in
the recorded trace (four pieces per block: 40). The library's default units fail the peak
goal. Grade it with ``python -m minipar.grade ch06``; stuck? ``minipar.hint("ch06")``.
"""
import torch.distributed as dist

import minipar
from minipar import data, reference, strategy
from minipar.runtime import trace
from minipar.course.grading import GradeFailure, expect_equal, observes
from minipar.models import GPT, GPTConfig

CHALLENGE = "ch06_zero3_units"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNodjTEOwyAUQ6/iA+QEXTp27VAp8y84BYkAgk/T3L4/LJZl+8lr1IDauFFdWKCByPwpRo6K2PERi'
        'xo9jhATZ+9Ga8yKks2XvQ5lv129C9CjTLRDGiEpfk2vqeMCyR6hHNgln3ifhsEXE4qRNdIRZZsXj+fLlsnf/'
        'xqgOPg=',
        'sealed:eNp1kEtuwzAMRK8yu7ZA4AO0x2iBrvWhbcGKKJBSjPT0pRRk0UU3gki+GX6+dkIldyApmv2zk420Q'
        'fsVvKKdjMBFKfSWboReUtOPSW7OXlE4oYlVklnG68pyOolwJcK7cIzgbcG3pEaIfJap1/RDOntYQFdPMaayX'
        'eDgM4fjRbFyF9REwbjhNcCdXLSSNXw38tw504OHJ02RDOQx15+S7cY3yw0D3+NG7fKPGFqzrfCc4HmNOcSwM'
        'fMFn5Phku/mQTJk1SWZJ2R+iJZfc1x65w==',
        'sealed:eNo9jlFuwjAQRK8ynyBZUWIoquhXT9ADVAht4k2IWNuRvYBy+9q09G81mnn7PkU5BVI+Qi8M9j07N'
        '4cJj0sU/kAvcbhmtKDgYEEZ3xI6A1INBhKsgZflZF7F7lncveaVeWFyf8PzWDb+XJPTEd0OtzBrNrAHTFS6q'
        'dyEhemKOMJ2pn07gIU9B83YvO+NtXv0q3LeNvhKyEpJMabo4aNjaYTWQtlsq4YpFrNwIQ4xZB5uOt8ZC80Jc'
        '0a8c4K1pm3b/xcGiRehgZ/iQmkqnepYdWr0iCnrL6JfUdwxlBcucWh+AAA9bd8=',
    ),
}
CONFIG = dict(vocab_size=512, block_size=16, n_layer=4, n_head=2, n_embd=32)
PEAK, GATHERS, TIMEOUT = 88_000, 28, 60


def _batches():
    return data.batches(data.synthetic_tokens(4000, CONFIG["vocab_size"]), 2, 4, CONFIG["block_size"])


def _names(challenge):
    model = GPT(GPTConfig(**CONFIG), seed=0)
    got = challenge.units(model)
    name = {id(m): n for n, m in model.named_modules()}
    missing = [type(m).__name__ for m in got if id(m) not in name]
    if missing:
        raise GradeFailure(f"units(model) returned modules that are not the model's own: {missing[:3]}")
    return [name[id(m)] for m in got]


def _train(names):
    from minipar.zero import FullyShardedDataParallel
    r, n = dist.get_rank(), dist.get_world_size()
    model = GPT(GPTConfig(**CONFIG), seed=0)
    modules = dict(model.named_modules())
    fsdp = FullyShardedDataParallel(model, units=[modules[k] for k in names])
    opt = reference.adamw(1e-2, 0.1)(fsdp.parameters())
    losses, gathers = [], []
    for x, y in _batches():
        mark = trace.mark()
        opt.zero_grad()
        loss = fsdp(data.shard(x, r, n), data.shard(y, r, n))
        loss.backward()
        opt.step()
        gathers.append(sum(1 for e in trace.since(mark) if e["kind"] == "comm" and e["name"] == "all_gather"))
        losses.append(strategy.average_loss(loss, None))
    return {"losses": losses, "params": fsdp.gather_full_params(), "gathers": gathers,
            "peak": fsdp.peak_gathered_bytes}


def _measured(challenge, cache={}):
    names = _names(challenge)
    key = tuple(names)
    if key not in cache:
        cache[key] = minipar.launch(_train, 2, args=(names,), timeout=TIMEOUT)
    return names, cache[key]


@observes('ch06.*.training')
def test_trains_like_one_process(challenge):
    """Two steps with your units train like one process (losses and parameters)."""
    _, results = _measured(challenge)
    want = reference.train_reference(GPT(GPTConfig(**CONFIG), seed=0), _batches(), reference.adamw(1e-2, 0.1))
    for res in results:
        reference.assert_same_training(res, want, rtol=1e-4, atol=5e-5)


@observes('ch06.*.peak')
def test_peak_gathered_bytes(challenge):
    """The most bytes of gathered units alive at once is at most 88,000 on every rank."""
    names, results = _measured(challenge)
    peaks = [res["peak"] for res in results]
    if max(peaks) > PEAK:
        raise GradeFailure(f"peak gathered bytes per rank {peaks}: the goal is at most {PEAK:,}\n"
                           f"  your {len(names)} units: {names}")


@observes('ch06.*.gathers')
def test_gathers_per_step(challenge):
    """At most 28 all-gathers per step."""
    names, results = _measured(challenge)
    counts = [res["gathers"] for res in results]
    expect_equal(counts[1], counts[0], "all-gathers per step, rank 1 against rank 0", keys="step")
    if max(counts[0]) > GATHERS:
        raise GradeFailure(f"all-gathers per step {counts[0]} (from the trace): the goal is at most "
                           f"{GATHERS}\n  your {len(names)} units: {names}")
