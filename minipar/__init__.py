"""minipar: data, pipeline, tensor and hybrid parallelism and ZeRO, from scratch."""
from . import grade  # a callable module: minipar.grade("ex01")
from .launch import LaunchTimeout, RankError, launch, shutdown

__version__ = "0.1.0"
__all__ = ["launch", "shutdown", "RankError", "LaunchTimeout", "grade"]

