"""Exercise 02: data parallelism, from a plain all-reduce to an overlapped, bucketed DDP.

Every rank holds the whole model and computes the gradient of the mean loss over its own
shard of the batch; after the backward, every rank must hold the gradient one process would
compute on the whole batch (Goyal et al. 2017, eq. 1; notebook 02, "Why replicate"). The tests
run the library's own ``DistributedDataParallel`` and training loops with your code in place.
The contract, for every part:

* **every trainable parameter's ``.grad`` holds the average** of the ranks' gradients, the same
  tensor on every rank; **frozen parameters stay without a gradient**;
* **a parameter without a gradient still takes part, as zeros** (on a rank where backward
  did not reach it): afterwards it holds the average, and
  **every rank issues the same collectives in the same order**;
* **each tensor's dtype is kept** (a float64 parameter's gradient stays float64);
* **any group**: averages over ``group``'s ranks (a sub-group of the world too), dividing by
  its size;
* **gradient traffic equals cost.ddp_bytes_per_step**: each gradient is all-reduced once
  per step (``name="grad_all_reduce"``); with ``all_reduce_fn(tensor, group)`` (your ring from
  exercise 01, which sums in place) the result is the same.

A. ``allreduce_gradients(params, group=None, all_reduce_fn=None)``: after the backward, one
   all-reduce per trainable parameter.

B. ``assign_buckets(params, bucket_cap_mb)`` -> a list of buckets (lists of parameters):
   **the order in which backward makes gradients ready**, cut so that
   **no bucket exceeds the cap unless a single parameter does** (sizes the cap does not
   divide), **one dtype per bucket** (a bucket is one flat tensor), none empty;
   **a negative cap is a ValueError** (Li et al. 2020, §3.2.2).

C. The overlapped reducer and the hooks that feed it (Li et al. 2020, §3.2.3): design the
   ``Reducer``'s state (``__init__``, ``reset``) and its ``grad_ready(p)``, ``finish()`` and
   ``_launch_ready()``, and ``DistributedDataParallel``'s hooks (``_attach``, ``_grad_hook``, ``_finish``,
   ``forward``). The library's ``Bucket`` (``pack``,
   ``unpack``, ``buffer``) is yours to use. The reducer takes the parameters, ``group``,
   ``bucket_cap_mb``, ``overlap`` and ``all_reduce_fn``; DDP calls ``grad_ready(p)`` once
   ``p.grad`` is final and ``finish()`` once backward is over (a callback queued on
   autograd's engine).
   **With overlap, a bucket's all-reduce starts during the backward**, asynchronously, as
   soon as the bucket is complete, yet in the same bucket order on every rank;
   ``overlap=False`` all-reduces every bucket in ``finish``; with ``all_reduce_fn`` the
   reducer calls it, synchronously, once per bucket.
   **A second step starts from a clean state** (the reducer is reset after each ``finish``).
   **Under no_sync, backward only accumulates** (``require_sync`` is False): the first
   synced backward after it all-reduces the accumulated sum (gradient accumulation).

Graded: the averages, training equal to one process (rtol 1e-5), the bucket layout, the
bytes, a 3-rank run whose group is 2 of them with a gradient-less float64 parameter, and that
the first all-reduces start before the backward ends. Grade it with
``python -m minipar.grade ex02``; stuck? ``minipar.hint("ex02", "A")`` (parts A, B, C).
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
from minipar.course.grading import diagnose, expect, expect_close, expect_equal, expect_same_training, observes
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
        'Which state does one backward need (a bucket per parameter, how many gradients each '
        'bucket still waits for, which bucket is next, the in-flight handles), and which of it '
        'must be fresh for the next step? What can go wrong if rank 0 launches bucket 2 before '
        'bucket 1, or if a rank never sees one parameter\'s gradient?',
        '__init__: the Bucket list from assign_buckets and a map parameter -> bucket; reset: '
        'the counters. grad_ready packs p into its bucket and counts it down; _launch_ready walks '
        'from next_bucket while the bucket is complete and starts its async all-reduce (keeping '
        'the handle); finish packs zeros for parameters that never came, launches the rest in '
        'order, waits, unpacks, resets. DDP: a post-accumulate-grad hook per parameter; the first '
        'hook of a backward queues finish on autograd\'s engine; a forward after a failed '
        'backward forgets it.',
        "Reducer.__init__: self.n = comm.group_size(group); self.buckets = [Bucket(ps) for ps in "
        "assign_buckets(params, bucket_cap_mb)]; self.bucket_of = {id(p): i ...}; self.reset(). "
        "reset: pending = [len(b.params) ...], ready = set(), next_bucket = 0, handles = []. "
        'grad_ready: skip a repeated p; i = self.bucket_of[id(p)]; pack; pending[i] -= 1; if '
        'overlap: _launch_ready(). _launch_ready: while next_bucket < len(buckets) and '
        "pending[next_bucket] == 0: all_reduce_fn(b.buffer, group) or handles.append("
        "comm.all_reduce(b.buffer, op='avg', group=self.group, async_op=True, "
        "name='grad_all_reduce', bucket=i)) (wait at once without overlap); next_bucket += 1. "
        'finish: pack the missing ones, pending = 0, _launch_ready(), wait every handle, divide '
        'if all_reduce_fn summed, unpack, reset(). DDP: self._hooks = '
        '[p.register_post_accumulate_grad_hook(self._grad_hook) for p in self._params]; '
        '_grad_hook: return under no_sync; on the first call '
        'torch.autograd.Variable._execution_engine.queue_callback(self._finish); '
        'reducer.grad_ready(p) (naive: nothing); _finish: allreduce_gradients(...) for the naive '
        'version, else reducer.finish().',
    ),
}
CONTRACT = {
    "every trainable parameter's ``.grad`` holds the average": (
        "test_allreduce_gradients_averages", "test_reducer_overlapped_matches_single_process"),
    "frozen parameters stay without a gradient": "test_allreduce_gradients_averages",
    "a parameter without a gradient still takes part, as zeros": "test_gradient_less_parameter_dtype_group_two_steps",
    "every rank issues the same collectives in the same order": "test_gradient_less_parameter_dtype_group_two_steps",
    "each tensor's dtype is kept": "test_gradient_less_parameter_dtype_group_two_steps",
    "any group": "test_gradient_less_parameter_dtype_group_two_steps",
    "gradient traffic equals cost.ddp_bytes_per_step": (
        "test_allreduce_gradients_averages", "test_reducer_accumulation_and_no_overlap"),
    "the order in which backward makes gradients ready": "test_assign_buckets",
    "no bucket exceeds the cap unless a single parameter does": "test_assign_buckets",
    "one dtype per bucket": "test_assign_buckets",
    "a negative cap is a ValueError": "test_assign_buckets",
    "With overlap, a bucket's all-reduce starts during the backward": "test_reducer_overlaps_with_backward",
    "A second step starts from a clean state": (
        "test_gradient_less_parameter_dtype_group_two_steps", "test_reducer_overlapped_matches_single_process"),
    "Under no_sync, backward only accumulates": "test_reducer_accumulation_and_no_overlap",
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
        expect(frozen_ok, f"rank {rank}: a frozen parameter (requires_grad=False) holds a gradient after the "
                          "call (frozen parameters stay without a gradient)")
        expect_equal(sorted(got), sorted(want), f"rank {rank}: the parameters that hold a gradient")
        for k in want:
            with diagnose(lambda f, k=k: torch.allclose(got[k], want[k] * n, rtol=1e-4, atol=1e-6),
                          f"the gradient is {n} times the average: the sum over the {n} ranks"):
                expect_close(got[k], want[k], "gradient (the average of the ranks' gradients)",
                             where=f"rank {rank}, {k}", rtol=1e-5, atol=1e-6)
        with diagnose(sent > expected, "more bytes than one all-reduce of each trainable parameter"):
            expect_equal(sent, expected, f"rank {rank}: bytes sent by the gradient all-reduces "
                                         f"(cost.ddp_bytes_per_step for Ψ = {psi} parameters over {n} ranks)")


@observes('ex02.*.average', 'ex02.*.frozen', 'ex02.*.bytes', 'ex02.*.recorded')
def test_allreduce_gradients_averages(impl):
    """allreduce_gradients leaves the average of the ranks' gradients in every p.grad (4 ranks)."""
    _check_average(minipar.launch(_average_once, 4, args=(False,),
                                  timeout=TIMEOUT), 4)


