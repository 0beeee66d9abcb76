"""The grading helpers: each failure names the place, shows expected against got, labelled,
and never an object's repr (no launch: fast)."""
import pytest
import torch

from minipar.course.grading import (GradeFailure, contributions, diagnose, expect, expect_close,
                             expect_contributions, expect_equal, expect_schedule)


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(GradeFailure) as e:
        fn(*args, **kwargs)
    assert isinstance(e.value, AssertionError)
    return str(e.value)


def test_expect_equal_names_the_first_difference_and_shows_both_labelled():
    msg = _message(expect_equal, [4, 4, 3, 2], [4, 3, 2, 1], "peak micro-batches held, per rank", keys="rank")
    first, *rest = msg.splitlines()
    assert first == "peak micro-batches held, per rank: rank 1: expected 3, got 4"
    assert rest == ["  expected: [4, 3, 2, 1]", "  got:      [4, 4, 3, 2]"]
    expect_equal([1, 2], [1, 2], "same")
    expect_equal({"a": [1.0, 2]}, {"a": [1.0, 2]}, "same dict")


def test_expect_equal_nested_dicts_lengths_and_types():
    msg = _message(expect_equal, {0: [1, 2], 1: [1, 5]}, {0: [1, 2], 1: [1, 3]}, "buckets", keys="rank")
    assert msg.splitlines()[0] == "buckets: rank 1[1]: expected 3, got 5"
    msg = _message(expect_equal, {"send": [3, 11]}, {"send": [3, 7]}, "split sizes")
    assert msg.splitlines()[0] == "split sizes: send[1]: expected 7, got 11"
    msg = _message(expect_equal, {1: {"dp": 1}}, {1: {"dp": 0}}, "coordinates", keys="rank")
    assert msg.splitlines()[0] == "coordinates: rank 1, dp: expected 0, got 1"
    msg = _message(expect_equal, [1, 2], [1, 2, 3], "boundaries")
    assert "expected 3 entries, got 2" in msg.splitlines()[0]
    msg = _message(expect_equal, {"dp": 1}, {"dp": 1, "tp": 0}, "coordinates")
    assert "missing 'tp'" in msg
    expect_equal([1.0], [1], "equal numbers")
    msg = _message(expect_equal, [torch.tensor(3)], [3], "split sizes")
    assert "expected 3 (int), got 3 (Tensor)" in msg


def test_expect_close_names_the_element_and_counts():
    want = torch.arange(12.0).reshape(3, 4)
    got = want.clone()
    got[1, 2] += 0.5
    got[2, 3] -= 2.0
    msg = _message(expect_close, got, want, "weight gradient", where="rank 1")
    lines = msg.splitlines()
    assert lines[0] == "rank 1: weight gradient: element (1, 2): expected 6, got 6.5"
    assert "2 of 12 elements differ" in lines[1] and "largest difference is 2 at (2, 3)" in lines[1]
    assert "<built-in method" not in msg and "tensor(" not in msg
    assert "expected: [0, 1, 2" in msg                   # small: shown whole
    expect_close(want + 1e-7, want, "within fp32 tolerance")
    assert "expected shape (3, 4), got shape (4, 3)" in _message(expect_close, want.T, want, "output")
    assert "inf or nan" in _message(expect_close, want / 0, want + 1, "loss")
    assert "expected a tensor" in _message(expect_close, None, want, "output")


def test_expect_close_large_tensor_is_not_printed_whole():
    want = torch.zeros(1000)
    got = want.clone()
    got[999] = 1
    msg = _message(expect_close, got, want, "sum", rtol=0, atol=0)
    assert "element (999,): expected 0, got 1" in msg and "1 of 1000" in msg and "expected:" not in msg


def test_expect_schedule_side_by_side_with_the_first_difference_marked():
    want = {0: "F0 F1 B0 B1".split(), 1: "F0 B0 F1 B1".split()}
    got = {0: "F0 F1 B0 B1".split(), 1: "F0 F1 B0 B1".split()}
    msg = _message(expect_schedule, got, want)
    lines = msg.splitlines()
    assert lines[0] == "1F1B schedule: rank 1, position 1: expected B0, got F1"
    assert len(lines) == 5                                 # both ranks, whole, expected and got
    exp1, got1 = lines[3], lines[4]
    assert ">>B0" in exp1 and ">>F1" in got1 and exp1.index(">>") == got1.index(">>")
    assert "(same)" in lines[2]
    expect_schedule(want, want)
    short = {0: want[0], 1: want[1][:3]}
    assert "position 3: expected B1, got (nothing" in _message(expect_schedule, short, want)


def test_contributions_decode_the_ranks():
    assert contributions(5.0, 3) == "holds ranks 0, 2; missing 1"
    assert contributions(7, 3) == "holds ranks 0, 1, 2"
    assert contributions(torch.tensor(2.0), 2) == "holds rank 1; missing 0"
    assert "no sum of distinct" in contributions(3.5, 3)
    x = torch.full((6,), 7.0)
    expect_contributions(x, 3, [0, 1, 2], "rank 0")
    x[4] = 3.0
    msg = _message(expect_contributions, x, 3, [0, 1, 2], "rank 2, chunk 2")
    assert msg.splitlines()[0] == "rank 2, chunk 2: element (4,) holds ranks 0, 1; missing 2"
    assert "1 of 6 elements are wrong" in msg
    n, pos = 2, torch.arange(4, 8)                          # rank r contributed 2^r + 2^n·i at i
    right = 3 + 2 * 4 * pos.double()
    expect_contributions(right, n, [0, 1], "rank 1, chunk 1", positions=pos)
    wrong = right.clone()
    wrong[1] = 3 + 4 * (5 + 1)                              # rank 1's element from position 1
    msg = _message(expect_contributions, wrong, n, [0, 1], "rank 1, chunk 1", positions=pos)
    assert msg.splitlines()[0] == ("rank 1, chunk 1: element (1,) (position 5) holds ranks 0, 1, but not all "
                                   "from position 5: the positions it summed add up to 6, expected 10: a chunk "
                                   "came from the wrong place")
    wrong[2] = 1 + 4 * 6                                    # rank 1's contribution missing
    assert "element (1,)" in _message(expect_contributions, wrong, n, [0, 1], "r", positions=pos)
    wrong[1] = right[1]
    assert "(position 6) holds rank 0; missing 1" in _message(expect_contributions, wrong, n, [0, 1], "r",
                                                              positions=pos)


def test_diagnose_only_when_its_condition_is_the_cause():
    with pytest.raises(GradeFailure) as e:
        with diagnose(True, "the bytes sent are right; the sum is not"):
            with diagnose(False, "send only chunks, one per step"):
                expect_equal(3, 4, "sum")
    text = str(e.value)
    assert "\n  seen: the bytes sent are right; the sum is not" in text and "send only chunks" not in text
    assert "why:" not in text
    with pytest.raises(GradeFailure) as e:
        with diagnose(lambda f: "got 3" in str(f), "three"):
            expect_equal(3, 4, "sum")
    assert str(e.value).endswith("\n  seen: three")
    with diagnose(True, "never shown"):
        expect_equal(1, 1, "fine")
    assert str(_message(expect, False, "a frozen parameter got a gradient")) == "a frozen parameter got a gradient"
