"""minipar.production.checkpoint: pieces cover the full tensors exactly; resume is exact; a checkpoint
saved on one mesh loads on another (and on one process); a crash mid-save leaves the
previous checkpoint as the one that loads."""
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar.production import checkpoint
from minipar import hybrid
from minipar.production.checkpoint import atomic
from minipar.pieces import assemble, pieces_of, tensor_parallel_boxes
from minipar.data import batches, corpus_tokens
from minipar.mesh import ProcessMesh
from minipar.models.gpt import GPT, GPTConfig
from minipar.tensor_parallel.gpt import shard, weight_layout

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
STEPS, SAVE_AT = 6, 3
BATCHES = batches(corpus_tokens()[0], STEPS, 8, CFG.block_size, seed=1)
ADAMW = dict(lr=1e-2, weight_decay=0.1)
# Loading is exact (bit for bit, checked below); *training* on another layout adds the same
# floating-point numbers in another order, and AdamW's 1/sqrt(v) magnifies those last-bit
# differences in small gradients: the project's AdamW tolerance (tests/test_zero.py).
RTOL, ATOL = 1e-4, 5e-5
KEYS = ("param", "exp_avg", "exp_avg_sq", "step")


# ------------------------------------------------------------------ pieces (no processes)
@pytest.mark.parametrize("t", [1, 2, 4])
def test_tensor_parallel_boxes_are_the_shards_of_tensor_parallel_gpt(t):
    """Every rank's boxes hold exactly tensor_parallel.shard's elements, and all ranks'
    pieces together give back the full tensor, each element once."""
    for name, p in GPT(CFG).named_parameters():
        full = torch.arange(p.numel(), dtype=torch.float32).view(p.shape)
        pieces = []
        for r in range(t):
            boxes = tensor_parallel_boxes(weight_layout(name), p.shape, t, r)
            mine = pieces_of(name, "param", p.shape, boxes, shard(name, full, t, r))
            pieces += mine
            for q in mine:  # the piece's data is the full tensor's elements at its box
                region = full[tuple(slice(o, o + s) for o, s in zip(q.offset, q.shape))]
                assert torch.equal(q.data, region.reshape(-1)[q.lo:q.hi]), name
        got, seen = assemble(pieces, p.shape)
        assert seen.all() and torch.equal(got, full), name


def test_flat_ranges_across_boxes_reassemble():
    """ZeRO's flat ranges cut a tp shard anywhere, even across the three q/k/v boxes."""
    name, shape, t = "blocks.0.attn.qkv.weight", (96, 32), 2
    full = torch.randn(shape)
    pieces = []
    for r in range(t):
        local, boxes = shard(name, full, t, r), tensor_parallel_boxes("qkv", shape, t, r)
        for lo, hi in [(0, 333), (333, 1000), (1000, local.numel())]:  # 3 uneven "ZeRO ranks"
            pieces += pieces_of(name, "exp_avg", shape, boxes, local, lo, hi)
    assert any(0 < q.lo or q.hi < q.data.numel() + q.lo for q in pieces)
    got, seen = assemble(pieces, shape)
    assert seen.all() and torch.equal(got, full)


# ------------------------------------------------------------------ one process
def _train(model, opt, steps):
    losses = []
    for s in steps:
        opt.zero_grad(set_to_none=True)
        loss = model(*BATCHES[s])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


