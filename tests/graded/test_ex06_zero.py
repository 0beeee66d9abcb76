"""Graded tests for exercise 06: ZeRO stage 1's sharded step, stage 3's gather and free.

Run against the library and the solution in CI, and against your file by
``python -m minipar.grade ex06``. The last tests run the library's own ZeRO stages with
your functions plugged in and compare with single-process training.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import cost, data, reference
from minipar.models import GPT, GPTConfig

EXERCISE = "ex06_zero"
LIBRARY = "minipar.zero"
TIMEOUT = 60
CFG = dict(vocab_size=67, n_embd=30, n_head=2, n_layer=2, block_size=16)  # no unit divisible by 4
STEPS, BATCH = 3, 8


def _batches():
    toks, _ = data.corpus_tokens()
    return data.batches(toks, STEPS, BATCH, CFG["block_size"])


def _one_step(sharded_step):
    """Two units of 10 and 7 elements on the ranks, Adam on the shards; the result should be
    a full Adam step on the mean gradient."""
    r, n = dist.get_rank(), dist.get_world_size()
    sizes, fulls, grads, shards, want = [10, 7], [], [], [], []
    for u, m in enumerate(sizes):
        k = -(-m // n)
        w = torch.zeros(n * k)
        w[:m] = torch.linspace(-1, 1, m) * (u + 1)
        g = torch.zeros(n * k)
        g[:m] = torch.arange(m, dtype=torch.float32) * (r + 1) / 10
        ref = torch.nn.Parameter(w[:m].clone())
        ref.grad = torch.arange(m, dtype=torch.float32) * (n + 1) / 2 / 10   # mean over ranks
        torch.optim.Adam([ref], lr=0.1).step()
        want.append(ref.detach())
        fulls.append(w)
        grads.append(g)
        shards.append(torch.nn.Parameter(w[r * k:(r + 1) * k]))              # a view, like the library
    opt = torch.optim.Adam(shards, lr=0.1)
    sharded_step(fulls, grads, shards, opt)
    state = sum(v.numel() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    return [f[:m] for f, m in zip(fulls, sizes)], want, state, sum(-(-m // n) for m in sizes)


def test_sharded_step_is_a_full_step(impl):
    """After sharded_step every rank holds the full parameters of an Adam step on the mean
    gradient (4 ranks, unit sizes not divisible by 4), with optimizer state for its shard only.
    Hint: reduce-scatter with op="avg" into grad[r*k:(r+1)*k], set shard.grad, step, all-gather."""
    for rank, (got, want, state, k) in enumerate(minipar.launch(_one_step, 4, args=(impl.sharded_step,),
                                                                timeout=TIMEOUT)):
        for u, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, unit {u}: {m}")
        assert state == 2 * k, f"rank {rank}: optimizer state has {state} elements, expected 2 x {k}"


def _stage1(sharded_step):
    from minipar.zero import stage1, train
    saved = stage1.sharded_step
    stage1.sharded_step = sharded_step          # the library's ZeroOptimizer now calls yours
    try:
        return train(1, GPT(GPTConfig(**CFG), seed=0), _batches(), torch.optim.AdamW, lr=1e-2,
                     weight_decay=0.1)
    finally:
        stage1.sharded_step = saved


def _stage3(gather_unit, free_unit):
    from minipar.zero import stage3, train
    saved = stage3.gather_unit, stage3.free_unit
    stage3.gather_unit, stage3.free_unit = gather_unit, free_unit
    try:
        return train(3, GPT(GPTConfig(**CFG), seed=0), _batches(), torch.optim.AdamW, lr=1e-2,
                     weight_decay=0.1)
    finally:
        stage3.gather_unit, stage3.free_unit = saved


def _want():
    return reference.train_reference(GPT(GPTConfig(**CFG), seed=0), _batches(),
                                     lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))


def test_stage1_trains_like_one_process(impl):
    """ZeroOptimizer with your sharded_step: 4 ranks train the GPT like one process (AdamW,
    fp32), with optimizer state K·⌈Ψ_u/N⌉ per unit and 2(N-1)/N·Ψ bytes sent per step.
    Hint: all ranks must call the collectives in the same order: units first to last."""
    results = minipar.launch(_stage1, 4, args=(impl.sharded_step,), timeout=TIMEOUT)
    want = _want()
    for rank, got in enumerate(results):
        reference.assert_same_training(got, want, rtol=1e-4, atol=5e-5)
        want_state = cost.zero_bytes_per_rank(got["unit_sizes"], 4, 1, k=8)["optimizer"]
        assert got["memory"]["optimizer"] == want_state, f"rank {rank}: optimizer state bytes"
        assert got["comm_bytes"] == cost.zero_comm_bytes(got["unit_sizes"], 4, 1)


def _gather_free(gather_unit, free_unit):
    r, n = dist.get_rank(), dist.get_world_size()
    full = torch.empty(3 * n)
    view = full[1:4]                                  # a parameter-like view into the buffer
    free_unit(full)
    freed = full.untyped_storage().nbytes()
    shard = torch.arange(3, dtype=torch.float32) + 10 * r
    ret = gather_unit(full, shard)
    sync = (full.clone(), full.untyped_storage().nbytes(), ret is None, view.clone())
    free_unit(full)
    after = (full.untyped_storage().nbytes(), full.shape)
    handle = gather_unit(full, shard * 2, async_op=True)
    handle.wait()
    return freed, sync, after, full.clone()


def test_gather_and_free(impl):
    """free_unit empties the buffer's storage but keeps the tensor; gather_unit refills it with
    every rank's shard in rank order (views see the values), synchronously or with a Handle.
    Hint: full.untyped_storage().resize_(0) frees; resize_(numel * element_size) before gathering."""
    n = 2
    for rank, (freed, (vals, nbytes, is_none, view), (after, shape), async_vals) in enumerate(
            minipar.launch(_gather_free, n, args=(impl.gather_unit, impl.free_unit), timeout=TIMEOUT)):
        want = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * q for q in range(n)])
        assert freed == 0, "free_unit should leave the storage with 0 bytes"
        torch.testing.assert_close(vals, want)
        assert nbytes == 3 * n * 4 and is_none, "synchronous gather_unit: full storage, returns None"
        torch.testing.assert_close(view, want[1:4])
        assert after == 0 and tuple(shape) == (3 * n,), "free_unit must keep the tensor's shape"
        torch.testing.assert_close(async_vals, 2 * want)


def test_stage3_trains_like_one_process(impl):
    """FullyShardedDataParallel with your gather_unit/free_unit: 2 ranks train the GPT like
    one process, hold only (4+4+8)·⌈Ψ_u/N⌉ bytes per unit after the step, send 3(N-1)/N·Ψ.
    Hint: gather_unit must pass async_op and **labels on to minipar.comm.all_gather."""
    results = minipar.launch(_stage3, 2, args=(impl.gather_unit, impl.free_unit), timeout=TIMEOUT)
    want = _want()
    for rank, got in enumerate(results):
        reference.assert_same_training(got, want, rtol=1e-4, atol=5e-5)
        formula = cost.zero_bytes_per_rank(got["unit_sizes"], 2, 3, k=8, dtype_bytes=4)
        assert {k: got["memory"][k] for k in formula} == formula, f"rank {rank}"
        assert got["comm_bytes"] == cost.zero_comm_bytes(got["unit_sizes"], 2, 3)
