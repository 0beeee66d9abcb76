"""minipar: data, pipeline, tensor and hybrid parallelism and ZeRO, from scratch."""
import importlib

from .runtime.backend import device
from .runtime.launch import LaunchTimeout, RankError, launch, shutdown

__version__ = "0.1.0"
__all__ = ["launch", "device", "shutdown", "RankError", "LaunchTimeout", "grade", "exercise", "hint"]


def __getattr__(name):
    # minipar.grade("ex01"), minipar.exercise("ex02"), minipar.hint("ex08", "A"): callable modules,
    # imported on first use so that ``python -m minipar.grade`` (or ``-m minipar.course.exercise --write``) finds them not yet imported.
    # The commands a learner types stay short: ``python -m minipar.grade`` / ``minipar.hint`` / ``minipar.train``.
    if name in ("grade", "exercise", "hint"):
        return importlib.import_module(f"minipar.course.{name}")
    raise AttributeError(f"module 'minipar' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """``%load_ext minipar``: the ``%%ranks`` cell magic (:mod:`minipar.course.magic`)."""
    from .course.magic import load_ipython_extension as load   # deferred: the course layer and IPython load only in a notebook that asks
    load(ipython)


def unload_ipython_extension(ipython):
    from .course.magic import unload_ipython_extension as unload   # deferred: as above
    unload(ipython)
