"""The ``challenge`` fixture (stand-in): the module a challenge's graded tests measure.

A graded challenge test module sets ``CHALLENGE = "chNN_topic"``; the fixture loads that file
from ``solutions/challenges`` ("solution"), ``tests/graded/alternatives`` ("alternative") or
``exercises/challenges`` ("exercise", what a learner grades; ``--challenge=exercise``)."""
import importlib

import pytest


def pytest_addoption(parser):
    parser.addoption("--challenge", default=None,
                     help="comma-separated: exercise, solution, alternative (default: exercise "
                          "under --impl=exercise, as minipar.grade runs, else solution,alternative)")


def pytest_generate_tests(metafunc):
    if "challenge" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("challenge")
        if chosen is None:
            chosen = "exercise" if metafunc.config.getoption("impl") == "exercise" else "solution,alternative"
        kinds = [k for k in chosen.split(",") if k]
        metafunc.parametrize("challenge", kinds, indirect=True)


MODULES = {"exercise": "exercises.challenges", "solution": "solutions.challenges",
           "alternative": "tests.graded.alternatives"}


def load(name: str, target: str):
    """The module ``name`` (e.g. "ch04_schedule") of ``target``, imported by its dotted name
    (so that ranks unpickle its functions, or import it by ``module.__name__``)."""
    return importlib.import_module(f"{MODULES[target]}.{name}")


@pytest.fixture
def challenge(request):
    return load(request.module.CHALLENGE, request.param)
