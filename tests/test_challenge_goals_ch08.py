"""ch08's goals can fail: a layout missing any one of them (a partition, balanced token counts,
balanced causal work) is rejected with a message naming the measured value against the goal,
and the library's own layouts (contiguous, zigzag) do not pass the challenge."""
import types

import pytest
import torch

from minipar import context_parallel as cpm
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch08_sequence_layout as ch08
from minipar.course.graded.alternatives import ch08_sequence_layout as alternative


def _module(fn):
    return types.SimpleNamespace(__name__="planted", layout=fn)


def _contiguous(T, cp):
    bounds = [T * r // cp for r in range(cp + 1)]
    return [list(range(bounds[r], bounds[r + 1])) for r in range(cp)]


def _zigzag_unequal(T, cp):     # zigzag on 2·cp chunks of ⌊T/2cp⌋ or ⌈T/2cp⌉ positions
    b = [T * i // (2 * cp) for i in range(2 * cp + 1)]
    return [list(range(b[r], b[r + 1])) + list(range(b[2 * cp - 1 - r], b[2 * cp - r])) for r in range(cp)]


def test_a_valid_answer_passes():
    m = _module(alternative.layout)
    ch08.test_layout_is_a_partition(m)
    ch08.test_token_counts_balanced(m)
    ch08.test_causal_work_balanced(m)


def test_a_lost_position_breaks_the_partition():
    m = _module(lambda T, cp: [p[:-1] if r == 0 else p for r, p in enumerate(alternative.layout(T, cp))])
    with pytest.raises(GradeFailure, match=r"layout\(48, 3\): the positions held, sorted"):
        ch08.test_layout_is_a_partition(m)


def test_unequal_token_counts_miss_the_memory_goal():
    def heavy_first(T, cp):     # balanced work, but rank 0 takes the cheap tokens too
        out = alternative.layout(T, cp)
        out[0], out[1] = sorted(out[0] + out[1][: len(out[1]) // 2]), out[1][len(out[1]) // 2:]
        return out
    with pytest.raises(GradeFailure, match=r"tokens per rank \[.*\]: they differ by \d+, the goal is at most 1"):
        ch08.test_token_counts_balanced(_module(heavy_first))


def test_contiguous_shards_miss_the_work_goal():
    m = _module(_contiguous)
    ch08.test_layout_is_a_partition(m)
    ch08.test_token_counts_balanced(m)
    with pytest.raises(GradeFailure, match=r"the busiest rank does 1\.[6-9]\d\d × the mean, the goal is at most 1\.03"):
        ch08.test_causal_work_balanced(m)


def test_the_librarys_zigzag_does_not_pass():
    """The library's zigzag (cpm.sequence_positions) refuses lengths 2·cp does not divide, and
    zigzag on unequal chunks misses the work goal."""
    with pytest.raises(ValueError):
        cpm.sequence_positions(50, 0, 3, "zigzag")
    assert cpm.sequence_positions(48, 1, 3, "zigzag").tolist() == _zigzag_unequal(48, 3)[1]
    m = _module(_zigzag_unequal)
    ch08.test_layout_is_a_partition(m)
    with pytest.raises(GradeFailure, match=r"layout\(77, 5\): tokens per rank \[.*\]: they differ by 2"):
        ch08.test_token_counts_balanced(m)
    with pytest.raises(GradeFailure, match=r"(?s)busiest rank does 1\.\d+ × the mean.*<- over the goal"):
        ch08.test_causal_work_balanced(m)
