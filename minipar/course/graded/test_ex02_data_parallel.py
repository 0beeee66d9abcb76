"""Exercise 02: data parallelism, from a plain all-reduce to an overlapped, bucketed DDP.

Every rank holds the whole model and computes the gradient of the mean loss over its own
shard of the batch; after the backward, every rank must hold the gradient one process would
compute on the whole batch (Goyal et al. 2017, eq. 1; notebook 02, "Why replicate"). The tests
run the library's own ``DistributedDataParallel`` and training loops with your code in place.

A. ``allreduce_gradients(params, group=None, all_reduce_fn=None)``: called after the backward.
B. ``assign_buckets(params, bucket_cap_mb)`` -> a list of buckets (lists of parameters), the
   layout the reducer all-reduces (Li et al. 2020, §3.2.2).
C. The overlapped reducer and the hooks that feed it (Li et al. 2020, §3.2.3): the ``Reducer``'s
   state (``__init__``, ``reset``), ``grad_ready(p)``, ``finish()``, ``_launch_ready()``, and
   ``DistributedDataParallel``'s ``_attach``, ``_grad_hook``, ``_finish`` and ``forward``. Its
   design is yours: what the reducer keeps, when it launches, how DDP learns that a gradient
   is final and that the backward is over.

Each function's docstring below is its contract: clauses ``ex02.P.word`` that must hold (the
grader names the clause a failure breaks). Graded: the averages, training equal to one process
(rtol 1e-5), the bucket layout, the bytes, a 3-rank run whose group is 2 of them with a
gradient-less float64 parameter, and that the first all-reduces start before the backward
ends. Grade it with ``python -m minipar.grade ex02``; stuck? ``minipar.hint("ex02", "A")``
(parts A, B, C).
"""
from contextlib import nullcontext

import math

import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, reference
from minipar.runtime import trace
from minipar.data_parallel import (DistributedDataParallel, allreduce_gradients, assign_buckets,
                                   shard_batch, trainable)
from minipar.course import grading
from minipar.course.grading import breaks, diagnose, expect, expect_close, expect_equal, expect_same_training, observes
from minipar.models import GPT, MLP, GPTConfig

