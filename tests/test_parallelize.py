"""The composition has one place and one order: ``minipar.hybrid.parallelize``.

Read from the source (the equivalence of every layout it builds is tests/test_hybrid.py's,
test_zero_mesh.py's and test_mesh5d.py's): each ``apply_X`` is defined in its technique's package
and called only by ``parallelize``, in the order the dimensions nest; ``HybridModel`` builds
through it; every option of ``hybrid.train`` other than the mesh's degrees is one field of the
frozen ``Parallelism``; and chapter 07's package imports chapters 08 and 09 only through their
packages' exports."""
import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import minipar
from minipar import hybrid
from minipar.hybrid.parallelize import Parallelism, parallelize

ROOT = Path(minipar.__file__).parent
STEPS = {"apply_tp": "tensor_parallel", "apply_cp": "context_parallel", "apply_ep": "hybrid",
         "apply_pp": "pipeline", "apply_recompute": "models", "apply_dp": "hybrid"}


def _calls(path: Path) -> list[str]:
    return [n.func.id for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in STEPS]


def test_each_step_lives_with_its_technique_and_only_parallelize_calls_it():
    for name, package in STEPS.items():
        where = [p for p in ROOT.rglob("*.py") if re.search(rf"^def {name}\(", p.read_text(), re.M)]
        assert len(where) == 1 and where[0].relative_to(ROOT).parts[0] == package, (name, where)
    callers = {p.relative_to(ROOT).as_posix(): set(_calls(p)) for p in ROOT.rglob("*.py") if _calls(p)}
    # a single strategy's recompute= is applied by strategy.prepare, the one other caller (test_conformance)
    assert callers == {"hybrid/parallelize.py": set(STEPS), "strategy.py": {"apply_recompute"}}, callers


def test_the_steps_come_in_the_order_the_dimensions_nest():
    assert _calls(ROOT / "hybrid" / "parallelize.py") == list(STEPS)


def test_the_hybrid_model_builds_through_parallelize():
    src = inspect.getsource(hybrid.HybridModel.__init__)
    assert "parallelize(" in src
    for step in STEPS:
        assert step not in src, step


def test_every_option_is_one_frozen_field():
    mesh = {"model", "batches", "optimizer", "dp", "pp", "tp", "cp", "ep"}
    options = set(inspect.signature(hybrid.train).parameters) - mesh
    assert options == set(Parallelism.options()), options ^ set(Parallelism.options())
    with pytest.raises(dataclasses.FrozenInstanceError):
        Parallelism().zero = 1
    assert "zero1" not in inspect.signature(hybrid.train).parameters


def test_chapter_07_uses_only_what_chapters_08_and_09_export():
    deep = [f"{p.name}: {line.strip()}" for p in (ROOT / "hybrid").glob("*.py")
            for line in p.read_text().splitlines()
            if re.match(r"\s*from \.\.(context_parallel|expert_parallel)\.", line)]
    assert deep == [], deep
    assert parallelize.__module__ == "minipar.hybrid.parallelize"


def _count_decisions():
    """Rank function: calls of ``precision.resolve`` and of ``hybrid.check`` while this rank trains
    a bf16 dp2·pp2 GPT with 2 micro-batches for 2 steps (``hybrid.train``, the rank's entry)."""
    import sys
    import torch.distributed as dist
    from minipar import data, precision
    hybrid_config, hybrid_model, hybrid_train = (sys.modules[f"minipar.hybrid.{m}"] for m in ("config", "model", "train"))
    from minipar.models import GPT, GPTConfig
    counts = {"resolve": 0, "check": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    patched = [(precision, "resolve"), (hybrid_config, "check"), (hybrid_model, "check"), (hybrid_train, "check")]
    saved = [getattr(m, n) for m, n in patched]
    precision.resolve = counted(saved[0], "resolve")
    for (m, n), fn in zip(patched[1:], saved[1:]):
        setattr(m, n, counted(fn, "check"))
    try:
        cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=False)
        batches = data.batches(data.synthetic_tokens(2000, 32), 2, 4, 16)
        out = hybrid.train(GPT(cfg, seed=0), batches, dp=2, pp=2, microbatches=2, dtype="bf16", zero=None)
    finally:
        for (m, n), fn in zip(patched, saved):
            setattr(m, n, fn)
    return counts, dist.get_rank(), out["measured"]["coords"]


