"""The graded tests' pytest configuration (these tests ship inside the package).

``--impl`` chooses which implementations the graded tests run against: ``library`` (minipar
itself), ``solution`` (solutions/) and ``exercise`` (exercises/, what ``minipar.course.grade``
uses); the ``impl`` fixture puts that implementation's marked functions in the library for the
test. ``--challenge`` does the same for the chapters' challenges. The repository's test run
(``testpaths``) runs library and solution; a separate test checks that the exercise stubs
score zero.
"""
import pytest


def pytest_addoption(parser):
    parser.addoption("--impl", default="library,solution",
                     help="comma-separated: library, solution, exercise")
    parser.addoption("--challenge", default="solution,alternative",
                     help="comma-separated challenge targets: solution, alternative, exercise")


def pytest_generate_tests(metafunc):
    if "impl" in metafunc.fixturenames:
        kinds = [k for k in metafunc.config.getoption("impl").split(",") if k]
        metafunc.parametrize("impl", kinds, indirect=True)
    if "challenge" in metafunc.fixturenames and hasattr(metafunc.module, "CHALLENGE"):
        kinds = [k for k in metafunc.config.getoption("challenge").split(",") if k]
        metafunc.parametrize("challenge", kinds, indirect=True)


@pytest.fixture
def impl(request):
    """Activates the implementation under test (``"library"``, ``"solution"`` or ``"exercise"``)
    of the test module's ``EXERCISE`` for the test, in the driver and in every rank it
    launches (``with minipar.exercise(...)``); the test then calls the library's own code."""
    import minipar
    with minipar.exercise(request.module.EXERCISE, target=request.param):
        yield request.param


@pytest.fixture
def challenge(request):
    """The test module's ``CHALLENGE`` (e.g. ``"ch04_pipeline"``) as written by the target:
    ``"exercise"`` (exercises/challenges/), ``"solution"`` (solutions/challenges/) or
    ``"alternative"`` (``alternatives/`` beside this file: a second, different way that passes)."""
    from minipar.course.challenge import load, watched
    with watched(request.module.CHALLENGE):
        yield load(request.module.CHALLENGE, request.param)
