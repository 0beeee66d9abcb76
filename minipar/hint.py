"""``python -m minipar.hint``: tiered hints, :mod:`minipar.course.hint` (the command's short name)."""
import sys

from .course import hint as _hint

if __name__ == "__main__":
    sys.exit(_hint.main())
sys.modules[__name__] = _hint   # ``import minipar.hint`` is the module itself
