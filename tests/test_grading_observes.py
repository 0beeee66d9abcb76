"""Every graded test says which contract clauses it observes (``grading.observes``), with ids
of its own exercise or challenge (``ex02.C.group``), and the tags read back."""
import importlib
import inspect

import pytest

from minipar.course.challenge import graded_dir
from minipar.course.grading import CLAUSE_ID, observed, observes

MODULES = sorted(p.stem for p in graded_dir().glob("test_*.py"))


@pytest.mark.parametrize("stem", MODULES)
def test_every_graded_test_observes_clauses_of_its_own_exercise(stem):
    module = importlib.import_module(f"minipar.course.graded.{stem}")
    own = stem.split("_")[1]
    tests = [n for n, f in inspect.getmembers(module, inspect.isfunction) if n.startswith("test_")]
    assert tests
    for name in tests:
        tags = getattr(getattr(module, name), "__observes__", ())
        assert tags, f"{stem}.{name} observes no clause"
        for tag in tags:
            assert CLAUSE_ID.match(tag) and tag.startswith(own + "."), (name, tag)
    assert sorted({t for ts in observed(module).values() for t in ts}) == sorted(tests)


def test_observes_refuses_a_malformed_id():
    for bad in ("ex02.group", "ex2.C.group", "ex02.c.group", "ex02.C.Group", ""):
        with pytest.raises(ValueError):
            observes(bad)

    @observes("ex02.C.group")
    @observes("ex02.*.recorded")
    def test_x():
        pass
    assert test_x.__observes__ == ("ex02.*.recorded", "ex02.C.group")
