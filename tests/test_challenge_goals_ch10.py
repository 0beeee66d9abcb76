"""ch10's goals can fail: a choice missing any one of them (a layout of the cluster's GPUs that
can run, fits and comes within 10% of the planner's best) is rejected with a message naming
what was measured, and the library's own answer (its search, or its enumerator of layouts) is
refused."""
import types

import pytest

from minipar import plan
from minipar.course import challenge
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch10_layout as ch10
from minipar.course.graded.alternatives import ch10_layout as alternative

LLAMA8, LLAMA70 = ch10.JOBS[0], ch10.JOBS[1]


def _module(fn):
    return types.SimpleNamespace(__name__="planted", choose=fn)


def _fails(fn, job, monkeypatch, match):
    with pytest.raises(GradeFailure, match=match):
        ch10.test_fits_and_is_near_the_best(_module(fn), job, monkeypatch)


def test_a_valid_answer_passes(monkeypatch):
    ch10.test_fits_and_is_near_the_best(_module(alternative.choose), LLAMA8, monkeypatch)


def test_a_layout_that_does_not_fit_is_rejected(monkeypatch):
    _fails(lambda model, cluster, nodes, b, s: plan.Layout(dp=64, zero=1), LLAMA70, monkeypatch,
           r"llama3-70b on 8 × dgx-h100: dp64 \(b=1, bf16, ZeRO-1\) does not fit: needs \d+ GB per GPU")


def test_a_slow_layout_misses_the_time_goal(monkeypatch):
    _fails(lambda model, cluster, nodes, b, s: plan.Layout(dp=2, tp=8, zero=1, recompute="full"), LLAMA8,
           monkeypatch, r"predicted step 5\.\d\d s with dp2·tp8 .*, 1\.6\d × the planner's best 3\.\d\d s .* at most 1\.10 ×")


@pytest.mark.parametrize("bad, match", [
    (lambda *a: plan.Layout(dp=8, zero=1), r"layout dp8 .* uses 8 GPUs, the cluster has 16"),
    (lambda *a: plan.Layout(dp=16, micro_batch=3), r"cannot run: .*global batch 64 is not a multiple of dp·b=48"),
    (lambda *a: {"dp": 16}, r"choose returned dict, not a plan.Layout")])
def test_an_invalid_choice_is_refused(bad, match, monkeypatch):
    _fails(bad, LLAMA8, monkeypatch, match)


def test_the_librarys_search_is_refused(monkeypatch, tmp_path):
    """Calling plan.search fails while choose runs; a file importing the search module or its
    enumerator of layouts is refused before it runs, naming the line."""
    _fails(lambda model, cluster, nodes, b, s: plan.search(model, cluster, b, s, nodes=nodes).best.layout,
           LLAMA8, monkeypatch, r"choose\(\) called plan.search")
    banned = challenge.forbidden("ch10_layout")
    for i, text in enumerate((
            "from minipar import plan\n\n\ndef choose(m, c, n, b, s):\n    return min(plan.layouts(m, 16, 8, b, s))\n",
            "from minipar.plan.search import layouts\n",
            "import minipar.plan.search as s\n")):
        path = tmp_path / f"ch10_layout_{i}.py"
        path.write_text(text)
        with pytest.raises(GradeFailure, match=r"(?s)ch10_layout_\d\.py:\d+ .*graded without minipar\.plan\.(layouts|search)"):
            challenge.refuse_imports(path, banned)
    ok = tmp_path / "ok.py"
    ok.write_text("from minipar import plan\n\n\ndef choose(m, c, n, b, s):\n    return plan.Layout(dp=16)\n")
    challenge.refuse_imports(ok, banned)
