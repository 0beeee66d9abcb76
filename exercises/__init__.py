"""Graded exercises: minipar's own key functions with the body left to you.

Each ``exNN_*.py`` file has the same functions, names and signatures as the library.
Fill in the bodies, then grade: ``python -m minipar.grade ex01`` in a shell or
``minipar.grade("ex01")`` in a notebook. ``solutions/`` holds completed versions.
"""
