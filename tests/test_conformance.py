"""Every strategy of ``minipar.strategy.STRATEGIES`` has the one API in fact, not only on paper.

* the list is every strategy: each module exports ``check``, ``train`` and ``run``, and no other
  top-level module of minipar exports all three;
* the same parameters: ``check(model, batches, world_size, ...)``, ``train(model, batches,
  optimizer=None, [group=None], ...)``, ``run(model, batches, world_size, optimizer=None, ...)``;
  ``dtype=None`` and ``recompute=None`` in ``train`` and ``check``; ``check`` names every option
  ``train`` takes;
* an unknown option is a ``ValueError`` naming it from ``check`` and from ``run``, and ``run``
  starts no process for it;
* ``group=``: where it is a parameter, training on a group of 2 ranks of a 3-rank world (global
  ranks 1 and 2) equals one process (losses and parameters, rtol 1e-4, atol 1e-5: the strategies'
  own tests hold them tighter); hybrid and expert parallelism lay their mesh over the world and
  take no group;
* with recording off (``trace.recording(False)``) a 2-step run of every strategy on 2 ranks calls
  the trace's sync hook (``trace._sync``, what waits for a GPU) zero times; with recording on the
  count is positive (the counter sees the regions' calls).
"""
from __future__ import annotations

import copy
import functools
import importlib
import inspect
import pkgutil

import pytest
import torch

import minipar
from minipar import data, reference, strategy
from minipar.models import GPT, GPTConfig
from minipar.runtime import trace

launch = minipar.launch

MODULES = {name: importlib.import_module(f"minipar.{name}") for name in strategy.STRATEGIES}
WORLD_ONLY = {"hybrid", "expert_parallel", "adapt"}          # a mesh over the whole world: no group

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
MOE = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, moe_every=1, n_experts=4, top_k=2)
BATCHES = data.batches(data.synthetic_tokens(2000, CFG.vocab_size), 2, 4, CFG.block_size)
OPTIONS = {  # a 2-rank run of each strategy
    "data_parallel": {}, "model_parallel": {}, "pipeline": {"microbatches": 2}, "tensor_parallel": {},
    "zero": {"stage": 3}, "context_parallel": {}, "expert_parallel": {"ep": 2}, "hybrid": {"dp": 2},
    "adapt": {"layout": "dp=2", "switches": ["1=tp=2"]}, "data_parallel.parameter_server": {"synchronous": True},
}


def _model(name):
    return GPT(MOE if name == "expert_parallel" else CFG, seed=0)


def test_the_list_is_every_strategy():
    """STRATEGIES names every top-level module of minipar with check, train and run, and only those,
    and the parameter server, the one nested strategy (inside data parallelism's package)."""
    found = set()
    for info in pkgutil.iter_modules(minipar.__path__):
        if info.name in ("train", "grade", "hint"):      # the command shims
            continue
        mod = importlib.import_module(f"minipar.{info.name}")
        if all(callable(getattr(mod, f, None)) for f in ("check", "train", "run")):
            found.add(info.name)
    assert found == {name for name in strategy.STRATEGIES if "." not in name}
    assert [name for name in strategy.STRATEGIES if "." in name] == ["data_parallel.parameter_server"]


@pytest.mark.parametrize("name", strategy.STRATEGIES)
def test_same_parameters(name):
    """The same parameter names and defaults: world_size, optimizer, group, dtype, recompute."""
    mod = MODULES[name]
    check, train, run = (inspect.signature(getattr(mod, f)).parameters for f in ("check", "train", "run"))
    empty = inspect.Parameter.empty
    assert list(check)[:3] == ["model", "batches", "world_size"], name
    assert list(run)[:4] == ["model", "batches", "world_size", "optimizer"], name
    assert run["world_size"].default is empty and check["world_size"].default is empty, name
    assert run["optimizer"].default is None and train["optimizer"].default is None, name
    assert list(train)[:3] == ["model", "batches", "optimizer"], name
    if name in WORLD_ONLY:
        assert "group" not in train, name
    else:
        assert list(train)[3] == "group" and train["group"].default is None, name
    for p in (train, check):
        assert p["dtype"].default is None and p["recompute"].default is None, name
    assert not any(p.kind is p.VAR_KEYWORD for p in check.values()), f"{name}.check swallows options"
    assert not any(p.kind is p.VAR_KEYWORD for p in train.values()), f"{name}.train swallows options"
    options = set(train) - {"model", "batches", "optimizer", "group"}
    assert options <= set(check), f"{name}.check does not take {options - set(check)}"


