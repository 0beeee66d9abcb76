"""Exercise 02: data parallelism, from a plain all-reduce to overlapped buckets.

Three pieces of minipar's data parallelism; the tests run the library's own
``DistributedDataParallel`` and training loops with your code in place. Every rank holds the
whole model and computes the gradient of the mean loss over its own shard of the batch.

A. ``allreduce_gradients(params, group=None, all_reduce_fn=None)``: afterwards every trainable
   parameter's ``.grad`` holds the same tensor on every rank, the gradient one process would
   compute on the whole batch (Goyal et al. 2017, eq. 1; notebook 02, "Why replicate").
   Frozen parameters stay without a gradient; a parameter without one on some rank still
   takes part (as zeros); every rank issues the same collectives in the same order. Recorded
   gradient traffic (``name="grad_all_reduce"``) equals ``cost.ddp_bytes_per_step``; with
   ``all_reduce_fn`` (e.g. your ring from exercise 01, which sums) the result is the same.

B. ``assign_buckets(params, bucket_cap_mb)`` -> a list of buckets (lists of parameters): the
   order in which backward makes gradients ready, cut so that no bucket exceeds
   ``bucket_cap_mb`` MiB unless a single parameter does, one dtype per bucket (a bucket is one
   flat tensor), none empty; a negative cap is a ValueError (notebook 02, "Naive → bucketed →
   overlapped"; Li et al. 2020, §3.2.2).

C. ``Reducer.grad_ready(p)``, ``Reducer.finish()`` and ``Reducer._launch_ready()``: overlap the
   bucket all-reduces with the backward (Li et al. 2020, §3.2.3). DDP calls ``grad_ready(p)``
   from a hook once ``p.grad`` is final and ``finish()`` when backward is over. With
   ``overlap`` on, a bucket's asynchronous all-reduce starts as soon as it is complete, yet
   every rank starts them in the same order; after ``finish()`` every ``.grad`` holds the
   average and the reducer is ready for the next step. The state the library's ``__init__``
   and ``reset`` keep (``buckets``, ``bucket_of``, ``pending``, ``ready``, ``next_bucket``,
   ``handles``) is described in the class.

Graded: the averages, training equal to one process (rtol 1e-5), the bucket layout, the
bytes, and that the first all-reduce starts before the backward ends. Grade it with
``python -m minipar.grade ex02``; stuck? ``minipar.hint("ex02", "A")`` (parts A, B, C).
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist

import minipar
from minipar.analysis import cost
from minipar import data, reference
from minipar.runtime import trace
from minipar.data_parallel import (DistributedDataParallel, allreduce_gradients, assign_buckets,
                                   shard_batch, trainable)
from minipar.course.grading import diagnose, expect, expect_close, expect_equal, expect_same_training
from minipar.models import GPT, MLP, GPTConfig

EXERCISE = "ex02_data_parallel"
HINTS = {
    'A': (
        'What must every rank do with its own gradient so that all ranks end with the full-batch '
        'gradient? Mind the ranks whose parameter has no gradient.',
        'One all-reduce per trainable parameter, in the same order everywhere, averaging; a '
        'missing gradient becomes zeros first; a summing all_reduce_fn needs one division.',
        'for p in trainable(params): if p.grad is None: p.grad = zeros_like(p); then '
        "comm.all_reduce(p.grad, op='avg', group=group, name='grad_all_reduce'), or "
        'all_reduce_fn(p.grad, group) followed by p.grad /= comm.group_size(group).',
    ),
    'B': (
        "Which parameter's gradient does backward produce first?",
        'Walk the parameters last to first; keep adding to the open bucket until the next one '
        'would overflow the cap or has another dtype; then open a new bucket.',
        'cap = bucket_cap_mb * 2**20 bytes; for p in reversed(list(params)): nbytes = p.numel() *'
        ' p.element_size(); start a new bucket if the current one is non-empty and (size + nbytes'
        ' > cap or p.dtype differs); append; a negative cap raises ValueError first.',
    ),
    'C': (
        "grad_ready is called once per parameter, in backward's order; a bucket can be reduced "
        'once all of its gradients are packed. What can go wrong if rank 0 launches bucket 2 '
        'before bucket 1?',
        'grad_ready packs p into its bucket and counts it down; _launch_ready walks from '
        'next_bucket while the bucket is complete and starts its async all-reduce (keeping the '
        'handle); finish packs zeros for parameters that never came, launches the rest in order, '
        'waits, unpacks, resets.',
        'grad_ready: i = self.bucket_of[id(p)]; self.buckets[i].pack(p); self.ready.add(id(p)); '
        'self.pending[i] -= 1; if self.overlap: self._launch_ready(). _launch_ready: while '
        'next_bucket < len(buckets) and pending[next_bucket] == 0: '
        "handles.append(comm.all_reduce(b.buffer, op='avg', group=self.group, async_op=True, "
        "name='grad_all_reduce')); next_bucket += 1. finish: pack the missing ones as zeros, set "
        'pending to 0, _launch_ready(), wait every handle, divide if all_reduce_fn summed, unpack'
        ' every bucket, self.reset().',
    ),
}
TIMEOUT = 30
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


def _check_average(results, n):
    psi = sum(p.numel() for p in trainable(_mlp_with_frozen_bias().parameters()))
    expected = int(cost.ddp_bytes_per_step(psi, n))
    for rank, (got, want, frozen_ok, sent) in enumerate(results):
        expect(frozen_ok, f"rank {rank}: a frozen parameter (requires_grad=False) got a gradient: "
                          "only trainable parameters take part")
        expect_equal(sorted(got), sorted(want), f"rank {rank}: the parameters that hold a gradient")
        for k in want:
            with diagnose(lambda f, k=k: torch.allclose(got[k], want[k] * n, rtol=1e-4, atol=1e-6),
                          f"yours is {n} times the average: the sum over the ranks, not divided by {n}"):
                expect_close(got[k], want[k], "gradient (the average of the ranks' gradients)",
                             where=f"rank {rank}, {k}", rtol=1e-5, atol=1e-6)
        with diagnose(sent > expected, "more bytes than one all-reduce of each trainable parameter: "
                                       "a parameter reduced twice, or a frozen one included?"):
            expect_equal(sent, expected, f"rank {rank}: bytes sent by the gradient all-reduces "
                                         f"(2(n-1)/n · Ψ · 4 with Ψ = {psi})")


def test_allreduce_gradients_averages(impl):
    """allreduce_gradients leaves the average of the ranks' gradients in every p.grad (4 ranks)."""
    _check_average(minipar.launch(_average_once, 4, args=(False,),
                                  timeout=TIMEOUT), 4)


