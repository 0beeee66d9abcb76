"""``python -m minipar.grade ex04`` (core, then challenge), ``ch04`` (the challenge alone),
``--reset ex02``: the grader, :mod:`minipar.course.grade` (the command's short name)."""
import sys

from .course import grade as _grade

if __name__ == "__main__":
    sys.exit(_grade.main())
sys.modules[__name__] = _grade   # ``import minipar.grade`` is the module itself