@pytest.mark.parametrize("name", strategy.STRATEGIES)
def test_unknown_option_is_refused_before_launch(name, monkeypatch):
    """check and run refuse an unknown option with a ValueError naming it; no process starts."""
    launched = []
    monkeypatch.setattr(strategy, "launch", lambda *a, **k: launched.append(a))
    mod = MODULES[name]
    mod.check(_model(name), BATCHES, 2, **OPTIONS[name])            # the valid setup passes
    with pytest.raises(ValueError, match="'bucket_cap_MB'"):
        mod.check(_model(name), BATCHES, 2, bucket_cap_MB=1, **OPTIONS[name])
    with pytest.raises(ValueError, match="'bucket_cap_MB'"):
        mod.run(_model(name), BATCHES, 2, bucket_cap_MB=1, **OPTIONS[name])
    assert launched == []


def _on_group():
    """Rank function: every strategy that takes a group trains on global ranks 1 and 2."""
    import torch.distributed as dist
    group = dist.new_group([1, 2])
    out = {}
    for name, mod in MODULES.items():
        if name in WORLD_ONLY or dist.get_rank() == 0:
            continue
        res = mod.train(_model(name), BATCHES, reference.sgd(0.5), group=group, **OPTIONS[name])
        out[name] = {k: res[k] for k in ("losses", "params")}
    return out


def test_group_works_where_it_is_a_parameter():
    """Training on a group of 2 of 3 ranks equals one process (minipar.reference.TOLERANCES, "sgd")."""
    results = launch(_on_group, 3, timeout=240)
    assert results[0] == {}
    want = reference.train_reference(GPT(CFG, seed=0), BATCHES, reference.sgd(0.5))
    for name in set(strategy.STRATEGIES) - WORLD_ONLY:
        got = strategy.TrainResult.merge([r[name] for r in results[1:]])
        reference.assert_same_training(got, want)   # the table's "sgd" on the devices they ran on


def _sync_calls(on: bool):
    """Rank function: calls of the trace's sync hook per strategy, 2 steps each, recording ``on``."""
    calls = [0]

    def counting():
        calls[0] += 1

    before, trace._sync = trace._sync, counting
    out = {}
    try:
        with trace.recording(on):
            for name, mod in MODULES.items():
                calls[0] = 0
                mod.train(_model(name), copy.deepcopy(BATCHES), reference.sgd(0.5), **OPTIONS[name])
                out[name] = calls[0]
            calls[0] = 0
            minipar.pipeline.train(GPT(CFG, seed=0), BATCHES, reference.sgd(0.5), microbatches=2, probe_steps=1)
            out["pipeline probe_steps=1"] = calls[0]
    finally:
        trace._sync = before
    return out


def test_no_synchronization_with_recording_off():
    """With recording off, zero calls to trace._sync in a 2-step run of every strategy (on: some)."""
    off = launch(_sync_calls, 2, args=(False,), timeout=240)
    assert all(n == 0 for r in off for n in r.values()), list(off)
    on = launch(_sync_calls, 2, args=(True,), timeout=240)
    assert sum(n for r in on for n in r.values()) > 0, list(on)   # the counter sees the regions' calls


def _loop_that_communicates():
    """strategy.loop over 3 steps, step i all-reducing 4(i+1) floats along "dp"."""
    from minipar import comm

    def step(i, batch):
        comm.all_reduce(torch.ones(4 * (i + 1)), dim="dp")
        return torch.tensor(float(i + torch.distributed.get_rank()))

    losses, measured = strategy.loop([None, None, None], step, mean_over=None)
    return losses, measured["bytes_by_dim"], measured["bytes_sent"]


def test_loop_measures_the_bytes_of_the_last_step_only():
    """On 2 ranks the last step all-reduces 12 floats: 2·(1/2)·48 = 48 bytes sent per rank, and
    that alone is the step's ``bytes_by_dim`` (not the earlier steps' 16 + 32 nor the loss
    records' all-reduces); the losses are the ranks' mean, step by step."""
    for losses, by_dim, sent in launch(_loop_that_communicates, 2, timeout=120):
        assert losses == [0.5, 1.5, 2.5]
        assert by_dim == {"dp": 48, "total": 48} and sent == 48


def test_loop_measures_the_last_step_and_records_the_losses():
    """strategy.loop: losses in step order, the last step's measured entries, extra evaluated once."""
    seen = []

    def step(i, batch):
        return torch.tensor(float(i)), (lambda events: seen.append(i) or {"peak_stash": i})

    losses, measured = strategy.loop([None, None, None], step, mean_over=strategy.WHOLE)
    assert losses == [0.0, 1.0, 2.0] and seen == [2]
    assert measured["peak_stash"] == 2 and measured["bytes_by_dim"] == {"total": 0} and measured["seconds"] >= 0


