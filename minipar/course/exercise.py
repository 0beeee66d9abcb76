"""Exercises are minipar's own code: ``with minipar.exercise("ex02"): ...`` runs yours.

The code a learner writes lives once, in the library, between two marker comments inside
a function or method (optional hint lines right after the opening marker)::

    def assign_buckets(params, bucket_cap_mb):
        \"\"\"...\"\"\"
        # >>> ex02 B
        # Hint: walk reversed(list(params)) ...
        ...the library's code...
        # <<< ex02 B

``python -m minipar.course.exercise --write`` generates ``exercises/exNN_topic.py`` (each region
replaced by its hints and a ``raise NotImplementedError``) and ``solutions/exNN_topic.py`` (the
marked code kept); ``--check`` fails on a stale file; ``--count`` prints the lines a learner
writes per exercise (:mod:`minipar.course.exercise_files`).

``with minipar.exercise("ex02"):`` (or ``target="solution"`` / ``"library"``) makes every
marked function and method of the library run that version for the duration, in this process
and in every rank :func:`minipar.runtime.launch` starts inside the block: the library function's code
is swapped for a two-line trampoline into the learner's function, so every caller (and every
reference to the function, wherever it is held) runs the learner's code."""
from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

from ..runtime import checked
from ..runtime import rank_setup
from .markers import ROOT, exercises, key, pieces, stem  # noqa: F401  (ROOT, key: read from here too)

TARGETS = ("exercise", "solution", "library")
EXERCISES_ENV = "MINIPAR_EXERCISES"  # a directory to load the learner's files from instead of exercises/
FLIGHT_ENV = "MINIPAR_FLIGHT_DIR"    # while grading: where ranks keep their last collective


# ----------------------------------------------------------------------------- activation
_active: list[tuple[str, str]] = []
_SLOT = "__minipar_exercise__"    # the library module's global that the trampolines read


def _get(obj, qualname: str):
    """The raw function at ``qualname`` in module or class ``obj`` (staticmethod, classmethod,
    property and ``functools.wraps`` decorators unwrapped)."""
    for name in qualname.split("."):
        obj = vars(obj)[name] if isinstance(obj, type) else getattr(obj, name)
    if isinstance(obj, (staticmethod, classmethod, property)):
        obj = obj.fget if isinstance(obj, property) else obj.__func__
    return inspect.unwrap(obj)


def _trampoline(fn: types.FunctionType, qualname: str) -> types.CodeType:
    """A code object for ``fn`` that calls the function registered for ``qualname``."""
    cells = "".join(f"    {v} = None\n" for v in fn.__code__.co_freevars)
    uses = "".join(f"        {v}\n" for v in fn.__code__.co_freevars)
    src = (f"def _outer():\n{cells}    def {fn.__name__}(*args, **kwargs):\n{uses}"
           f"        return {_SLOT}[{qualname!r}](*args, **kwargs)\n    return {fn.__name__}\n")
    ns: dict = {}
    exec(compile(src, f"<exercise {qualname}>", "exec"), ns)
    return ns["_outer"]().__code__