EXERCISE = "ex02_data_parallel"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNo9y0EOgkAMRuGr/BfAK3gC1q6LU+yEoSVtceLtFUlYv+89hBLrHgl+s3/gpAuKodcU1AxYV7ycS'
        'mVNhCGPgVr7ywBrOW0KY95bGybKp1zLHWP9kaOeQxcLxkZOKyc7hAJql799AQ6HNMg=',
        'sealed:eNoljsENg0AMBFvZAkgaSBEpARluAUucL7IPoqT6GOU3K400+zRC9v3mLMdMvOjoLmoy7bnEpbLTB'
        '6ihb0TkRvOSGk/6573ROUCSZVVbHxBUjUjE6lKU1jFxbpWBL70FFvXolxdHrZeX+fGfHxeDkSXQ8lbRU0Ob3'
        'X9kBzyH',
        'sealed:eNpFzl0OgyAMAOCr9I2RGPfuwhV2BVK1ODKgpOiWefo5jPOlSduvP44FMvgEs6BP2Ae6ZBSMRXfgH'
        'eR2EhzBF7hzou7IDawkXGzwz83rG8wPSjBwjC2GYIXGZdgaFTfA2Sh8TaqBSXjJpsYGEkYy6kfsOaT05gXOg'
        'nXpv6gOanAcAr9phP5zPHQ1+/UqbPErXXbcfgF1Sk6R',
    ),
    'B': (
        'sealed:eNoFwcERgDAIBMBW7mcZluEbgRjG0WQOnLTv7tFDO6ZQHi/nlrgoFv4WbHjiFL2X0DA57FNHC2btP'
        'z9wFKA=',
        'sealed:eNotjNERwjAMxVZ5E7BAB+HbNC7Nxdg5xyGwPU3pr6TTnaQgdkYlpxcHe4NQC4Rhy95iQWGuoJSyP'
        'iedsVVWPPpaONA1spxU+RMwZQzrkmBv9k1snG6lCnPs1EBqB3Gk+FZeptX/kI7DuLa3H8vKN4g=',
        'sealed:eNo1jkFOxDAQBL/SRyeICO2RCG58gWs0icdgEU9G48mi7OvXG8G9qqsXUrxh3pcf9mkhncqMHpe+v'
        '7xgPpzriLQZFFlgfGWrHMOaqwclo1K77hVygm1GB9kLr6FrEzrwyoXFp5pvHLoR1ckcBOHfvyBygn8zlt2sk'
        'diEkStkk2cu6gdIIsLDx9N/5R3tJR6XhuiHMmJOqd1qAVJlieOZ+CLPVz5Zo1yb+Enrzh9mTU3Zqg93s8pWS'
        'w==',
    ),
    'C': (
        'sealed:eNo9kFFOxDAMRK8yf4BUJOACe4z9dhuniZo6VeyS5fZ4l7B/jj3zRpNrykuCGhkjVFZUYcy0bJ1ag'
        'DAHvBLmc9nYcHDDQY12Nm4TUu3YSX6wNgqZxRRMThtqtVwKOmXfx+r6/sga16xOv9kES4ws77HkNRkSSSisb'
        'xN8GI4akQ37qYaZERtrugMfzjvDk/i44JrIsJBgreityooc0Ug2fKDQKUvyeiP9y0mO4P/35wQHup7+HMLf3'
        'lV5fMiz9Is+y15+AUT4b3s=',
        'sealed:eNpNkVFuhDAMRK8yf20l2AMsUj+qPUBvgLyJgYiQ0Dgp3Z6+JiBtP2N7nseTvnfB5b6/Ik+Mj2Jmz'
        'vBOMoYUF5CIG0N/r3UBBQvCQitWSrRw5oT2HUe7Q2LhfJBMLEG7csGYyPaJyT5UZGbBChdyhFPeIazYKhCtw'
        'sYtdOg9lWCmU7mRV2W1FPgnn4awTc5z3XcWnChoWb06q1TJlCpVvcsjGJD3bWJbDON1Zl5dGKt+0mnPbx0Gz'
        'UOm0+ovp6hrY3reKzpOWV186+1Gaw0OpywVpBmojYCYLKdGjevuBiVUYHNEpKncbp9XjXKNklsypizFU+Z2D'
        'wtTjDNW/re0q+jBJWXXbhxUfFfkRsniq3DR9af1GEAlxx31IuAwusCdjusZdZqG/dv0TRqefVK0P3IN6/IH9'
        'gfBqQ==',
        'sealed:eNpdU8uO2zAM/BXeYqOu0F6d+lLsByyKopcgEGSZtoXYkqpHsmnRfy8lOclmb7LFIWeGox84RImOc'
        'a60Cpy34HEZmYYOpFlXNjkTLffqD1b5WO9LQR/lCYOnssP3fKysr2E0DqwHpUF4rybNt7LKCidW30D55lJYv'
        'vb18akZNyO1+6uGytYtKGCM/dsKHHqaUDPIhxYs6kHpKU1fUFc9K/3rhDk2VCWGK11mUAMa38LGhH5+aWAWe'
        'lgwkz8ymJwYeIaQ+JOyIKiBRRFwALsnIt0HlodMkchbIU/7G5mDOsLnDr4SYgRzRrcI2wJfRNRyLv2TgqcfL'
        'VxmteATw2+QJRXjaiCq9wnvyo7QkZQWxLJQq7RDPiYj+jiO6BooywLaxyaWCZvaVHmrD9Q7iLHdTpyn3Qbus'
        'uh8bGidVy05Vfx0EclRsWK3y8Y9Wu1u6+1UXUN1ESqACGC0RLioMJsYbr5Qit5L/kS2MRgpgX5us6sQZoRVU'
        'Yhoy0YjReexc9rgB1sbyNOQul83wQ0M6qwGTNt4Mgl8XFccGog6TWrgHq6Xl9ct/nw25pTzYSl7k/IBHbfGB'
        'y6kjGtcKBw8y0+FVcHcv7d3kJ5BuSnppMA8aloaG6LTxGJAB9rw5PCetGbpo3I+gCTiEIyTMxMxmARmv4RTo'
        'l+QcXxDGYMymqOelEb2O2JEnkA9CdtYFVfJcLe99EfcKcRQaaHO2BKBMJO7VMdve6A+m2kJolDTO6b3VdQlk'
        'hkK5LknEg3g4vE+pTQhV/8Ds52K1w==',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT
RTOL, ATOL = 1e-5, 1e-6  # fp32: only the order of the sums differs from one process
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
TOKENS = data.synthetic_tokens(3000)
STEPS = 3


def _grad_events(since):
    return [e for e in trace.events()[since:] if e["name"] == "grad_all_reduce"]


# ----------------------------------------------------------------------------- A: naive
def _mlp_with_frozen_bias():
    model = MLP(seed=0)
    model.net[0][0].bias.requires_grad_(False)  # frozen: must stay without a gradient
    return model


def _average_once(use_ring):
    r = dist.get_rank()
    model = _mlp_with_frozen_bias()
    x, y = data.regression_batches(1, 4, seed=10 + r)[0]  # different data on each rank
    model(x, y).backward()
    local = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    want = {k: g.clone() for k, g in local.items()}
    for g in want.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    since = len(trace.events())
    allreduce_gradients(model.parameters(), None, minipar.comm.ring_all_reduce if use_ring else None)
    got = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    sent = sum(e["bytes_sent"] for e in trace.events()[since:])
    return got, want, model.net[0][0].bias.grad is None, sent


def _check_average(results, n, fn=False):
    psi = sum(p.numel() for p in trainable(_mlp_with_frozen_bias().parameters()))
    expected = int(cost.ddp_bytes_per_step(psi, n))
    for rank, (got, want, frozen_ok, sent) in enumerate(results):
        with breaks("ex02.A.frozen"):
            expect(frozen_ok, f"rank {rank}: a frozen parameter (requires_grad=False) holds a gradient after the "
                              "call (frozen parameters stay without a gradient)")
        with breaks("ex02.A.fn" if fn else "ex02.A.average"):
            expect_equal(sorted(got), sorted(want), f"rank {rank}: the parameters that hold a gradient")
            for k in want:
                with diagnose(lambda f, k=k: torch.allclose(got[k], want[k] * n, rtol=1e-4, atol=1e-6),
                              f"the gradient is {n} times the average: the sum over the {n} ranks"):
                    expect_close(got[k], want[k], "gradient (the average of the ranks' gradients)",
                                 where=f"rank {rank}, {k}", rtol=1e-5, atol=1e-6)
        with breaks("ex02.A.fn" if fn else "ex02.*.recorded" if sent == 0 else "ex02.A.bytes"):
            with diagnose(sent > expected, "more bytes than one all-reduce of each trainable parameter"):
                expect_equal(sent, expected, f"rank {rank}: bytes sent by the gradient all-reduces "
                                             f"(cost.ddp_bytes_per_step for Ψ = {psi} parameters over {n} ranks)")


@observes("ex02.A.average", "ex02.A.frozen", "ex02.A.bytes", "ex02.*.recorded")
def test_allreduce_gradients_averages(impl):
    """allreduce_gradients leaves the average of the ranks' gradients in every p.grad (4 ranks)."""
    _check_average(minipar.launch(_average_once, 4, args=(False,),
                                  timeout=TIMEOUT), 4)


@observes("ex02.A.fn")
def test_allreduce_gradients_with_your_all_reduce(impl):
    """With all_reduce_fn given (the ring all-reduce), every .grad is still the mean."""
    _check_average(minipar.launch(_average_once, 2, args=(True,),
                                  timeout=TIMEOUT), 2, fn=True)


def _naive_training(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in batches:
        x, y = shard_batch((x, y))
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        allreduce_gradients(model.parameters())
        opt.step()
        t = loss.detach().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


class _Mixed(torch.nn.Module):
    """A float32 layer, a frozen bias and a float64 parameter that ``use_extra=False`` leaves
    out of the graph (no gradient on that rank)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.lin = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(3, 4, generator=g))
            self.lin.bias.copy_(torch.randn(3, generator=g))
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
        self.extra = torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))

    def forward(self, x, use_extra):
        loss = (self.lin(x) + self.frozen).pow(2).mean().double()
        return loss + (self.extra * x.sum().double()).pow(2).sum() if use_extra else loss


def _participation():
    """3 ranks; the group is global ranks 1 and 2; on group rank 1 ``extra`` gets no gradient.
    Per version (A directly, C bucketed and overlapped), 2 steps with an ``all_reduce_fn`` that
    records each call and leaves the tensor as it is (no communication, so a rank that skips a
    tensor cannot hang the other): the calls, and each .grad against the local gradient / 2."""
    import copy
    sub = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return None
    g = comm_rank = dist.get_rank(sub)
    out = {}
    for version, cap, overlap in (("A: allreduce_gradients", None, False),
                                  ("C: Reducer, overlap=False, 2 buckets", 6e-5, False),
                                  ("C: Reducer, overlap=True, one bucket per parameter", 0.0, True)):
        model, calls, steps = _Mixed(), [], []

        def record(t, group, calls=calls):
            calls[-1].append((str(t.dtype), t.numel(), dist.get_world_size(group)))
        try:
            ddp = None if cap is None else DistributedDataParallel(model, group=sub, bucket_cap_mb=cap,
                                                                    overlap=overlap, all_reduce_fn=record)
            for step in range(2):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + comm_rank))
                use_extra = g == 0
                local = copy.deepcopy(model)
                local(x, use_extra).backward()
                want = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) / 2
                        for k, p in local.named_parameters() if p.requires_grad}
                for p in model.parameters():
                    p.grad = None
                calls.append([])
                (ddp or model)(x, use_extra).backward()
                if ddp is None:
                    allreduce_gradients(model.parameters(), sub, record)
                got = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()
                       if p.requires_grad}
                steps.append((got, want, model.frozen.grad is None))
            if ddp is not None:
                ddp.remove_hooks()
            out[version] = (calls, steps, None)
        except Exception as e:  # noqa: BLE001 - reported with the version it broke
            out[version] = (calls, steps, f"{type(e).__name__}: {e}")
    return out


@observes("ex02.A.dtype", "ex02.A.group", "ex02.*.order", "ex02.C.average", "ex02.C.group", "ex02.C.fn", "ex02.C.reset")
def test_gradient_less_parameter_dtype_group_two_steps(impl):
    """On a group of 2 of 3 ranks, two steps, a float64 parameter with no gradient on one rank: the group's
    mean, the dtypes, the second step."""
    results = minipar.launch(_participation, 3, timeout=TIMEOUT)[1:]
    for version in results[0]:
        for g, res in enumerate(results):
            err = res[version][2]
            expect(err is None, f"{version}: group rank {g} (global rank {g + 1}) raised {err}")
        calls = [res[version][0] for res in results]
        part = version[0]                                   # "A: allreduce_gradients" or "C: ..."
        for step in range(2):
            later = ("ex02.C.reset",) if step and part == "C" else ()
            clean = " (a second step starts from a clean state)" if step else ""
            with breaks("ex02.*.order", *later):
                expect_equal(calls[1][step], calls[0][step],
                             f"{version}, step {step}: the all_reduce_fn calls (dtype, elements, group size) of "
                             "group rank 1, whose float64 parameter 'extra' has no gradient, against group rank 0's "
                             "(a parameter without a gradient still takes part, as zeros; every rank issues the "
                             f"same collectives in the same order){clean}", keys="call")
            with breaks(f"ex02.{part}.group"):
                expect(all(k == 2 for _, _, k in calls[0][step]),
                       f"{version}, step {step}: all_reduce_fn was given a group of sizes "
                       f"{[k for _, _, k in calls[0][step]]}, expected the group of 2 (any group)")
            for g, res in enumerate(results):
                got, want, frozen_ok = res[version][1][step]
                with breaks("ex02.A.frozen"):
                    expect(frozen_ok, f"{version}, step {step}, group rank {g}: the frozen parameter holds a "
                                      "gradient (frozen parameters stay without a gradient)")
                for k, w in want.items():
                    with breaks(*(later or (f"ex02.{part}.average",))):
                        expect(got[k] is not None, f"{version}, step {step}, group rank {g}: {k} has no .grad after "
                                                   "the step (a parameter without a gradient still takes part, as zeros)")
                    with breaks("ex02.A.dtype"):
                        expect_equal(str(got[k].dtype), str(w.dtype), f"{version}, step {step}, group rank {g}: dtype "
                                     f"of {k}.grad (each tensor's dtype is kept)")
                    with breaks(*(later or (f"ex02.{part}.group",))):
                        expect_close(got[k], w, "gradient: this rank's own (zeros without one) divided by 2, the "
                                     "group's size, as all_reduce_fn here leaves each tensor unchanged (any group)"
                                     + clean, where=f"{version}, step {step}, group rank {g}, {k}",
                                     rtol=1e-5, atol=1e-7)


@observes("ex02.A.average")
def test_naive_training_matches_single_process(impl):
    """Training the small GPT on 4 ranks with your averaging matches one process on the whole batch."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32)
    batches = data.batches(TOKENS, 2, 8, 16)
    results = minipar.launch(_naive_training, 4, args=(GPT(cfg, seed=1), batches), timeout=TIMEOUT)
    want = reference.train_reference(GPT(cfg, seed=1), batches, reference.sgd(0.5))
    for rank, got in enumerate(results):
        expect_same_training(got, want, f"rank {rank}", rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- B: buckets
def _bucket_clause(got, cap_bytes, sizes=(10, 300, 20, 20, 5, 1000, 7)):
    """The clause wrong buckets of the 7 parameters break first: the order, the cap, or fullness."""
    flat = [i for b in got for i in b]
    if flat != list(range(6, -1, -1)):
        return "ex02.B.order"
    if any(len(b) > 1 and 4 * sum(sizes[i] for i in b) > cap_bytes for b in got):
        return "ex02.B.cap"
    return "ex02.B.full"


@observes("ex02.B.order", "ex02.B.cap", "ex02.B.full", "ex02.B.dtype", "ex02.B.negative")
def test_assign_buckets(impl):
    """Buckets: every parameter once in the order backward makes them ready, the cap, full buckets, one dtype
    each."""
    params = [torch.nn.Parameter(torch.zeros(k)) for k in (10, 300, 20, 20, 5, 1000, 7)]
    index = {id(p): i for i, p in enumerate(params)}

    def ids(cap):
        return [[index[id(p)] for p in b] for b in assign_buckets(params, cap)]

    sizes = "parameters of 10, 300, 20, 20, 5, 1000, 7 floats (4 bytes each)"
    for cap_bytes, want in [(1200, [[6], [5], [4, 3, 2], [1], [0]]), (0, [[i] for i in range(6, -1, -1)]),
                            (25 * 2**20, [[6, 5, 4, 3, 2, 1, 0]]),
                            (180, [[6], [5], [4, 3, 2], [1], [0]]),     # 180 B exactly fits
                            (179, [[6], [5], [4, 3], [2], [1], [0]])]:
        got = ids(cap_bytes / 2**20)
        with breaks(_bucket_clause(got, cap_bytes)), diagnose(lambda f, got=got: sorted(i for b in got for i in b) == list(range(7)) and
                      [i for b in got for i in b] != list(range(6, -1, -1)),
                      "every parameter is in a bucket, not in the order backward makes gradients ready (the last "
                      "parameter's first)"):
            expect_equal(got, want, f"buckets (indices of the {sizes}) with a cap of {cap_bytes} B (no bucket exceeds the cap unless a "
                         "single parameter does; the order in which backward makes gradients ready)",
                         keys="bucket")
    mixed = [torch.nn.Parameter(torch.zeros(4, dtype=d)) for d in
             (torch.float32, torch.float32, torch.float64, torch.float32)]
    with breaks("ex02.B.dtype"):
        expect_equal([len(b) for b in assign_buckets(mixed, 25)], [1, 1, 2],
                     "bucket sizes for float32, float32, float64, float32 (one dtype per bucket)",
                     keys="bucket")
    try:
        assign_buckets(params, -1)
    except ValueError:
        pass
    else:
        with breaks("ex02.B.negative"):
            expect(False, "assign_buckets(params, -1) returned (a negative cap is a ValueError)")


# ----------------------------------------------------------------------------- C: reducer
def _ddp_training(model, batches, kw, accumulation, probe):
    """Train with the library's DDP; record when the last gradient was ready."""
    ddp = DistributedDataParallel(model, **kw)
    ready = []
    if probe:  # the token embedding's gradient is the last one backward computes
        model.embed.wte.weight.register_post_accumulate_grad_hook(lambda p: ready.append(trace.now()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    losses, since = [], len(trace.events())
    for x, y in batches:
        x, y = shard_batch((x, y))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j, (xm, ym) in enumerate(zip(x.chunk(accumulation), y.chunk(accumulation))):
            last = j == accumulation - 1
            with nullcontext() if last else ddp.no_sync():  # accumulate locally, sync on the last
                loss = ddp(xm, ym) / accumulation
                loss.backward()
            total += loss.item()
        opt.step()
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    evs = _grad_events(since)
    ddp.remove_hooks()
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in ddp.named_parameters()},
            "sent": sum(e["bytes_sent"] for e in evs), "calls": len(evs),
            "starts": [e["start"] for e in evs], "ready": ready,
            "buckets": len(assign_buckets(trainable(model.parameters()), kw["bucket_cap_mb"]))}


def _first_step_only(got, want) -> bool:
    """The first step's loss right, a later one wrong."""
    close = [math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL) for g, w in zip(got, want)]
    return len(close) > 1 and close[0] and not all(close[1:])


def _run_reducer(n, kw, accumulation=1, probe=False, cfg=CFG):
    batches = data.batches(TOKENS, STEPS, 8, cfg.block_size)
    results = minipar.launch(_ddp_training, n, args=(GPT(cfg, seed=1), batches, kw,
                                                     accumulation, probe), timeout=TIMEOUT)
    want = reference.train_reference(GPT(cfg, seed=1), batches, reference.sgd(0.5))
    psi = sum(p.numel() for p in GPT(cfg, seed=1).parameters())
    for rank, got in enumerate(results):
        with breaks("ex02.C.no_sync" if accumulation > 1 else "ex02.C.average"):
            with diagnose(_first_step_only(got["losses"], want["losses"]),
                          "the first step's loss is the single process's and a later step's is not: a step after the "
                          "first goes wrong (ex02.C.reset)"):
                expect_same_training(got, want, f"rank {rank}", rtol=RTOL, atol=ATOL)
        with breaks("ex02.C.bytes"):
            expect_equal(got["sent"], int(STEPS * cost.ddp_bytes_per_step(psi, n)),
                         f"rank {rank}: bytes sent in gradient all-reduces over {STEPS} steps (gradient traffic equals "
                         "cost.ddp_bytes_per_step per step; none inside no_sync)")
            expect_equal(got["calls"], STEPS * got["buckets"],
                         f"rank {rank}: gradient all-reduces over {STEPS} steps ({got['buckets']} buckets: one each per step)")
    return results


@observes("ex02.C.average", "ex02.C.reset")
def test_reducer_overlapped_matches_single_process(impl):
    """DDP with your overlapping Reducer (2 ranks, small buckets) matches one process; the bytes sent are the
    cost model's."""
    _run_reducer(2, dict(bucket_cap_mb=0.02, overlap=True))


@observes("ex02.C.bytes", "ex02.C.no_sync")
def test_reducer_accumulation_and_no_overlap(impl):
    """4 ranks, gradient accumulation over 2 micro-batches (no_sync), overlap=False: still equal."""
    _run_reducer(4, dict(bucket_cap_mb=0.02, overlap=False), accumulation=2)


@observes("ex02.C.overlap")
def test_reducer_overlaps_with_backward(impl):
    """With overlap=True the first buckets' all-reduces start before backward computes the last gradient."""
    cfg = GPTConfig(vocab_size=32, block_size=32, n_layer=4, n_head=2, n_embd=64)
    got = _run_reducer(2, dict(bucket_cap_mb=0.05, overlap=True), probe=True, cfg=cfg)[0]
    per_step = got["calls"] // STEPS
    early = [sum(t < got["ready"][s] for t in got["starts"][s * per_step:(s + 1) * per_step])
             for s in range(STEPS)]
    for s in range(STEPS):
        with diagnose(early[s] == 0, "no gradient all-reduce of this step started before the backward's "
                                     "last gradient"):
            expect(early[s] >= per_step - 1, f"step {s}: buckets whose all-reduce started while backward still "
                                             "ran (with overlap, a bucket's all-reduce starts during the backward): "
                                             f"expected at least {per_step - 1} of {per_step}, got {early[s]}; "
                                             f"per step: {early}")


def _two_groups():
    """4 ranks in two data-parallel groups of 2 ([0, 1] and [2, 3], the group named "dp"), real
    collectives, 2 steps per version: each rank's own gradient, the .grad after the call, and
    the group labels of the recorded gradient all-reduces."""
    import copy
    r = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]     # every rank creates both
    sub = groups[r // 2]
    minipar.comm.name_group(sub, "dp")
    out = {}
    for version, cap, overlap in SUBGROUP_VERSIONS:
        model, steps = MLP(seed=0), []
        ddp = None if cap is None else DistributedDataParallel(model, group=sub, bucket_cap_mb=cap, overlap=overlap)
        for step in range(2):
            x, y = data.regression_batches(1, 4, seed=100 * step + r)[0]     # different data on each rank
            local = copy.deepcopy(model)
            local(x, y).backward()
            for p in model.parameters():
                p.grad = None
            since = len(trace.events())
            (ddp or model)(x, y).backward()
            if ddp is None:
                allreduce_gradients(model.parameters(), sub)
            steps.append({"local": {k: p.grad.clone() for k, p in local.named_parameters()},
                          "got": {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()},
                          "dims": sorted({str(e["labels"].get("dim")) for e in _grad_events(since)})})
        if ddp is not None:
            ddp.remove_hooks()
        out[version] = steps
    return out


SUBGROUP_VERSIONS = (("A: allreduce_gradients", None, False),
                     ("C: Reducer, overlap=True", 0.005, True),
                     ("C: Reducer, overlap=False", 0.005, False))


@observes("ex02.C.group", "ex02.*.recorded")
def test_reducer_on_a_sub_group(impl):
    """4 ranks in two groups of 2, each its own data, real all-reduces: every version averages over
    its own group only, and every gradient all-reduce runs on that group, two steps."""
    results = minipar.launch(_two_groups, 4, timeout=TIMEOUT)
    for version, _, _ in SUBGROUP_VERSIONS:
        for step in range(2):
            for rank, res in enumerate(results):
                got = res[version][step]
                where = f"{version}, step {step}, rank {rank} (group {[rank // 2 * 2, rank // 2 * 2 + 1]}, named 'dp')"
                group = f"ex02.{version[0]}.group"
                with breaks("ex02.*.recorded" if got["dims"] == [] else group):
                    expect_equal(got["dims"], ["dp"], f"{where}: the group labels of the recorded gradient "
                                 "all-reduces (any group: every collective runs on ``group``; the world's label is "
                                 "'world'; none recorded: [])")
                mates = [results[q][version][step]["local"] for q in (rank // 2 * 2, rank // 2 * 2 + 1)]
                world = [results[q][version][step]["local"] for q in range(4)]
                for k in mates[0]:
                    want = (mates[0][k] + mates[1][k]) / 2
                    with breaks(group):
                        expect(got["got"][k] is not None, f"{where}: {k} has no .grad after the step")
                    over_world = lambda f, k=k: torch.allclose(got["got"][k], sum(w[k] for w in world) / 4,  # noqa: E731
                                                               rtol=1e-5, atol=1e-7)
                    with breaks(group), diagnose(over_world, "the gradient is the average over all 4 ranks, not over "
                                                             "the group's 2"):
                        expect_close(got["got"][k], want, "gradient (the average over this rank's group of 2, "
                                     "any group)", where=f"{where}, {k}", rtol=1e-5, atol=1e-7)