def test_recompute_is_entered_at_one_site():
    """Recomputation is set in one place: ``models.recompute.apply_recompute``, called by
    ``strategy.prepare`` (the first line of every one-dimension strategy's ``train``, which reads its
    own ``dtype`` and ``recompute`` there: no decorator reads them from the signature) and by the
    composition's ``parallelize`` (hybrid and adapt build through it); no strategy sets it itself."""
    import re
    from pathlib import Path
    root = Path(minipar.__file__).parent
    calls = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if "bench" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"set_recompute\(", line) and not re.match(r"\s*def ", line)]
    assert {c.split(":")[0] for c in calls} == {"models/gpt.py", "models/recompute.py"}, calls
    applied = [f"{p.relative_to(root)}" for p in root.rglob("*.py") if re.search(r"\bapply_recompute\(", p.read_text())
               and not re.search(r"^def apply_recompute", p.read_text(), re.M)]
    assert sorted(applied) == ["hybrid/parallelize.py", "strategy.py"], applied
    for name in set(strategy.STRATEGIES) - {"hybrid", "adapt"}:
        body = inspect.getsource(MODULES[name].train).split('"""')[2].strip().splitlines()
        assert body[0].startswith("dtype = strategy.prepare(model, dtype, recompute)"), (name, body[0])
        assert not hasattr(MODULES[name].train, "__wrapped__"), f"{name}.train is wrapped"


def _autocast_sites() -> set:
    """Every call of a function named ``autocast`` in minipar's source, as ``file:function``."""
    import ast
    from pathlib import Path
    root = Path(minipar.__file__).parent
    sites = set()
    for path in root.rglob("*.py"):
        def visit(node, where):
            for child in ast.iter_child_nodes(node):
                inner = where
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = f"{where}.{child.name}" if where else child.name
                if isinstance(child, ast.Call):
                    f = child.func
                    if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) == "autocast":
                        sites.add(f"{path.relative_to(root)}:{inner}")
                visit(child, inner)
        visit(ast.parse(path.read_text()), "")
    return sites


def test_autocast_is_entered_at_one_site():
    """Autocast is entered in one place, ``strategy.forward`` (what every strategy, the references,
    the naive model-parallel step and the pipeline's F wrap their forward in), over
    ``precision.autocast`` (the one call of ``torch.autocast``); no strategy enters it itself."""
    sites = _autocast_sites()
    assert sites == {"precision.py:autocast", "strategy.py:forward"}, sorted(sites)


def _bf16_steps():
    """Rank function: two bf16 steps of every strategy (the second from the pipeline's
    re-partitioning too); per strategy its ``measured`` and how many backward calls
    (``torch.autograd.backward``, what ``Tensor.backward`` calls too) ran, and with autocast on."""
    counts = {}
    real = torch.autograd.backward

    def spy(*args, **kwargs):
        counts[name][0] += 1
        counts[name][1] += torch.is_autocast_enabled("cpu")
        return real(*args, **kwargs)

    out = {}
    runs = [(name, mod, OPTIONS[name]) for name, mod in MODULES.items()]
    runs.append(("pipeline probe_steps=1", MODULES["pipeline"], {"microbatches": 2, "probe_steps": 1}))
    torch.autograd.backward = spy
    try:
        for name, mod, options in runs:
            counts[name] = [0, 0]
            res = mod.train(_model(name), copy.deepcopy(BATCHES), reference.sgd(0.5), dtype="bf16", **options)
            out[name] = res["measured"]
    finally:
        torch.autograd.backward = real
    return out, counts


@functools.cache
def _bf16_runs():
    return launch(_bf16_steps, 2, timeout=240)


def test_no_backward_runs_under_autocast():
    """Autocast wraps forwards only: in bf16 steps of every strategy on 2 ranks no backward
    (and so no custom autograd Function's backward) runs with autocast on; some backward ran on
    some rank (the parameter server's server computes none)."""
    runs = [counts for _, counts in _bf16_runs()]
    for name in runs[0]:
        calls, under = (sum(c[name][j] for c in runs) for j in (0, 1))
        assert calls >= 2 and under == 0, (name, calls, under)


