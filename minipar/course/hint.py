"""``minipar.hint("ex08", "A")`` and ``python -m minipar.hint ex08 A``: see :mod:`minipar.course.hints`."""
import sys
import types

from .hints import hint, main

__all__ = ["hint", "main"]


class _CallableModule(types.ModuleType):
    """``minipar.hint(...)`` calls :func:`minipar.course.hints.hint`; ``python -m minipar.hint`` runs it."""

    def __call__(self, exercise: str, part: str | None = None, tier: int | None = None,
                 reset: bool = False, verbose: bool = True) -> str:
        return hint(exercise, part, tier=tier, reset=reset, verbose=verbose)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
