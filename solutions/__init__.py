"""Completed versions of the files in ``exercises/`` (the same names and signatures)."""
