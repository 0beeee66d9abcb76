"""Every schedule trains the small GPT exactly like one process: same losses every step,
same final parameters (fp32, rtol 1e-5, atol 1e-6), with 2 and 4 stages and several
micro-batch counts (m < p, m not a multiple of p). One launch per pipeline size checks
all schedules, the measured order of events, the stash, and a pipeline on a subgroup.
ZB-H1's split backward is checked on its own (B computes input gradients only, W the
weight gradients from the kept (X, ∂L/∂Y), bit for bit a fused backward's), and with
tensor parallelism (pp × tp): the same training, and no communication inside W."""
import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, precision, reference
from minipar.runtime import trace
from minipar import pipeline as pp
from minipar.models import GPT, GPTConfig
from minipar.strategy import TrainResult

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=6, n_head=2, n_embd=16)
BATCH, STEPS = 12, 3
RTOL, ATOL = reference.tolerance(kind="sgd").values()   # fp32 on the ranks' device (minipar.reference.TOLERANCES)
MS = {2: (1, 2, 3, 4), 4: (2, 3, 4, 6, 12)}


def _batches():
    return data.batches(data.synthetic_tokens(2000), STEPS, BATCH, CFG.block_size)


def _configs(p):
    return [(name, m, 2 if name == "interleaved" else 1) for name in pp.SCHEDULES for m in MS[p]
            if not (name == "interleaved" and m % p)]


