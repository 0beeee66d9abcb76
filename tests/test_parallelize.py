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
