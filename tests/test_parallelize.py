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
    # a single strategy's recompute= is applied by @strategy.trains, the one other caller (test_conformance)
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