def test_measured_is_one_record():
    """Every strategy's ``measured`` is a ``strategy.Measured`` with its fields filled on every rank:
    the last step's ``seconds`` (> 0), ``bytes_by_dim`` with its ``"total"`` (= ``bytes_sent``, and
    > 0 on 2 ranks: every strategy communicates), ``memory`` with this rank's parameter, gradient
    and optimizer-state bytes (parameters > 0); its extras are names of ``strategy.EXTRAS`` only,
    and an unknown name is refused. It reads like a dict: the fields, ``bytes_sent`` and the extras."""
    for measured, _ in _bf16_runs():
        assert set(measured) == set(strategy.STRATEGIES) | {"pipeline probe_steps=1"}
        for name, m in measured.items():
            assert type(m) is strategy.Measured, (name, type(m))
            assert isinstance(m.seconds, float) and m.seconds > 0, (name, m.seconds)
            assert m.bytes_sent == m.bytes_by_dim["total"] == m["bytes_sent"] > 0, (name, m.bytes_by_dim)
            assert {"params", "grads", "optimizer"} <= set(m.memory) and m.memory["params"] > 0, (name, m.memory)
            assert set(m.extras) <= set(strategy.EXTRAS), (name, set(m.extras) - set(strategy.EXTRAS))
            assert [m[k] for k in ("seconds", "bytes_by_dim", "memory")] == [m.seconds, m.bytes_by_dim, m.memory]
            assert all(m[k] is v for k, v in m.extras.items()) and len(m) == 4 + len(m.extras), name
    cp, ep = measured["context_parallel"], measured["expert_parallel"]
    assert set(cp.extras) == {"bytes_by_name", "attention_seconds"}
    assert set(ep.extras) == {"tokens_per_expert", "kept_matrix", "local_experts", "parameters"}
    with pytest.raises(KeyError, match="'bytes_by_nmae'"):
        strategy.Measured()["bytes_by_nmae"] = {}
    with pytest.raises(KeyError, match="'step'"):
        strategy.Measured(extras={"step": 1})


def _loss_records():
    """Rank function on 4 ranks: :func:`strategy.record_loss` on a 2 × 2 layout, parts summed over
    {0, 1} and {2, 3}, means over {0, 2} and {1, 3}; rank r's loss is r + 1."""
    import torch.distributed as dist
    r = dist.get_rank()
    pairs = [dist.new_group(g) for g in ([0, 1], [2, 3], [0, 2], [1, 3])]
    parts, means, own = pairs[r // 2], pairs[2 + r % 2], torch.tensor(float(r + 1))
    return (strategy.record_loss(own, means, parts).item(),
            strategy.record_loss(own, means).item(),
            strategy.record_loss(None if r % 2 == 0 else 1.5, strategy.WHOLE, parts).item(),
            strategy.record_loss(None if r < 3 else own, strategy.WHOLE))


def test_the_loss_is_recorded_one_way():
    """One rule records every strategy's loss: the step's global mean L = (1/|mean_over|)
    Σ_mean_over Σ_parts_over ℓ_r, computed in ``strategy.record_loss`` alone. On 4 ranks with
    ℓ_r = r + 1: parts then means give (3 + 7)/2 = 5 on every rank; means alone 2 on {0, 2} and 3
    on {1, 3}; a rank with no part (None) adds 0; ``WHOLE`` keeps each rank's loss as held. Every
    strategy's ``loop`` names the group that averages (``mean_over`` has no default), and no
    module but ``strategy.py`` all-reduces a ``"loss"``."""
    import ast
    from pathlib import Path
    got = launch(_loss_records, 4, timeout=120)
    assert [g[:3] for g in got] == [(5.0, 2.0, 1.5), (5.0, 3.0, 1.5), (5.0, 2.0, 1.5), (5.0, 3.0, 1.5)]
    assert [g[3] for g in got[:3]] == [None] * 3 and got[3][3].item() == 4.0
    assert inspect.signature(strategy.loop).parameters["mean_over"].default is inspect.Parameter.empty
    root = Path(minipar.__file__).parent
    records, loops = [], []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                kw = {k.arg: k.value for k in node.keywords}
                if isinstance(kw.get("name"), ast.Constant) and kw["name"].value == "loss":
                    records.append(str(path.relative_to(root)))
                if isinstance(node.func, ast.Attribute) and node.func.attr == "loop" \
                        and getattr(node.func.value, "id", None) == "strategy":
                    loops.append((str(path.relative_to(root)), "mean_over" in kw or None in kw))
    assert records == ["strategy.py"], records
    assert len(loops) >= 10 and all(named for _, named in loops), loops


def test_loop_calls_after_every_step_and_the_training_command_drives_it():
    """``strategy.loop(..., after=)``: after every step the callback gets the step's index, its
    loss record as a float and its seconds; True ends the loop there (here after step 2 of 5,
    batches from a generator). The training command (``minipar/production/train.py``) runs its
    steps through ``strategy.loop`` with that callback, not through ``HybridModel.train_step``."""
    import ast
    from pathlib import Path
    seen = []

    def after(i, loss, seconds):
        seen.append((i, loss, type(loss), seconds >= 0))
        return i == 2

    losses, _ = strategy.loop((None for _ in range(5)), lambda i, b: torch.tensor(float(i)),
                              mean_over=strategy.WHOLE, after=after)
    assert losses == [0.0, 1.0, 2.0] and seen == [(i, float(i), float, True) for i in range(3)]
    tree = ast.parse((Path(minipar.__file__).parent / "production" / "train.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert any(c.func.attr == "loop" and "after" in {k.arg for k in c.keywords} for c in calls)
    assert not any(c.func.attr == "train_step" for c in calls)
