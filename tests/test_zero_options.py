"""ZeRO options the main tests leave at their defaults: clipping when the norm is already
below the bound (the gradients must stay exactly as they are), and ``fully_shard``'s
``reduce_dtype`` other than ``param_dtype`` (the reduce-scatter in its own dtype).

fp32 on CPU unless stated. SGD with momentum (not AdamW, which is nearly invariant to a
gradient's scale and would hide a wrong clipping factor).
"""
import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, reference
from minipar.runtime import trace
from minipar.models import GPT, GPTConfig
from minipar.zero import (FullyShardedDataParallel, ReplicatedOptimizer, Zero2Optimizer, ZeroOptimizer,
                          clip_grad_norm_, full_state, fully_shard, padded_unit_sizes)

CFG = GPTConfig(vocab_size=67, n_embd=30, n_head=2, n_layer=2, block_size=16)
STEPS, BATCH = 3, 8
BIG = 1e3                  # far above the GPT's gradient norm: clipping must change nothing
SGD = reference.sgd(0.1)


def _batches():
    toks, _ = data.corpus_tokens()
    return data.batches(toks, STEPS, BATCH, CFG.block_size)


def _unclipped_reference():
    model = GPT(CFG, seed=0)
    opt = SGD(model.parameters())
    losses, norms = [], []
    for x, y in _batches():
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "norms": norms}


def _clip_below_bound():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in ("0", "1", "2", "3", "3p"):
        model = GPT(CFG, seed=0)
        if stage in ("3", "3p"):
            fwd = FullyShardedDataParallel(model) if stage == "3" else fully_shard(model)
            opt = SGD(fwd.parameters())
        else:
            cls = {"0": ReplicatedOptimizer, "1": ZeroOptimizer, "2": Zero2Optimizer}[stage]
            fwd, opt = model, cls([list(m.parameters()) for m in model.layers()], SGD, max_grad_norm=BIG)
        losses, norms, unchanged = [], [], []
        for x, y in _batches():
            opt.zero_grad()
            loss = fwd(data.shard(x, r, n), data.shard(y, r, n))
            loss.backward()
            if stage in ("3", "3p"):
                before = [p.grad.clone() for p in fwd.parameters()]
                norms.append(clip_grad_norm_([p.grad for p in fwd.parameters()], BIG))
                unchanged.append(all(torch.equal(a, p.grad) for a, p in zip(before, fwd.parameters())))
            opt.step()
            if stage not in ("3", "3p"):
                norms.append(opt.grad_norm)
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            losses.append(t.item() / n)
        params = (fwd.gather_full_params() if stage == "3" else full_state(model) if stage == "3p"
                  else {k: v.detach().clone() for k, v in model.named_parameters()})
        out[stage] = {"losses": losses, "params": params, "norms": norms, "unchanged": unchanged}
    return out


def test_clipping_below_the_bound_leaves_the_gradients_unchanged():
    """With the global norm below max_norm the factor is exactly 1: the shards' gradients are
    bit-for-bit what they were (stage 3, both designs), and every stage trains like the
    unclipped single process (SGD: rtol 1e-5, atol 1e-6), reporting the same norms."""
    want = _unclipped_reference()
    assert max(want["norms"]) < BIG / 100            # far below the bound
    for res in minipar.launch(_clip_below_bound, 2, timeout=120):
        for stage, got in res.items():
            assert all(got["unchanged"]), stage
            torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]),
                                       rtol=1e-5, atol=1e-7, msg=lambda m: f"stage {stage} norms: {m}")
            reference.assert_same_training(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ reduce_dtype
PAIRS = {"bf16 params, fp32 reduce": (torch.bfloat16, torch.float32),
         "fp32 params, bf16 reduce": (None, torch.bfloat16),
         "bf16 params, bf16 reduce": (torch.bfloat16, None)}


def _reduce_dtypes():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (param_dtype, reduce_dtype) in PAIRS.items():
        model = fully_shard(GPT(CFG, seed=0), param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        opt = SGD(model.parameters())
        losses = []
        for x, y in _batches():
            mark = trace.mark()
            opt.zero_grad()
            loss = model(data.shard(x, r, n), data.shard(y, r, n))
            loss.backward()
            grads_fp32 = all(p.grad.dtype == torch.float32 for p in model.parameters())
            opt.step()
            t = loss.detach().float().reshape(1)
            dist.all_reduce(t)
            losses.append(t.item() / n)
        comm = trace.since(mark)
        out[name] = {"losses": losses, "params": full_state(model), "grads_fp32": grads_fp32,
                     "sizes": padded_unit_sizes(model),
                     "gathered": sum(e["bytes_sent"] for e in comm if e["name"] == "all_gather"),
                     "reduced": sum(e["bytes_sent"] for e in comm if e["name"] == "reduce_scatter")}
    return out


def test_fully_shard_reduces_in_its_own_dtype():
    """reduce_dtype sets the reduce-scatter's dtype apart from param_dtype's gathers: bytes on
    the wire 4 or 2 per element for each as asked, fp32 gradient shards for the optimizer,
    and training within the bf16 bound of the fp32 single process (atol 5e-2 on losses, as
    the mixed-precision test of fully_shard). Reducing in fp32 is not reducing in bf16: the
    two runs' parameters differ."""
    want = reference.train_reference(GPT(CFG, seed=0), _batches(), SGD)
    for res in minipar.launch(_reduce_dtypes, 2, timeout=120):
        for name, (param_dtype, reduce_dtype) in PAIRS.items():
            got = res[name]
            g_bytes = 2 if param_dtype is torch.bfloat16 else 4
            r_bytes = {torch.bfloat16: 2, torch.float32: 4, None: g_bytes}[reduce_dtype]
            assert got["grads_fp32"], name
            assert got["gathered"] == sum(2 * round(cost.collective_bytes("all_gather", g_bytes * s, 2))
                                          for s in got["sizes"]), name      # forward and backward
            assert got["reduced"] == sum(round(cost.collective_bytes("reduce_scatter", r_bytes * s, 2))
                                         for s in got["sizes"]), name
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=5e-2)
        a, b = res["bf16 params, fp32 reduce"]["params"], res["bf16 params, bf16 reduce"]["params"]
        assert any(not torch.equal(a[k], b[k]) for k in a)