def load(exercise: str, target: str = "exercise") -> types.ModuleType | None:
    """The learner's (``target="exercise"``) or the solution's module for ``exercise``,
    freshly imported (edits to the file count); ``None`` for ``target="library"``."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if target == "library":
        return None
    package = {"exercise": "exercises", "solution": "solutions"}[target]
    name = f"{package}.{stem(exercise)}"
    elsewhere = os.environ.get(EXERCISES_ENV) if target == "exercise" else None
    if elsewhere:  # another directory of exercise files (the grader's own tests plant bugs there)
        return load_file(Path(elsewhere) / f"{stem(exercise)}.py", name)
    importlib.import_module(package)
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def load_file(path: Path, name: str) -> types.ModuleType:
    """The module at ``path``, imported afresh as ``name`` (its functions pickle by value, so
    ranks need not find the file's package)."""
    import importlib.util
    import cloudpickle
    if not path.exists():
        raise FileNotFoundError(f"no file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def _signature(fn) -> list:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


class Activation:
    """``with minipar.exercise("ex02", target="exercise"):`` -- see the module docstring."""

    def __init__(self, exercise: str, target: str = "exercise"):
        self.exercise, self.target = key(exercise), target
        self._saved: list = []
        self._checking = checked.required()   # exchanges check their sizes while it is active

    def __enter__(self):
        source = load(self.exercise, self.target)
        marked = pieces(self.exercise)
        if not marked:
            raise ValueError(f"{self.exercise}: no marked code in minipar (known: {', '.join(exercises())})")
        swaps = []
        for p in marked if source is not None else []:
            lib = _get(importlib.import_module(p.module), p.qualname)
            try:
                mine = _get(source, p.qualname)
            except (KeyError, AttributeError):
                raise AttributeError(f"{source.__file__} has no {p.qualname}: keep every function "
                                     "and class of the generated file") from None
            nested = lib.__code__.co_filename.startswith("<exercise ")   # already a trampoline
            now = lib.__globals__[_SLOT][p.qualname] if nested else lib
            if _signature(mine) != _signature(now):
                raise TypeError(f"{p.qualname}{inspect.signature(mine)} in {source.__file__} must "
                                f"take the library's arguments {inspect.signature(now)}")
            swaps.append((lib, mine, p.qualname))
        for lib, mine, qualname in swaps:
            slot = lib.__globals__.setdefault(_SLOT, {})
            self._saved.append((lib, lib.__code__, qualname, slot.get(qualname)))
            slot[qualname] = mine
            lib.__code__ = _trampoline(lib, qualname)
        _active.append((self.exercise, self.target))
        self._checking.__enter__()
        return source

    def __exit__(self, *exc):
        while self._saved:
            lib, code, qualname, before = self._saved.pop()
            lib.__code__ = code
            lib.__globals__[_SLOT].pop(qualname)
            if before is not None:   # an enclosing activation's function
                lib.__globals__[_SLOT][qualname] = before
        _active.remove((self.exercise, self.target))
        self._checking.__exit__(*exc)
        return False


def active() -> list[tuple[str, str]]:
    """The (exercise, target) pairs active now, outermost first (launch carries them to ranks)."""
    return list(_active)


@contextmanager
def environ(name: str, value: str | None):
    """``os.environ[name] = value`` inside the block (nothing set when ``value`` is None), and
    ``name`` alone put back as it was after it."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None) if saved is None else os.environ.__setitem__(name, saved)


def _for_ranks():
    """At each launch (:mod:`minipar.runtime.rank_setup`): the ranks activate what is active here."""
    return partial(activated, active(), os.environ.get(EXERCISES_ENV)) if _active else None


@contextmanager
def activated(pairs, elsewhere: str | None = None):
    """Activate the (exercise, target) pairs of :func:`active` (inside a rank), with the
    learner's files from ``elsewhere`` (the driver's ``MINIPAR_EXERCISES``) if given. While
    grading (``MINIPAR_FLIGHT_DIR`` set) the rank also keeps its last collective in a file there,
    so a hang can be reported rank by rank (:class:`minipar.runtime.flight.Beacon`)."""
    with ExitStack() as stack:
        stack.enter_context(environ(EXERCISES_ENV, elsewhere or None))
        if (where := os.environ.get(FLIGHT_ENV)) and "RANK" in os.environ:
            from ..runtime import flight
            rank = int(os.environ["RANK"])
            stack.enter_context(flight.Beacon(Path(where) / f"rank{rank}.json", rank))
        for exercise, target in pairs:
            stack.enter_context(Activation(exercise, target))
        yield


class _CallableModule(types.ModuleType):
    """``minipar.exercise("ex02")`` is :class:`Activation`; ``python -m minipar.course.exercise`` runs
    the generator's command line."""

    def __call__(self, exercise: str, target: str = "exercise") -> Activation:
        return Activation(exercise, target)


sys.modules[__name__].__class__ = _CallableModule
rank_setup.register("minipar.course.exercise", _for_ranks)

if __name__ == "__main__":
    from minipar.course.exercise_files import main
    sys.exit(main())
