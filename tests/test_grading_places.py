"""A rank's error names the place in the learner's file: file, line, the code of that line and
the exception, in a rank (through the launcher) and in the driver; an error raised elsewhere
keeps the plain form."""
import re

import pytest
import torch

import minipar
from minipar.comm import ring
from minipar.course import _grade_plugin, markers
from minipar.runtime.launch import RankError

from planted import planted, source

PLANT = '(None if __import__("os").environ.get("RANK") else tensor).device  # planted'


def _edit():
    """Insert :data:`PLANT` before the first line of ex01's ring_all_reduce region that occurs
    once in the solution (found, not written here, so the plant follows the solution's edits)."""
    piece = next(p for p in markers.pieces("ex01") if p.qualname == "ring_all_reduce")
    lines = piece.path.read_text().splitlines()
    text = source("ex01")
    r = next(r for r in piece.regions if r.exercise == "ex01")
    first = next(ln for ln in lines[r.start + 1 + len(r.hints):r.end]
                 if ln.strip() and not ln.strip().startswith("#") and text.count(ln) == 1)
    indent = re.match(r"\s*", first)[0]
    return first, f"{indent}{PLANT}\n{first}"


def _ring_sum():
    return ring.ring_all_reduce(torch.ones(4)).tolist()


def test_a_ranks_error_names_the_file_line_code_and_exception(tmp_path):
    old, new = _edit()
    where = tmp_path / "mine"
    with planted("ex01", where, (old, new)):
        path = next(where.glob("ex01_*.py"))
        line = path.read_text().splitlines().index(new.splitlines()[0]) + 1
        with pytest.raises(RankError) as e:
            minipar.launch(_ring_sum, 2, timeout=60)
        msg = _grade_plugin.explain(e.value)
        assert re.match(rf"rank [01]: {re.escape(str(path.resolve()))}:{line}  {re.escape(PLANT)}  "
                        r"AttributeError: 'NoneType' object has no attribute 'device'", msg), msg

        # the driver: the same place, without a rank
        import os
        os.environ["RANK"] = "0"
        try:
            with pytest.raises(AttributeError) as d:
                ring.ring_all_reduce(torch.ones(4))
        finally:
            del os.environ["RANK"]
        msg = _grade_plugin.explain(d.value)
        assert msg == (f"{path.resolve()}:{line}  {PLANT}  "
                       "AttributeError: 'NoneType' object has no attribute 'device'"), msg


def test_a_path_under_exercises_is_shown_relative_and_other_frames_are_not_the_learners():
    root = markers.ROOT
    tb = ("Traceback (most recent call last):\n"
          f'  File "{root}/minipar/runtime/pool.py", line 140, in run\n    out = fn(*args)\n'
          f'  File "{root}/exercises/ex02_data_parallel.py", line 57, in flush\n    bucket.flat.copy_(g)\n'
          "    ^^^^^^^^^^^^^^^^^\n"
          f'  File "{root}/minipar/comm/ring.py", line 9, in x\n    raise ValueError("no")\n'
          "AttributeError: 'NoneType' object has no attribute 'device'\n")
    assert _grade_plugin.place_in_traceback(tb) == "exercises/ex02_data_parallel.py:57  bucket.flat.copy_(g)"
    library_only = tb.replace("exercises/ex02_data_parallel.py", "minipar/parallel/ddp.py")
    assert _grade_plugin.place_in_traceback(library_only) is None
    e = RankError(1, 2, tb)
    assert _grade_plugin.explain(e) == ("rank 1: exercises/ex02_data_parallel.py:57  bucket.flat.copy_(g)  "
                                        "AttributeError: 'NoneType' object has no attribute 'device'")
    assert _grade_plugin.explain(RankError(1, 2, library_only)).startswith("rank 1 failed: AttributeError")