@observes('ex02.A.all_reduce_fn', 'ex02.*.average')
def test_allreduce_gradients_with_your_all_reduce(impl):
    """With all_reduce_fn given (the ring all-reduce), every .grad is still the mean."""
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


@observes('ex02.*.zeros', 'ex02.*.same_order', 'ex02.*.dtype', 'ex02.*.group', 'ex02.C.reset')
def test_gradient_less_parameter_dtype_group_two_steps(impl):
    """On a group of 2 of 3 ranks, two steps, a float64 parameter with no gradient on one rank: the group's
    mean, the dtypes, the second step."""
    results = minipar.launch(_participation, 3, timeout=TIMEOUT)[1:]
    for version in results[0]:
        for g, res in enumerate(results):
            err = res[version][2]
            expect(err is None, f"{version}: group rank {g} (global rank {g + 1}) raised {err}")
        calls = [res[version][0] for res in results]
        for step in range(2):
            clean = " (a second step starts from a clean state)" if step else ""
            expect_equal(calls[1][step], calls[0][step],
                         f"{version}, step {step}: the all_reduce_fn calls (dtype, elements, group size) of "
                         "group rank 1, whose float64 parameter 'extra' has no gradient, against group rank 0's "
                         "(a parameter without a gradient still takes part, as zeros; every rank issues the "
                         f"same collectives in the same order){clean}", keys="call")
            expect(all(k == 2 for _, _, k in calls[0][step]),
                   f"{version}, step {step}: all_reduce_fn was given a group of sizes "
                   f"{[k for _, _, k in calls[0][step]]}, expected the group of 2 (any group)")
            for g, res in enumerate(results):
                got, want, frozen_ok = res[version][1][step]
                expect(frozen_ok, f"{version}, step {step}, group rank {g}: the frozen parameter holds a "
                                  "gradient (frozen parameters stay without a gradient)")
                for k, w in want.items():
                    expect(got[k] is not None, f"{version}, step {step}, group rank {g}: {k} has no .grad after "
                                               "the step (a parameter without a gradient still takes part, as zeros)")
                    expect_equal(str(got[k].dtype), str(w.dtype), f"{version}, step {step}, group rank {g}: dtype "
                                 f"of {k}.grad (each tensor's dtype is kept)")
                    expect_close(got[k], w, "gradient: this rank's own (zeros without one) divided by 2, the "
                                 "group's size, as all_reduce_fn here leaves each tensor unchanged (any group)"
                                 + clean, where=f"{version}, step {step}, group rank {g}, {k}",
                                 rtol=1e-5, atol=1e-7)


