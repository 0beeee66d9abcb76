"""What every rank enters around the launched function, said by the layers above the runtime.

:func:`minipar.runtime.launch` knows nothing of what runs above it (the course's exercises,
say). A layer that needs its state carried into the ranks registers a *provider* once::

    rank_setup.register("exercises", provider)

At every launch, in the driver, ``provider()`` returns ``None`` (nothing to carry) or a
callable that takes no arguments and returns a context manager; it travels to each rank
with the job (pickled by reference when importable, else by value, as the launched function
does) and the rank runs the function inside it. ``minipar.course.exercise`` registers one
that activates the same exercises in the ranks as in the driver (``with
minipar.exercise("ex02"): minipar.launch(fn, 2)``).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable

import cloudpickle

_providers: dict[str, Callable] = {}


def register(name: str, provider: Callable) -> None:
    """Ask ``provider()`` at each launch for a context factory the ranks enter (``None``: none).
    Registering a name again replaces its provider."""
    _providers[name] = provider


def collect() -> bytes:
    """In the driver, at launch: the context factories of every provider, in registration
    order, serialised for the job."""
    factories = [f for f in (p() for p in list(_providers.values())) if f is not None]
    return cloudpickle.dumps(factories)


@contextmanager
def entered(blob: bytes | None):
    """In a rank: every context :func:`collect` carried, entered in order (left in reverse)."""
    factories = cloudpickle.loads(blob) if blob else []
    with ExitStack() as stack:
        for factory in factories:
            stack.enter_context(factory())
        yield
