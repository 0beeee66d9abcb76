"""Graded exercises: minipar's own functions with the marked parts of their bodies left to you.

Each ``exNN_topic.py`` is generated from the library (``python -m minipar.course.exercise --write``):
the functions and methods that hold an exercise's marked code, each marked region replaced
by hints and ``raise NotImplementedError``. Write your code there, then run the library
with it (``with minipar.exercise("ex02"): ...``) or grade it: ``python -m minipar.grade
ex02`` in a shell, ``minipar.grade("ex02")`` in a notebook. ``solutions/`` holds the
library's own code for the same pieces.
"""