OPTIMIZERS = {"adamw": (torch.optim.AdamW, ADAMW),
              "sgd-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_resume_on_one_process_is_exact(tmp_path, opt_name):
    """Save after 3 steps, load into a fresh model and optimizer: the next losses and the
    final parameters are bit-identical to the uninterrupted run."""
    cls, kw = OPTIMIZERS[opt_name]
    model = GPT(CFG, seed=0)
    opt = cls(model.parameters(), **kw)
    _train(model, opt, range(SAVE_AT))
    checkpoint.save(tmp_path, model, opt, step=SAVE_AT, extra={"next_step": SAVE_AT})
    want = _train(model, opt, range(SAVE_AT, STEPS))

    fresh = GPT(CFG, seed=123)
    fresh_opt = cls(fresh.parameters(), **kw)
    meta = checkpoint.load(tmp_path, fresh, fresh_opt)
    assert meta["step"] == SAVE_AT and meta["extra"] == {"next_step": SAVE_AT}
    got = _train(fresh, fresh_opt, range(meta["extra"]["next_step"], STEPS))
    assert got == want
    for (k, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), k
    # the files are plain tensors and containers: weights_only loading is enough
    d = checkpoint.resolve(tmp_path)
    for f in d.glob("rank_*.pt"):
        assert torch.load(f, weights_only=True)["pieces"]


def test_wrong_model_or_missing_checkpoint_is_a_plain_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load(tmp_path, GPT(CFG))
    checkpoint.save(tmp_path, GPT(CFG))
    bigger = GPTConfig(**{**CFG.__dict__, "n_embd": 64})
    with pytest.raises(ValueError, match="holds shape"):
        checkpoint.load(tmp_path, GPT(bigger))
    with pytest.raises(KeyError, match="no parameter blocks.2"):
        checkpoint.load(tmp_path, GPT(GPTConfig(**{**CFG.__dict__, "n_layer": 3})))
    model = GPT(CFG)
    checkpoint.save(tmp_path, model, torch.optim.AdamW(model.parameters()), step=1)
    with pytest.raises(ValueError, match="holds AdamW state; this optimizer is a SGD"):
        checkpoint.load(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_crash_before_the_commit_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Rank 0 dies after renaming the new directory but before replacing ``latest``."""
    model = GPT(CFG, seed=0)
    checkpoint.save(tmp_path, model, step=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def crash(*a):
        raise OSError("power cut")
    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        checkpoint.save(tmp_path, model, step=2)
    monkeypatch.undo()
    assert checkpoint.resolve(tmp_path).name == "step_00000001"
    assert (tmp_path / "step_00000002").exists()  # written, never committed
    fresh = GPT(CFG, seed=5)
    checkpoint.load(tmp_path, fresh)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k
    checkpoint.save(tmp_path, model, step=2, keep=1)  # the next save goes through and prunes
    assert [p.name for p in checkpoint.committed(tmp_path)] == ["step_00000002.1"]


# ------------------------------------------------------------------ on a mesh
def _build(layout, zero1):
    mesh = ProcessMesh(**layout).build()
    return hybrid.build(GPT(CFG, seed=0), mesh, zero=int(zero1), microbatches=2,
                        optimizer=lambda ps: torch.optim.AdamW(ps, **ADAMW))


def _train_and_save(root, layout, zero1):
    """Train STEPS steps, saving before step SAVE_AT; return the losses and final weights."""
    model = _build(layout, zero1)
    losses = []
    for s in range(STEPS):
        if s == SAVE_AT:
            checkpoint.save(root, model, model.optimizer, step=s, extra={"next_step": s})
        losses.append(model.train_step(*BATCHES[s]))
    return {"losses": losses, "params": model.full_state_dict()}


def _resume(root, runs):
    """For each (layout, zero1): a fresh model, loaded, saved again at once (to compare
    what was loaded), trained to the end."""
    out = []
    for i, (layout, zero1) in enumerate(runs):
        model = _build(layout, zero1)
        meta = checkpoint.load(root, model, model.optimizer)
        checkpoint.save(Path(root).parent / f"again{i}", model, model.optimizer, step=meta["step"])
        losses = [model.train_step(*BATCHES[s]) for s in range(meta["extra"]["next_step"], STEPS)]
        out.append({"losses": losses, "params": model.full_state_dict(), "mesh": meta["mesh"]})
    return out


def _assert_close(got, want, rtol, atol):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=rtol, atol=atol)
    assert set(got["params"]) == set(want["params"])
    for k, v in want["params"].items():
        torch.testing.assert_close(got["params"][k], v, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def test_resume_same_mesh_is_exact_and_other_meshes_match(tmp_path):
    """Saved at dp=2, tp=2 with ZeRO-1: resumed on the same mesh the losses and weights are
    bit-identical; resumed at pp=2, dp=2 (no ZeRO), at tp=4, and on one process they match
    the uninterrupted run (rtol 1e-4, atol 1e-5), which itself matches one process."""
    root = tmp_path / "ckpt"
    saved = minipar.launch(_train_and_save, 4, args=(root, {"dp": 2, "tp": 2}, True))[0]
    meta = atomic.read_meta(checkpoint.resolve(root))
    assert meta["mesh"] == {"pp": 1, "dp": 2, "tp": 2} and meta["world_size"] == 4
    runs = [({"dp": 2, "tp": 2}, True), ({"pp": 2, "dp": 2}, False), ({"tp": 4}, False)]
    resumed = minipar.launch(_resume, 4, args=(root, runs))[0]
    tail = {"losses": saved["losses"][SAVE_AT:], "params": saved["params"]}

    for i in range(len(runs)):  # what every layout loaded is bit for bit what was saved
        for key in KEYS:
            want = checkpoint.load_full_state_dict(root, key)
            got = checkpoint.load_full_state_dict(tmp_path / f"again{i}", key)
            assert set(got) == set(want) and len(want) == len(list(GPT(CFG).parameters())), (runs[i], key)
            for k, v in want.items():
                assert torch.equal(got[k], v), (runs[i], key, k)

    same = resumed[0]
    assert same["losses"] == tail["losses"]
    for k, v in tail["params"].items():
        assert torch.equal(same["params"][k], v), k
    for other in resumed[1:]:
        _assert_close(other, tail, RTOL, ATOL)

    model = GPT(CFG, seed=7)  # one process, plain GPT and AdamW
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    checkpoint.load(root, model, opt)
    one = {"losses": _train(model, opt, range(SAVE_AT, STEPS)),
           "params": {k: v.detach() for k, v in model.state_dict().items()}}
    _assert_close(one, tail, RTOL, ATOL)

    reference = minipar.reference.train_reference(GPT(CFG, seed=0), BATCHES,
                                                  minipar.reference.adamw(**ADAMW))
    _assert_close({"losses": saved["losses"], "params": saved["params"]}, reference, RTOL, ATOL)


def _crash_mid_save(root, crash_rank):
    """Save step 1; train; rank ``crash_rank`` dies halfway through writing step 2."""
    model = _build({"dp": 2}, True)
    model.train_step(*BATCHES[0])
    checkpoint.save(root, model, model.optimizer, step=1, extra={"next_step": 1})
    before = model.full_state_dict()
    model.train_step(*BATCHES[1])
    if dist.get_rank() == crash_rank:
        def half_then_die(path, write):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half a zip file")
                f.flush()
            os._exit(3)
        from minipar.production.checkpoint import sharded
        sharded.write_file = half_then_die
    dist.barrier()
    checkpoint.save(root, model, model.optimizer, step=2, extra={"next_step": 2})
    return before


def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """A rank dies while writing its file: the launch fails, ``latest`` still names step 1,
    which loads (on one process) to exactly the weights it had; a later save succeeds."""
    root = tmp_path / "ckpt"
    with pytest.raises(minipar.RankError, match="exit code 3"):
        minipar.launch(_crash_mid_save, 2, args=(root, 1), timeout=60)
    assert checkpoint.resolve(root).name == "step_00000001"
    partial = list(root.glob(".tmp-step_00000002/rank_00001.pt"))
    assert partial and partial[0].stat().st_size < 100  # it really died mid-write
    assert checkpoint.load_full_state_dict(root)  # step 1 is complete
    model = GPT(CFG, seed=9)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    assert checkpoint.load(root, model, opt)["extra"]["next_step"] == 1
    # step 1's weights = one single-process step from the same start
    want = GPT(CFG, seed=0)
    _train(want, torch.optim.AdamW(want.parameters(), **ADAMW), range(1))
    for (k, a), (_, b) in zip(model.named_parameters(), want.named_parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")
    # and the next save (rank 0 clears the debris) commits
    checkpoint.save(root, model, opt, step=2)
    assert checkpoint.resolve(root).name == "step_00000002"
    assert not list(root.glob(".tmp-*"))
