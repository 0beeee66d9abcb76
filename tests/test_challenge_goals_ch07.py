"""ch07's goals can fail: an answer missing any one of them (memory, bubble, bytes, a valid
configuration) is rejected with a message naming the measured value against the goal, and the
library's own rule (exercise 07 C's ``choose_config``) does not pass the challenge."""
import types

import pytest

from minipar import hybrid
from minipar import cost
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch07_mesh_layout as ch07
from minipar.course.graded.alternatives import ch07_mesh_layout as alternative


def _module(fn):
    return types.SimpleNamespace(__name__="planted", layout=fn)


def _fails(fn, case, match):
    with pytest.raises(GradeFailure, match=match):
        ch07.test_layout_meets_the_goals(_module(fn), case)


def test_a_valid_answer_passes():
    for case in ch07.CASES:
        ch07.test_layout_meets_the_goals(_module(alternative.layout), case)


def test_pure_data_parallelism_misses_the_memory_goal():
    def most_dp(cfg, w, b, m, mem):     # the least model parallelism the model allows, whatever its memory
        return max(hybrid.valid_configs(cfg, w, b, m), key=lambda c: (c["dp"], -c["pp"]))
    _fails(most_dp, "small, a quarter of 16Ψ",
           r"model states [\d,]+ B per rank, the budget is")


def test_the_deepest_pipeline_misses_the_bubble_goal():
    def deepest(cfg, w, b, m, mem):     # the most stages that fit, whatever the bubble
        ok = [c for c in hybrid.valid_configs(cfg, w, b, m)
              if cost.hybrid_memory_per_rank(hybrid.num_params(cfg), c["dp"], c["pp"], c["tp"])["total"] <= mem]
        return max(ok, key=lambda c: (c["pp"], -c["tp"]))
    _fails(deepest, "wide, half of 16Ψ", r"a bubble of \d+\.\d+ of the step .* the goal is at most 0\.5")


def test_tensor_parallelism_first_misses_the_bytes_goal():
    def tp_first(cfg, w, b, m, mem):    # memory and bubble met, by tp: the most bytes
        ok = [c for c in hybrid.valid_configs(cfg, w, b, m)
              if cost.hybrid_memory_per_rank(hybrid.num_params(cfg), c["dp"], c["pp"], c["tp"])["total"] <= mem
              and cost.bubble_fraction("1f1b", c["pp"], m) <= ch07.BUBBLE]
        return max(ok, key=lambda c: (c["tp"], -c["pp"]))
    _fails(tp_first, "wide, an eighth of 16Ψ", r"B sent per rank per step, \d\.\d\d × the fewest .* at most 1\.25 ×")


def test_an_invalid_configuration_is_refused():
    _fails(lambda cfg, w, b, m, mem: {"dp": 1, "pp": 1, "tp": 8}, "three heads, half of 16Ψ",
           r"is not a configuration the library can train here")


def test_the_librarys_rule_does_not_pass():
    """choose_config (least model parallelism, tp before pp) meets memory but not the bytes goal."""
    def library(cfg, w, b, m, mem):
        return hybrid.choose_config(cfg, w, b, m, memory_per_rank=mem)
    failed = []
    for case in ch07.CASES:
        try:
            ch07.test_layout_meets_the_goals(_module(library), case)
        except GradeFailure as e:
            failed.append(str(e))
    assert failed and all("goal" in f for f in failed), failed
