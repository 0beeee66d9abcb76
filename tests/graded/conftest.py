"""The ``challenge`` fixture (a minimal stand-in; the full one replaces it): the loaded module
of a test module's ``CHALLENGE`` from ``solutions/challenges`` and ``tests/graded/alternatives``
(``MINIPAR_CHALLENGE=exercise,solution,alternative`` chooses; ``exercise`` loads
``exercises/challenges``)."""
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"exercise": ROOT / "exercises" / "challenges", "solution": ROOT / "solutions" / "challenges",
           "alternative": ROOT / "tests" / "graded" / "alternatives"}


def pytest_generate_tests(metafunc):
    if "challenge" in metafunc.fixturenames:
        kinds = os.environ.get("MINIPAR_CHALLENGE", "solution,alternative").split(",")
        metafunc.parametrize("challenge", [k for k in kinds if k], indirect=True)


@pytest.fixture
def challenge(request):
    name = request.module.CHALLENGE
    path = TARGETS[request.param] / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"challenge_{request.param}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
