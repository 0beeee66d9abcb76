"""Shared pytest configuration.

``--impl`` chooses which implementations the graded tests (tests/graded) run against:
``library`` (minipar itself), ``solution`` (solutions/) and ``exercise`` (exercises/,
what ``minipar.grade`` uses). CI runs library and solution; a separate test checks that
the exercise stubs score zero.
"""
import importlib

import pytest


def pytest_addoption(parser):
    parser.addoption("--impl", default="library,solution",
                     help="comma-separated: library, solution, exercise")


def pytest_generate_tests(metafunc):
    if "impl" in metafunc.fixturenames:
        kinds = [k for k in metafunc.config.getoption("impl").split(",") if k]
        metafunc.parametrize("impl", kinds, indirect=True)


@pytest.fixture
def impl(request):
    """The module under test: the library module, or the solution/exercise file."""
    mod = request.module
    name = {"library": mod.LIBRARY, "solution": f"solutions.{mod.EXERCISE}",
            "exercise": f"exercises.{mod.EXERCISE}"}[request.param]
    return importlib.import_module(name)
