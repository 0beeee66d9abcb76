"""``python -m minipar.grade``: the grader, :mod:`minipar.course.grade` (the command's short name)."""
import sys

from .course import grade as _grade

if __name__ == "__main__":
    sys.exit(_grade.main())
sys.modules[__name__] = _grade   # ``import minipar.grade`` is the module itself