@observes('ex02.A.training')
def test_naive_training_matches_single_process(impl):
    """Training the small GPT on 4 ranks with your averaging matches one process on the whole batch."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32)
    batches = data.batches(TOKENS, 2, 8, 16)
    results = minipar.launch(_naive_training, 4, args=(GPT(cfg, seed=1), batches), timeout=TIMEOUT)
    want = reference.train_reference(GPT(cfg, seed=1), batches, reference.sgd(0.5))
    for rank, got in enumerate(results):
        expect_same_training(got, want, f"rank {rank}", rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- B: buckets
@observes('ex02.B.ready_order', 'ex02.B.cap', 'ex02.B.one_dtype', 'ex02.B.negative_cap')
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
        with diagnose(lambda f, got=got: sorted(i for b in got for i in b) == list(range(7)) and
                      [i for b in got for i in b] != list(range(6, -1, -1)),
                      "every parameter is in a bucket, not in the order backward makes gradients ready (the last "
                      "parameter's first)"):
            expect_equal(got, want, f"buckets (indices of the {sizes}) with a cap of {cap_bytes} B (no bucket exceeds the cap unless a "
                         "single parameter does; the order in which backward makes gradients ready)",
                         keys="bucket")
    mixed = [torch.nn.Parameter(torch.zeros(4, dtype=d)) for d in
             (torch.float32, torch.float32, torch.float64, torch.float32)]
    expect_equal([len(b) for b in assign_buckets(mixed, 25)], [1, 1, 2],
                 "bucket sizes for float32, float32, float64, float32 (one dtype per bucket)",
                 keys="bucket")
    try:
        assign_buckets(params, -1)
    except ValueError:
        pass
    else:
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
        with diagnose(_first_step_only(got["losses"], want["losses"]),
                      "the first step's loss is the single process's and a later step's is not: a step after the "
                      "first goes wrong (ex02.C.reset)"):
            expect_same_training(got, want, f"rank {rank}", rtol=RTOL, atol=ATOL)
        expect_equal(got["sent"], int(STEPS * cost.ddp_bytes_per_step(psi, n)),
                     f"rank {rank}: bytes sent in gradient all-reduces over {STEPS} steps (gradient traffic equals "
                     "cost.ddp_bytes_per_step per step; none inside no_sync)")
        expect_equal(got["calls"], STEPS * got["buckets"],
                     f"rank {rank}: gradient all-reduces over {STEPS} steps ({got['buckets']} buckets: one each per step)")
    return results


@observes('ex02.*.average', 'ex02.C.reset')
def test_reducer_overlapped_matches_single_process(impl):
    """DDP with your overlapping Reducer (2 ranks, small buckets) matches one process; the bytes sent are the
    cost model's."""
    _run_reducer(2, dict(bucket_cap_mb=0.02, overlap=True))


