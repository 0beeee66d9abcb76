"""Exercise 06: ZeRO, the moves that remove redundancy (Rajbhandari et al. 2020).

Every stage shares one layout: a unit's (a layer's) parameters are one flat vector,
zero-padded to N·k elements for N data-parallel ranks, and rank r owns the r-th of N equal
slices. Data moves only through ``minipar.comm.reduce_scatter`` and
``minipar.comm.all_gather`` (flat tensors; they record the bytes the grader counts).

A. ``reduce_shard(flat_grad, group=None, **labels)``, P_g, the reduce path every stage
   shares. In: this rank's full padded flat gradient of one unit. Out: this rank's slice,
   holding the mean over the group's ranks of that slice, returned as a view of
   ``flat_grad`` (reduced in place, no copy). Each rank sends (N-1)/N of the unit's bytes;
   ``**labels`` reach the collective.
B. ``sharded_step(flat_params, grad_shards, shards, optimizer, group=None)``, P_os, the step
   of stages 1 and 2. In: per unit, the full flat parameters, this rank's reduced gradient
   slice, and the leaf tensor (this rank's slice) the optimizer owns. Out: nothing returned;
   afterwards every rank's ``flat_params`` hold the parameters of one full optimizer step on
   the mean gradient, while the optimizer only ever saw (and kept state for) this rank's
   slices. Dtypes may differ between the gradient, the shard and the flat parameters (mixed
   precision): each tensor keeps its own.
C. ``gather_unit(full, shard, group=None, async_op=False, **labels)`` and ``free_unit(full)``,
   P_p, stage 3's gather-before-use and free-after-use. ``free_unit`` releases the memory of
   ``full`` but keeps the tensor, its shape and every view into it (the model's parameters
   are such views). ``gather_unit`` makes ``full`` hold every rank's ``shard`` in rank order
   again, whether or not its memory was released; with ``async_op`` it returns the
   collective's Handle (the library prefetches the next unit that way), else None.

Derived in notebook 06, "Each stage removes one redundancy", "What it costs in
communication" and "Stage 3 in time" (the paper's §5.1-5.3 and Figure 1). The last tests
train the GPT with the library's ZeRO stages 1, 2 and 3 running your code and compare with
one process. Stuck? ``minipar.hint("ex06", "A")`` (or "B", "C"). Grade it with
``python -m minipar.grade ex06``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar.analysis import cost
from minipar import data, reference, zero
from minipar.runtime import trace
from minipar.course.grading import diagnose, expect, expect_close, expect_equal, expect_same_training
from minipar.models import GPT, GPTConfig

EXERCISE = "ex06_zero"
HINTS = {
    "A": ("Which collective leaves each rank with the reduction of only its own slice? Its "
          "output can live inside its input.",
          "A reduce-scatter with the mean (op=\"avg\") whose output is this rank's slice of the "
          "flat gradient itself: the slice's length is the flat length over the group size, its "
          "offset the rank's index times that length.",
          "n, r = group_size(group), group_rank(group); k = flat_grad.numel() // n; "
          "mine = flat_grad[r*k:(r+1)*k]; reduce_scatter(mine, flat_grad, op=\"avg\", "
          "group=group, **labels); return mine."),
    "B": ("The optimizer only knows the shards: what must a shard carry before step() so that the "
          "optimizer updates it, and how do the other ranks learn the new values?",
          "Attach each reduced gradient slice as its shard's .grad (in the shard's dtype), step the "
          "optimizer once for all units, then rebuild every unit's full parameters from all ranks' "
          "updated shards, unit after unit in the same order on every rank.",
          "for s, g in zip(shards, grad_shards): s.grad = g.to(s.dtype); optimizer.step(); "
          "for f, s in zip(flat_params, shards): all_gather(f, s.detach().to(f.dtype), group=group)."),
    "C": ("A tensor is a view onto a storage; the storage can shrink to nothing and grow back "
          "without the tensor (or views of it) changing shape.",
          "free_unit resizes the untyped storage to 0 bytes. gather_unit first resizes it back to "
          "numel × element_size bytes, then all-gathers every rank's shard into it, forwarding "
          "async_op and the labels, and returns what the all-gather returns.",
          "free: full.untyped_storage().resize_(0). gather: full.untyped_storage().resize_("
          "full.numel() * full.element_size()); return all_gather(full, shard.detach().to("
          "full.dtype), group=group, async_op=async_op, **labels)."),
}
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
