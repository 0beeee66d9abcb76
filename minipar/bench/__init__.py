"""Benchmarks: ``python -m minipar.bench NAME [--quick] [--json]``.

Each benchmark is a module here with ``main(argv) -> dict``. It times minipar against PyTorch's own
implementation of the same thing, interleaved in one run (so both see the same machine load), prints
a table, and returns a result whose ``ratio`` is minipar's time over the baseline's (lower is better).
"""