def test_each_option_is_decided_once_per_rank():
    """A bf16 dp2·pp2 run (2 steps of 2 micro-batches, so 4 forwards per stage): on every rank
    ``hybrid.check`` runs once and ``precision.resolve`` once (inside it); the forwards, the
    pipeline and ``parallelize`` take the plan's resolved dtype and resolve nothing again."""
    for counts, rank, coords in minipar.launch(_count_decisions, 4, timeout=120):
        assert counts == {"resolve": 1, "check": 1}, (rank, counts)


def test_the_plan_is_decided_at_check():
    """``hybrid.check`` returns the plan: the dtype resolved, ``zero=None`` as stage 0, ZeRO without
    anything to shard over (dp·cp = 1) as stage 0, bounds a tuple; a plan refuses an unresolved
    dtype (plans come from check); ``HybridModel`` decides nothing when given one."""
    import torch
    from minipar.models import GPTConfig
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=False)
    plan = hybrid.check(cfg, None, 4, dp=2, pp=2, dtype="bf16", zero=None, bounds=[0, 2, 4])
    assert (plan.dtype, plan.zero, plan.bounds) == (torch.bfloat16, 0, (0, 2, 4))
    assert hybrid.check(cfg, None, 4, dp=2, tp=2, zero=2).zero == 2
    assert hybrid.check(cfg, None, 2, tp=2, zero=1).zero == 0          # dp·cp = 1: nothing to shard over
    assert hybrid.check(cfg, None, 2, dp=2, dtype=torch.float32).dtype is None
    with pytest.raises(TypeError, match="resolved dtype"):
        Parallelism(dtype="bf16")
    with pytest.raises(ValueError, match="recompute"):
        hybrid.check(cfg, None, 2, dp=2, recompute="sometimes")
    src = inspect.getsource(hybrid.HybridModel.__init__)
    assert "replace(" not in src and "or 0" not in src and "precision" not in src


