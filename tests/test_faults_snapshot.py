"""``faults.Snapshot``: a skipped (non-finite) step is undone completely, also when the step
is the one that *creates* the optimizer state (the first step, and the first step after a
resume from a checkpoint). Undone means: training on from the restored state gives exactly
what a run that never took the bad step gives (the same operations in the same process:
bit for bit), with a plain AdamW and under ZeRO-1 and ZeRO-2 on 2 ranks.
"""
import math

import torch
import torch.distributed as dist

import minipar
from minipar.production import checkpoint
from minipar import data
from minipar.production.faults import Snapshot
from minipar.models import GPT, GPTConfig
from minipar.reference import adamw
from minipar.zero import Zero2Optimizer, ZeroOptimizer

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
BATCHES = data.batches(data.synthetic_tokens(2000, 32), 4, 4, 8)


def _make(kind):
    model = GPT(CFG, seed=0)
    if kind == "plain":
        return model, adamw(1e-2, 0.1)(model.parameters())
    cls = {"zero-1": ZeroOptimizer, "zero-2": Zero2Optimizer}[kind]
    return model, cls([list(m.parameters()) for m in model.layers()], adamw(1e-2, 0.1))


def _step(model, opt, batch, poison=False):
    x, y = batch
    if dist.is_initialized():
        r, n = dist.get_rank(), dist.get_world_size()
        x, y = data.shard(x, r, n), data.shard(y, r, n)
    opt.zero_grad()
    loss = model(x, y)
    (loss * float("nan") if poison else loss).backward()
    opt.step()
    return loss.item()


def _run(kind, root, resume):
    """Good steps, (save + load into a fresh model and optimizer if ``resume``), a NaN step
    undone by the snapshot, then the remaining batches; and the same without the bad step."""
    def train(bad):
        model, opt = _make(kind)
        _step(model, opt, BATCHES[0])
        if resume:
            checkpoint.save(f"{root}/{bad}", model, opt, step=1)
            model, opt = _make(kind)
            checkpoint.load(f"{root}/{bad}", model, opt)
        losses = []
        if bad:
            snap = Snapshot(model, opt)
            snap.take()
            _step(model, opt, BATCHES[1], poison=True)
            poisoned = any(not torch.isfinite(p).all() for p in model.parameters())
            snap.restore()
            assert poisoned                        # the bad step did reach the parameters
        for b in BATCHES[2:]:
            losses.append(_step(model, opt, b))
        return losses, {k: v.detach().clone() for k, v in model.named_parameters()}

    def first_step_nan():
        model, opt = _make(kind)
        snap = Snapshot(model, opt)
        snap.take()
        _step(model, opt, BATCHES[0], poison=True)
        snap.restore()
        return [_step(model, opt, b) for b in BATCHES[1:]], {k: v.detach().clone() for k, v in model.named_parameters()}

    def clean_from_first():
        model, opt = _make(kind)
        return [_step(model, opt, b) for b in BATCHES[1:]], {k: v.detach().clone() for k, v in model.named_parameters()}

    if resume is None:
        return first_step_nan(), clean_from_first()
    return train(True), train(False)


def _assert_same(got, want, what):
    (gl, gp), (wl, wp) = got, want
    assert all(math.isfinite(v) for v in gl), (what, gl)
    assert gl == wl, (what, gl, wl)
    for k in wp:
        assert torch.equal(gp[k], wp[k]), (what, k)


def test_a_nan_first_step_is_undone_with_the_state_it_created(tmp_path):
    """Step 1 is NaN: the AdamW moments it created are dropped, the parameters put back; the
    run goes on exactly as if training had started at step 2."""
    _assert_same(*_run("plain", tmp_path, None), "plain, NaN at step 1")


def test_a_nan_step_after_a_resume_is_undone(tmp_path):
    """Resumed from a checkpoint (the optimizer's state loaded into a fresh one), the next
    step is NaN: moments and step counters are put back, not left NaN."""
    _assert_same(*_run("plain", tmp_path, True), "plain, NaN after resume")


def _zero_cases(root):
    out = {}
    for kind in ("zero-1", "zero-2"):
        out[kind, "first"] = _run(kind, root, None)
        out[kind, "resume"] = _run(kind, f"{root}/{kind}", True)
    return out


def test_a_nan_step_is_undone_under_zero_1_and_2(tmp_path):
    """The same under ZeRO-1 and ZeRO-2 (2 ranks): the sharded moments the step created, or
    the ones loaded from the checkpoint, and the fp32 master shards are restored."""
    for res in minipar.launch(_zero_cases, 2, args=(str(tmp_path),), timeout=120):
        for (kind, when), (got, want) in res.items():
            _assert_same(got, want, f"{kind}, NaN at {when}")