def _run_all(p):
    """Rank function: train with every schedule; keep each run's events; then two
    pipelines of 2 side by side on subgroups (only when p == 4)."""
    out, batches = [], _batches()
    for name, m, v in _configs(p):
        before = len(trace.events())
        res = pp.train(GPT(CFG, seed=0), batches, reference.sgd(0.5), schedule=name, microbatches=m,
                       virtual_stages=v)
        res["events"] = trace.events()[before:]
        out.append(res)
    sub = None
    if p == 2:  # recomputation under the split backward; the executor refuses stages that
        # do not match the schedule or the group
        for name, mode in (("zb-h1", "full"), ("zb-h1", "selective"), ("1f1b", "full")):
            out.append(pp.train(GPT(CFG, seed=0), batches, reference.sgd(0.5), schedule=name, microbatches=3,
                                recompute=mode))
        s, errors = pp.make_schedule("1f1b", 2, 2), []
        layers = GPT(CFG, seed=0).layers()
        for stages, sched in (({5: layers[0]}, s), ({dist.get_rank(): layers[0]}, pp.make_schedule("1f1b", 4, 2))):
            try:
                pp.Pipeline(stages, sched, (1, 8, 16))
            except ValueError as e:
                errors.append(str(e))
        sub = errors
    if p == 4:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[dist.get_rank() // 2]
        sub = pp.train(GPT(CFG, seed=0), batches, reference.sgd(0.5), group=mine, microbatches=3)
    return out, sub


@pytest.fixture(scope="module")
def reference_run():
    return reference.train_reference(GPT(CFG, seed=0), _batches(), reference.sgd(0.5))


def _check_events(evs_per_rank, p, m, v, split):
    """On every stage: F before B (before W) for each micro-batch; a stage's F starts only
    after its activation was received and its B after its gradient was (same rank's
    clock: the ranks' clocks differ by the skew of the starting barrier)."""
    S = p * v
    count = 0
    for evs in evs_per_rank:
        t = {}
        for e in evs:
            lab = e["labels"]
            key = lab.get("phase") or e["name"]
            t[key, lab["microbatch"], lab["stage"]] = (e["start"], e["end"])
        for (op, i, s), (start, _) in t.items():
            if op in ("F", "B", "W"):
                count += 1
            if op == "B":
                assert t["F", i, s][1] <= start
            if op == "W":
                assert t["B", i, s][1] <= start
            if op == "F" and s > 0:
                assert t["recv_activation", i, s][1] <= start
            if op == "B" and s < S - 1:
                assert t["recv_grad", i, s][1] <= start
    assert count == m * S * (3 if split else 2)


@pytest.mark.parametrize("p", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_schedules_match_single_process(p, reference_run):
    """GPipe, 1F1B, interleaved (v=2), ZB-H1: same losses and parameters as one process
    (also with recomputation), the stash and the bytes sent as the formulas say."""
    results = minipar.launch(_run_all, p, args=(p,), timeout=240)
    for k, (name, m, v) in enumerate(_configs(p)):
        runs = [r[0][k] for r in results]
        got = TrainResult.merge(runs)
        try:
            reference.assert_same_training(got, reference_run, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            raise AssertionError(f"{name} p={p} m={m} v={v}: {e}") from None
        want_stash = [cost.peak_activations(name, p, m, r, v) for r in range(p)]
        assert [x["peak_stash"] for x in got.measured] == want_stash, (name, p, m, v)
        assert [r["losses"] is None for r in runs] == [r != (p - 1) for r in range(p)]
        per_msg, S = (BATCH // m) * CFG.block_size * CFG.n_embd * 4, p * v   # one fp32 micro-batch
        want_sent = [m * per_msg * sum((s < S - 1) + (s > 0) for s in range(r, S, p)) for r in range(p)]
        assert [x["bytes_sent"] for x in got.measured] == want_sent, (name, p, m, v)
        _check_events([r["events"] for r in runs], p, m, v, name == "zb-h1")
    if p == 2:
        for k in range(len(_configs(p)), len(results[0][0])):   # with recomputation
            reference.assert_same_training(TrainResult.merge([r[0][k] for r in results]), reference_run,
                                           rtol=RTOL, atol=ATOL)
        errors = results[0][1]
        assert len(errors) == 2 and "must hold stages [0]" in errors[0] and "group has 2" in errors[1], errors
    if p == 4:  # two independent pipelines on process subgroups {0,1} and {2,3}
        for pair in ((0, 1), (2, 3)):
            got = TrainResult.merge([results[r][1] for r in pair])
            reference.assert_same_training(got, reference_run, rtol=RTOL, atol=ATOL)


def test_run_checks_before_launch():
    """pipeline.run refuses a bad configuration with a plain ValueError, no process started."""
    model, batches = GPT(CFG, seed=0), _batches()
    for options, match in ((dict(microbatches=5), "not divisible"), (dict(schedule="nope"), "unknown"),
                           (dict(bounds=[0, 3, 9]), "bounds"), (dict(dtype="int4"), "dtype"),
                           (dict(schedule="interleaved", microbatches=4), "v >= 2")):
        with pytest.raises(ValueError, match=match):
            pp.run(model, batches, 2, **options)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_split_backward_is_a_fused_backward_in_two(dtype):
    """B gives the fused backward's input gradient and leaves the linear weights alone; W
    then gives bit-identical weight gradients from the kept (X, dY), without the graph
    (fp32, and under bf16 autocast)."""
    fused, split = GPT(CFG, seed=0), GPT(CFG, seed=0)
    x = torch.randn(3, CFG.block_size, CFG.n_embd, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(3, CFG.block_size, CFG.n_embd)
    with precision.autocast(dtype):
        fused.blocks[0](x).backward(dy)
    dw = pp.WeightGrads()
    with precision.autocast(dtype), pp.deferred(dw):
        out = split.blocks[0](x2)
    out.backward(dy)                                   # B: the graph is freed here
    linears = [mod for mod in split.blocks[0].modules() if isinstance(mod, torch.nn.Linear)]
    assert len(dw) == len(linears) == 4
    assert all(mod.weight.grad is None and mod.bias.grad is None for mod in linears)
    assert torch.equal(x2.grad, x.grad)
    assert split.blocks[0].ln1.weight.grad is not None   # layer norms: gradients in B
    dw.apply()                                         # W
    assert len(dw) == 0
    for (k, a), b in zip(fused.blocks[0].named_parameters(), split.blocks[0].parameters()):
        assert torch.equal(a.grad, b.grad), k
        assert b.grad.grad_fn is None, k
    with pytest.raises(RuntimeError):
        out.backward(dy)                               # B freed the graph: W never walked it



def _nodes(out) -> list[str]:
    seen, todo, names = set(), [out.grad_fn], []
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            names.append(type(f).__name__)
            todo += [g for g, _ in f.next_functions]
    return names


def test_deferred_reroutes_only_linear_layers_and_restores_them():
    """Inside ``deferred`` a linear layer runs with its weight detached (autograd's own
    backward is B) and only while the block is open, even when it raises; under activation
    recomputation the layers keep X among autograd's saved tensors (DeferredLinear), so
    recomputation can drop it."""
    import torch.nn.functional as F
    plain = F.linear
    block = GPT(CFG, seed=0).blocks[0]
    x = torch.randn(2, CFG.block_size, CFG.n_embd, requires_grad=True)
    with pytest.raises(KeyError), pp.deferred(pp.WeightGrads()):
        assert F.linear is not plain
        raise KeyError("inside")
    assert F.linear is plain
    for mode, deferred_nodes in (("none", 0), ("full", 4)):
        block.recompute = mode
        dw = pp.WeightGrads()
        with pp.deferred(dw):
            out = block(x)
        assert F.linear is plain
        assert _nodes(out).count("DeferredLinearBackward") == deferred_nodes, mode
        out.sum().backward()
        assert len(dw) == 4 and all(lin.weight.grad is None for lin in block.modules()
                                    if isinstance(lin, torch.nn.Linear)), mode
        dw.apply()
        block.zero_grad(set_to_none=True)
        x.grad = None


def _pp_tp(schedule):
    """Rank function: the GPT on pp=2 × tp=2 with ``schedule``; the result of
    hybrid.train, the comm events that start inside a W region, the f all-reduces."""
    from minipar import hybrid
    mark = trace.mark()
    res = hybrid.train(GPT(CFG, seed=0), _batches(), reference.sgd(0.5), pp=2, tp=2, schedule=schedule,
                       microbatches=4)
    evs = trace.since(mark)
    ws = [(e["start"], e["end"]) for e in evs if e["labels"].get("phase") == "W"]
    res["in_w"] = [e["name"] for e in evs if e["kind"] == "comm" and any(a < e["start"] < b for a, b in ws)]
    res["ws"], res["f"] = len(ws), sum(e["name"] == "f.all_reduce" for e in evs)
    return res


def test_zb_h1_with_tensor_parallelism(reference_run):
    """pp=2 × tp=2: ZB-H1 trains like one process; no collective runs inside W, and f's
    all-reduce runs as often as under 1F1B (in B only, never again in W)."""
    zb, ob = (minipar.launch(_pp_tp, 4, args=(s,), timeout=120) for s in ("zb-h1", "1f1b"))
    reference.assert_same_training(TrainResult.merge(zb), reference_run, rtol=RTOL, atol=ATOL)
    for r in range(4):
        assert zb[r]["ws"] == STEPS * 4 and zb[r]["in_w"] == [], (r, zb[r]["ws"], zb[r]["in_w"])
        assert zb[r]["f"] == ob[r]["f"] > 0, (r, zb[r]["f"], ob[r]["f"])