def _zero_reads(path: Path) -> list[str]:
    """Lines of ``path`` (code, not docstrings or comments) that read a ZeRO stage or test for stage
    3's state: ``.zero``, ``zero ==``/``in``/``>=``, ``zero1``, ``sharded is``, ``hsdp``."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) or isinstance(node, ast.Attribute) or isinstance(node, ast.Name):
            if id(node) in docs:
                continue
            text = ast.unparse(node)
            if re.search(r"\bzero1?\b|\bsharded is\b|\bhsdp\b", text) and not isinstance(node, ast.Name):
                out.append(f"{path.name}:{node.lineno}: {text}")
    return out


def test_the_zero_stage_is_dispatched_in_one_place():
    """``hybrid/model.py`` and ``hybrid/train.py`` read no ZeRO stage (nor stage 3's state, nor HSDP);
    in ``hybrid/`` the one function that branches on ``plan.zero`` is ``sharding.build_optimizer``;
    it takes the pieces it builds from, not a model posing as a HybridModel, and nothing reaches into
    an optimizer's parts for the experts' gradient shards."""
    for name in ("model.py", "train.py"):
        assert _zero_reads(ROOT / "hybrid" / name) == [], _zero_reads(ROOT / "hybrid" / name)
    readers = set()
    for path in (ROOT / "hybrid").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(n, ast.Compare) and re.search(r"\bzero\b", ast.unparse(n.left)) for n in ast.walk(node)):
                readers.add(f"{path.name}:{node.name}")
    # the checks validate the stage asked for, build_optimizer builds it
    assert readers == {"sharding.py:build_optimizer", "config.py:check_zero", "hsdp.py:check_hsdp"}, readers
    from minipar.hybrid import sharding
    assert "hm" not in inspect.signature(sharding.build_optimizer).parameters
    assert "optimizer.parts" not in (ROOT / "hybrid" / "sharding.py").read_text()


def _registered():
    """Rank function: the step work ``parallelize`` registered on this rank, by function name, for a
    MoE GPT on dp2·ep2 under each ZeRO stage, and for a dense GPT under HSDP (dp4, dp_shard=2)."""
    import torch.distributed as dist
    from minipar.mesh import ProcessMesh
    from minipar.models import GPT, GPTConfig
    moe = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, moe_every=1, n_experts=4,
                    top_k=2, tie_weights=False)
    dense = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=False)
    out = {}
    name = lambda fns: [f"{getattr(f, '__self__', None).__class__.__name__}.{f.__name__}"   # noqa: E731
                        if hasattr(f, "__self__") else f.__name__ for f in fns]
    cases = [(f"moe zero={z}", moe, dict(dp=4, ep=2), dict(zero=z)) for z in range(4)]
    cases.append(("hsdp", dense, dict(dp=4), dict(zero=3, dp_shard=2)))
    for case, cfg, degrees, options in cases:
        hm = hybrid.build(GPT(cfg, seed=0), ProcessMesh(**degrees).build(), **options)
        out[case] = (name(hm.parts.starts), name(hm.parts.finishes), name(hm.parts.losses),
                     getattr(hm.parts.dp, "replicas", None) is not None)
    return out if dist.get_rank() == 0 else None


def test_each_step_registers_its_work_after_backward():
    """``apply_ep`` registers the routing reset and the auxiliary loss, ``apply_dp`` the gradient work
    of its ZeRO stage (one object per stage: ``Replicated``, ``ShardedOptimizer``,
    ``FullyShardedState``, HSDP's replica all-reduce inside stage 3's); the step runs what was
    registered, in build order."""
    got = minipar.launch(_registered, 4, timeout=120)[0]
    lam = "<lambda>"
    assert got["moe zero=0"] == ([lam], ["Replicated.finish"], [lam], False)
    assert got["moe zero=1"] == ([lam], ["ShardedOptimizer.finish"], [lam], False)
    assert got["moe zero=2"] == ([lam], ["ShardedOptimizer.finish"], [lam], False)
    assert got["moe zero=3"] == ([lam], ["FullyShardedState.finish"], [lam], False)
    assert got["hsdp"] == ([], ["FullyShardedState.finish"], [], True)
    step = inspect.getsource(hybrid.HybridModel.step).split('"""')[2]   # the code, not the docstring
    assert "finish(" in step and "experts" not in step and "reducer" not in step


def test_run_decides_in_the_driver_and_the_ranks_receive_the_plan(monkeypatch):
    """``hybrid.run`` resolves the dtype once, in the driver (``hybrid.check``), and launches the ranks
    with the decided plan (no launch here: the launch is intercepted)."""
    import torch
    from minipar import data, precision, strategy
    from minipar.models import GPT, GPTConfig
    calls, launched = [], []
    real = precision.resolve
    monkeypatch.setattr(precision, "resolve", lambda d: calls.append(d) or real(d))
    monkeypatch.setattr(strategy, "launch", lambda fn, n, args, kwargs, **k: launched.append(kwargs) or [])
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=False)
    batches = data.batches(data.synthetic_tokens(2000, 32), 2, 4, 16)
    hybrid.run(GPT(cfg, seed=0), batches, 4, dp=2, pp=2, microbatches=2, dtype="bf16", zero=None, timeout=30)
    assert calls == ["bf16"]
    (kwargs,) = launched
    assert kwargs["plan"].dtype is torch.bfloat16 and kwargs["plan"].zero == 0
    assert kwargs["degrees"] == {"dp": 2, "pp": 2, "tp": 1, "cp": 1, "ep": 1}
