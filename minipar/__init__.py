"""minipar: data, pipeline, tensor and hybrid parallelism and ZeRO, from scratch."""
from .launch import LaunchTimeout, RankError, launch, shutdown

__version__ = "0.1.0"
__all__ = ["launch", "shutdown", "RankError", "LaunchTimeout", "grade"]


def grade(exercise: str, target: str = "exercise", verbose: bool = True):
    """Grade an exercise (see :mod:`minipar.grade`)."""
    from .grade import grade as _grade
    return _grade(exercise, target=target, verbose=verbose)
