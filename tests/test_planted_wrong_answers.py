"""Wrong answers that once scored 100%: each, planted as the learner's file (the solution with a
line or two changed), now fails a graded test whose message names the clause it breaks. Every
case observes its clause directly: the group a collective ran on, the units gathered at the
peak, the bytes and messages of the ring, validity on every (p, m), the recorder's bytes."""
import types

import pytest

from minipar.course.graded import test_ex02_data_parallel as ex02
from planted import fails, planted

PLANTS = {
    # the reducer's own all-reduce on the world instead of its group
    "ex02 C: the reducer's all-reduce on the world group": (
        "ex02", [('op="avg", group=self.group, async_op=True', 'op="avg", group=None, async_op=True')],
        ex02.test_reducer_on_a_sub_group,
        r"C: Reducer, overlap=True, step 0, rank 0 .*: the group labels of the recorded gradient all-reduces "
        r"\(any group"),
}


@pytest.mark.parametrize("case", list(PLANTS))
def test_wrong_answer_fails_naming_its_clause(case, tmp_path):
    exercise, edits, test, match = PLANTS[case]
    with planted(exercise, tmp_path, *edits):
        fails(test, match=match)