@observes('ex02.*.bytes', 'ex02.C.no_sync')
def test_reducer_accumulation_and_no_overlap(impl):
    """4 ranks, gradient accumulation over 2 micro-batches (no_sync), overlap=False: still equal."""
    _run_reducer(4, dict(bucket_cap_mb=0.02, overlap=False), accumulation=2)


@observes('ex02.C.overlap')
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


@observes("ex02.*.group", "ex02.C.group", "ex02.*.recorded")
def test_reducer_on_a_sub_group(impl):
    """4 ranks in two groups of 2, each its own data, real all-reduces: every version averages over
    its own group only, and every gradient all-reduce runs on that group, two steps."""
    results = minipar.launch(_two_groups, 4, timeout=TIMEOUT)
    for version, _, _ in SUBGROUP_VERSIONS:
        for step in range(2):
            for rank, res in enumerate(results):
                got = res[version][step]
                where = f"{version}, step {step}, rank {rank} (group {[rank // 2 * 2, rank // 2 * 2 + 1]}, named 'dp')"
                expect_equal(got["dims"], ["dp"], f"{where}: the group labels of the recorded gradient all-reduces "
                             "(any group: every collective runs on ``group``; the world's label is 'world'; "
                             "none recorded: [])")
                mates = [results[q][version][step]["local"] for q in (rank // 2 * 2, rank // 2 * 2 + 1)]
                world = [results[q][version][step]["local"] for q in range(4)]
                for k in mates[0]:
                    want = (mates[0][k] + mates[1][k]) / 2
                    expect(got["got"][k] is not None, f"{where}: {k} has no .grad after the step")
                    with diagnose(lambda f, k=k: torch.allclose(got["got"][k], sum(w[k] for w in world) / 4,
                                                                rtol=1e-5, atol=1e-7),
                                  "the gradient is the average over all 4 ranks, not over the group's 2"):
                        expect_close(got["got"][k], want, "gradient (the average over this rank's group of 2, "
                                     "any group)", where=f"{where}, {k}", rtol=1e-5, atol=1e-7)
