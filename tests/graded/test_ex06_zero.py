"""Exercise 06: ZeRO, the moves that remove redundancy (Rajbhandari et al. 2020).

Layout (``minipar/zero/flat.py``): a unit's parameters (one layer) are one flat vector,
zero-padded to N·k elements, k = ⌈Ψ_u/N⌉; rank r owns elements [r·k, (r+1)·k). Move data
only with ``minipar.comm.reduce_scatter`` and ``minipar.comm.all_gather`` (flat tensors;
they record the bytes for the grader).

A. ``reduce_shard(flat_grad, group, **labels)`` (``minipar/zero/reduce.py``), P_g, the reduce
   path every stage shares: reduce-scatter ``flat_grad`` with ``op="avg"`` in place, so that
   this rank's slice ``flat_grad[r·k:(r+1)·k]`` holds ḡ_r = (1/N) Σ_j g_j[r·k:(r+1)·k],
   and return that slice (a view). Pass ``**labels`` on.
B. ``sharded_step(flat_params, grad_shards, shards, optimizer, group)``
   (``minipar/zero/stage1.py``), P_os, the step of stages 1 and 2: for every unit u make
   ``grad_shards[u]`` the ``.grad`` of ``shards[u]`` (cast to the shard's dtype if it
   differs), call ``optimizer.step()`` once (it only knows the shards, so its state is
   1/N), then all-gather every updated shard (cast to ``flat_params[u]``'s dtype) into
   ``flat_params[u]``.
C. ``gather_unit`` and ``free_unit`` (``minipar/zero/stage3.py``), P_p. ``gather_unit``,
   gather-before-use: ``full``'s storage may have been freed; give it back its bytes
   (``full.untyped_storage().resize_(nbytes)``), then all-gather every rank's ``shard`` into
   it; return the Handle when ``async_op`` (the library prefetches the next unit that way),
   else None; pass ``**labels`` on. ``free_unit``, free-after-use: release ``full``'s memory
   but keep the tensor itself (the model's parameters are views into it).

The last tests train the GPT with the library's own ZeRO stages 1, 2 and 3 running your
code, and compare with one process. Grade it with ``python -m minipar.grade ex06``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import cost, data, reference, trace, zero
from minipar.grading import diagnose, expect, expect_close, expect_equal, expect_same_training
from minipar.models import GPT, GPTConfig

EXERCISE = "ex06_zero"
TIMEOUT = 60
CFG = dict(vocab_size=67, n_embd=30, n_head=2, n_layer=2, block_size=16)  # no unit divisible by 4
STEPS, BATCH = 3, 8


def _batches():
    toks, _ = data.corpus_tokens()
    return data.batches(toks, STEPS, BATCH, CFG["block_size"])


def _grad(r, m, n):
    """Rank r's padded flat gradient of a unit of m elements."""
    k = -(-m // n)
    g = torch.zeros(n * k)
    g[:m] = torch.arange(m, dtype=torch.float32) * (r + 1) / 10
    return g


# ----------------------------------------------------------------------------- A: reduce_shard
def _reduce(m):
    r, n = dist.get_rank(), dist.get_world_size()
    flat = _grad(r, m, n)
    mark = trace.mark()
    mine = zero.reduce_shard(flat, None)
    sent = sum(e["bytes_sent"] for e in trace.since(mark))
    k = flat.numel() // n
    return mine.clone(), mine.data_ptr() == flat[r * k:].data_ptr(), sent, flat.numel()


def test_reduce_shard(impl):
    """reduce_shard leaves the mean over ranks of this rank's k elements in its own slice, and
    returns that slice; each rank sends (N-1)/N of the unit (4 ranks, 10 elements padded to 12)."""
    n, m = 4, 10
    mean = sum(_grad(q, m, n) for q in range(n)) / n
    total = sum(_grad(q, m, n) for q in range(n))
    for r, (mine, in_place, sent, numel) in enumerate(minipar.launch(_reduce, n, args=(m,), timeout=TIMEOUT)):
        want = mean[r * 3:(r + 1) * 3]
        with diagnose(lambda e: mine.shape == want.shape and torch.allclose(mine, total[r * 3:(r + 1) * 3]),
                      f"yours is the sum: op=\"avg\" divides by the {n} ranks"):
            with diagnose(lambda e: any(mine.shape == want.shape and torch.allclose(mine, mean[q * 3:(q + 1) * 3])
                                        for q in range(n) if q != r), "that is another rank's slice: rank r "
                          "owns elements r·k .. (r+1)·k - 1"):
                expect_close(mine, want, f"the slice reduce_shard returned (the mean of elements {r * 3}..{r * 3 + 2})",
                             where=f"rank {r}", rtol=1.3e-6, atol=1e-5)
        expect(in_place, f"rank {r}: reduce_shard must return the view flat_grad[r·k:(r+1)·k], reduced in place "
                         "(it returned another tensor)")
        expect_equal(sent, int(cost.collective_bytes("reduce_scatter", numel * 4, n)),
                     f"rank {r}: bytes sent (one reduce-scatter of {numel} floats)")


# ----------------------------------------------------------------------------- B: sharded_step
def _one_step():
    """Two units of 10 and 7 elements, Adam on the shards: the result should be a full Adam
    step on the mean gradient."""
    r, n = dist.get_rank(), dist.get_world_size()
    sizes, fulls, grad_shards, shards, want = [10, 7], [], [], [], []
    for u, m in enumerate(sizes):
        k = -(-m // n)
        w = torch.zeros(n * k)
        w[:m] = torch.linspace(-1, 1, m) * (u + 1)
        mean = sum(_grad(q, m, n) for q in range(n)) / n
        ref = torch.nn.Parameter(w[:m].clone())
        ref.grad = mean[:m].clone()
        torch.optim.Adam([ref], lr=0.1).step()
        want.append(ref.detach())
        fulls.append(w)
        grad_shards.append(mean[r * k:(r + 1) * k].clone())                 # what reduce_shard gives
        shards.append(torch.nn.Parameter(w[r * k:(r + 1) * k]))              # a view, like the library
    opt = torch.optim.Adam(shards, lr=0.1)
    zero.sharded_step(fulls, grad_shards, shards, opt, None)
    state = sum(v.numel() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    return [f[:m] for f, m in zip(fulls, sizes)], want, state, sum(-(-m // n) for m in sizes)


def test_sharded_step_is_a_full_step(impl):
    """After sharded_step every rank holds the full parameters of an Adam step on the mean
    gradient (4 ranks, unit sizes not divisible by 4), with optimizer state for its shard only."""
    for rank, (got, want, state, k) in enumerate(minipar.launch(_one_step, 4, timeout=TIMEOUT)):
        for u, (g, w) in enumerate(zip(got, want)):
            expect_close(g, w, "full parameters after the step (one Adam step on the mean gradient)",
                         where=f"rank {rank}, unit {u}", rtol=1e-6, atol=1e-6)
        expect_equal(state, 2 * k, f"rank {rank}: optimizer state elements (Adam's 2 per element of its "
                                   f"shards, {k} elements)")


# ----------------------------------------------------------------------------- training
def _stages(stages):
    """The library's zero.train under each stage, in one launch."""
    out = {}
    for stage in stages:
        res = zero.train(GPT(GPTConfig(**CFG), seed=0), _batches(), reference.adamw(1e-2, 0.1), stage=stage)
        m = res["measured"]
        out[stage] = {"losses": res["losses"], "params": res["params"], "memory": m["memory"],
                      "comm_bytes": m["bytes_sent"], "unit_sizes": m["unit_sizes"]}
    return out


def _want():
    return reference.train_reference(GPT(GPTConfig(**CFG), seed=0), _batches(), reference.adamw(1e-2, 0.1))


def test_stages_1_and_2_train_like_one_process(impl):
    """The library's ZeRO-1 and ZeRO-2 (both step with your sharded_step on your reduce_shard)
    train the GPT on 4 ranks like one process (AdamW, fp32), with optimizer state
    K·⌈Ψ_u/N⌉ per unit and 2(N-1)/N·Ψ bytes sent per step."""
    results = minipar.launch(_stages, 4, args=([1, 2],), timeout=TIMEOUT)
    want = _want()
    for rank, got in enumerate(results):
        for stage, res in got.items():
            expect_same_training(res, want, f"rank {rank}, ZeRO-{stage}", rtol=1e-4, atol=5e-5)
            want_state = cost.zero_bytes_per_rank(res["unit_sizes"], 4, stage, k=8)["optimizer"]
            expect_equal(res["memory"]["optimizer"], want_state,
                         f"rank {rank}, ZeRO-{stage}: optimizer state bytes (K·⌈Ψ_u/N⌉ per unit)")
            expect_equal(res["comm_bytes"], cost.zero_comm_bytes(res["unit_sizes"], 4, stage),
                         f"rank {rank}, ZeRO-{stage}: bytes sent per run (2(N-1)/N·Ψ per step)")


# ----------------------------------------------------------------------------- C: gather and free
def _gather_free():
    r, n = dist.get_rank(), dist.get_world_size()
    full = torch.empty(3 * n)
    view = full[1:4]                                  # a parameter-like view into the buffer
    zero.free_unit(full)
    freed = full.untyped_storage().nbytes()
    shard = torch.arange(3, dtype=torch.float32) + 10 * r
    ret = zero.gather_unit(full, shard)
    sync = (full.clone(), full.untyped_storage().nbytes(), ret is None, view.clone())
    zero.free_unit(full)
    after = (full.untyped_storage().nbytes(), full.shape)
    handle = zero.gather_unit(full, shard * 2, async_op=True)
    handle.wait()
    return freed, sync, after, full.clone()


def test_gather_and_free(impl):
    """free_unit empties the buffer's storage but keeps the tensor; gather_unit refills it with
    every rank's shard in rank order (views see the values), synchronously or with a Handle."""
    n = 2
    for rank, (freed, (vals, nbytes, is_none, view), (after, shape), async_vals) in enumerate(
            minipar.launch(_gather_free, n, timeout=TIMEOUT)):
        want = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * q for q in range(n)])
        where = f"rank {rank}"
        expect_equal(freed, 0, f"{where}: storage bytes after free_unit")
        expect_close(vals, want, "the gathered unit (every rank's shard, in rank order)", where=where, rtol=0, atol=0)
        expect_equal({"storage bytes": nbytes, "returns None": is_none}, {"storage bytes": 3 * n * 4, "returns None": True},
                     f"{where}: synchronous gather_unit")
        expect_close(view, want[1:4], "a view into the unit (a parameter) after the gather", where=where, rtol=0, atol=0)
        expect_equal({"storage bytes": after, "shape": tuple(shape)}, {"storage bytes": 0, "shape": (3 * n,)},
                     f"{where}: after the second free_unit (memory released, the tensor kept)")
        expect_close(async_vals, 2 * want, "the unit gathered with async_op=True, after handle.wait()",
                     where=where, rtol=0, atol=0)


def test_stage3_trains_like_one_process(impl):
    """The library's FullyShardedDataParallel with your gather_unit/free_unit (and reduce_shard):
    2 ranks train the GPT like one process, hold only (4+4+8)·⌈Ψ_u/N⌉ bytes per unit after
    the step, send 3(N-1)/N·Ψ."""
    results = minipar.launch(_stages, 2, args=([3],), timeout=TIMEOUT)
    want = _want()
    for rank, got in enumerate(results):
        got = got[3]
        expect_same_training(got, want, f"rank {rank}, ZeRO-3", rtol=1e-4, atol=5e-5)
        formula = cost.zero_bytes_per_rank(got["unit_sizes"], 2, 3, k=8, dtype_bytes=4)
        expect_equal({k: got["memory"][k] for k in formula}, formula,
                     f"rank {rank}, ZeRO-3: bytes held after the step, by kind", keys="kind")
        expect_equal(got["comm_bytes"], cost.zero_comm_bytes(got["unit_sizes"], 2, 3),
                     f"rank {rank}, ZeRO-3: bytes sent per run (3(N-1)/N·Ψ per step)")
