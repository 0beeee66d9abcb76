"""Shared pytest configuration of the repository's tests. The graded tests' options and
fixtures (``--impl``, ``impl``, ``challenge``) live beside them, in
``minipar/course/graded/conftest.py``."""