def test_allreduce_gradients_with_your_all_reduce(impl):
    """With all_reduce_fn (here the ring all-reduce, which sums) the result is still the average."""
    _check_average(minipar.launch(_average_once, 2, args=(True,),
                                  timeout=TIMEOUT), 2)


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


def test_naive_training_matches_single_process(impl):
    """Training the small GPT on 4 ranks with your averaging matches one process on the whole batch."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32)
    batches = data.batches(TOKENS, 2, 8, 16)
    results = minipar.launch(_naive_training, 4, args=(GPT(cfg, seed=1), batches), timeout=TIMEOUT)
    want = reference.train_reference(GPT(cfg, seed=1), batches, reference.sgd(0.5))
    for rank, got in enumerate(results):
        expect_same_training(got, want, f"rank {rank}", rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- B: buckets
def test_assign_buckets(impl):
    """Buckets are filled last parameter first, never past the cap unless one parameter is bigger, one dtype each."""
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
        with diagnose(lambda f, got=got: sorted(i for b in got for i in b) == list(range(7)) and
                      [i for b in got for i in b] != list(range(6, -1, -1)),
                      "the order of the parameters: backward produces the last one's gradient first"):
            expect_equal(got, want, f"buckets (indices of the {sizes}) with a cap of {cap_bytes} B",
                         keys="bucket")
    mixed = [torch.nn.Parameter(torch.zeros(4, dtype=d)) for d in
             (torch.float32, torch.float32, torch.float64, torch.float32)]
    expect_equal([len(b) for b in assign_buckets(mixed, 25)], [1, 1, 2],
                 "bucket sizes for float32, float32, float64, float32 (a change of dtype starts a new bucket)",
                 keys="bucket")
    try:
        assign_buckets(params, -1)
    except ValueError:
        pass
    else:
        expect(False, "assign_buckets(params, -1) returned; a negative bucket_cap_mb should raise ValueError")


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
            "buckets": len(ddp.reducer.buckets)}


def _run_reducer(n, kw, accumulation=1, probe=False, cfg=CFG):
    batches = data.batches(TOKENS, STEPS, 8, cfg.block_size)
    results = minipar.launch(_ddp_training, n, args=(GPT(cfg, seed=1), batches, kw,
                                                     accumulation, probe), timeout=TIMEOUT)
    want = reference.train_reference(GPT(cfg, seed=1), batches, reference.sgd(0.5))
    psi = sum(p.numel() for p in GPT(cfg, seed=1).parameters())
    for rank, got in enumerate(results):
        expect_same_training(got, want, f"rank {rank}", rtol=RTOL, atol=ATOL)
        expect_equal(got["sent"], int(STEPS * cost.ddp_bytes_per_step(psi, n)),
                     f"rank {rank}: bytes sent in gradient all-reduces over {STEPS} steps (2(n-1)/n·Ψ·4 per step)")
        expect_equal(got["calls"], STEPS * got["buckets"],
                     f"rank {rank}: gradient all-reduces over {STEPS} steps ({got['buckets']} buckets: one each per step)")
    return results


def test_reducer_overlapped_matches_single_process(impl):
    """DDP with your overlapping Reducer (2 ranks, small buckets) matches one process; bytes 2(n-1)/n·Ψ·4."""
    _run_reducer(2, dict(bucket_cap_mb=0.02, overlap=True))


def test_reducer_accumulation_and_no_overlap(impl):
    """4 ranks, gradient accumulation over 2 micro-batches (no_sync), overlap=False: still equal."""
    _run_reducer(4, dict(bucket_cap_mb=0.02, overlap=False), accumulation=2)


def test_reducer_overlaps_with_backward(impl):
    """With overlap=True the first buckets' all-reduces start before backward computes the last gradient."""
    cfg = GPTConfig(vocab_size=32, block_size=32, n_layer=4, n_head=2, n_embd=64)
    got = _run_reducer(2, dict(bucket_cap_mb=0.05, overlap=True), probe=True, cfg=cfg)[0]
    per_step = got["calls"] // STEPS
    early = [sum(t < got["ready"][s] for t in got["starts"][s * per_step:(s + 1) * per_step])
             for s in range(STEPS)]
    for s in range(STEPS):
        with diagnose(early[s] == 0, "no all-reduce started before backward ended: grad_ready must launch "
                                     "each complete bucket at once (async), and only finish wait"):
            expect(early[s] >= per_step - 1, f"step {s}: buckets whose all-reduce started while backward still "
                                             f"ran: expected at least {per_step - 1} of {per_step}, got {early[s]}; "
                                             f"per step: {early}")
