"""Exercise 02's contract, clause by clause: the solution with one clause broken fails the
graded test that CONTRACT names for it, with a message naming the clause. The gradient-less
parameter's plants would deadlock on real collectives; the graded test records the calls
instead, so they fail in seconds."""
import pytest

from minipar.course.graded import test_ex02_data_parallel as ex02
from planted import fails, planted

A_AVG = 'comm.all_reduce(p.grad, op="avg", group=group, name="grad_all_reduce")'
PARTICIPATION = "test_gradient_less_parameter_dtype_group_two_steps"

CASES = {
    "A skips a parameter without a gradient": (
        PARTICIPATION, [("p.grad = torch.zeros_like(p)", "continue")],
        r"a parameter without a gradient still takes part, as zeros"),
    "A zeros in the default dtype": (
        PARTICIPATION, [("p.grad = torch.zeros_like(p)", "p.grad = torch.zeros(p.shape)")], r"dtype"),
    "A divides by the world's size": (
        PARTICIPATION, [("    n = comm.group_size(group)\n    for p", "    n = comm.group_size()\n    for p")],
        r"any group"),
    "A sums": ("test_allreduce_gradients_averages", [(A_AVG, A_AVG.replace('"avg"', '"sum"'))],
               r"the sum over the 4 ranks"),
    "A reduces twice": ("test_allreduce_gradients_averages", [(A_AVG, A_AVG + "; " + A_AVG)],
                        r"bytes sent by the gradient all-reduces \(cost.ddp_bytes_per_step"),
    "A includes frozen parameters": ("test_allreduce_gradients_averages",
                                     [("for p in trainable(params):", "for p in params:")],
                                     r"frozen parameters stay without a gradient"),
    "A sums with all_reduce_fn": ("test_allreduce_gradients_with_your_all_reduce",
                                  [("            p.grad.div_(n)\n", "")], r"the sum over the 2 ranks"),
    "B first to last": ("test_assign_buckets", [("reversed(list(params))", "list(params)")],
                        r"the order in which backward makes gradients ready"),
    "B overflows the cap": ("test_assign_buckets", [("size + nbytes > cap", "size > cap")],
                            r"no bucket exceeds the cap unless a single parameter does"),
    "B mixes dtypes": ("test_assign_buckets", [(" or buckets[-1][0].dtype != p.dtype", "")],
                       r"one dtype per bucket"),
    "B takes a negative cap": ("test_assign_buckets", [("if bucket_cap_mb < 0:", "if bucket_cap_mb < -1e9:")],
                               r"a negative cap is a ValueError"),
    "C never launches an incomplete bucket": (
        PARTICIPATION, [("            self.pending[i] = 0\n", "")],
        r"a parameter without a gradient still takes part, as zeros"),
    "C divides by the world's size": (
        PARTICIPATION, [("self.n = comm.group_size(group)", "self.n = comm.group_size()")], r"any group"),
    "C keeps its state": (PARTICIPATION, [("b.unpack()\n        self.reset()", "b.unpack()")],
                          r"step 1.*a second step starts from a clean state"),
    "C launches only in finish": ("test_reducer_overlaps_with_backward",
                                  [("if self.overlap:\n            self._launch_ready()",
                                    "if False:\n            self._launch_ready()")],
                                  r"with overlap, a bucket's all-reduce starts during the backward"),
    "C syncs under no_sync": ("test_reducer_accumulation_and_no_overlap",
                              [("if not self.require_sync:\n            return", "")],
                              r"cost.ddp_bytes_per_step per step; none inside no_sync"),
    "C sums": ("test_reducer_overlapped_matches_single_process",
               [('op="avg", group=self.group', 'op="sum", group=self.group')], r"single process"),
}


@pytest.mark.parametrize("case", CASES)
def test_planted_answer_fails_its_clause(case, tmp_path):
    test, edits, match = CASES[case]
    with planted("ex02", tmp_path, *edits):
        fails(getattr(ex02, test), match=match)


def test_every_clause_is_in_the_contract_and_planted():
    from minipar.course.markers import clauses
    planted_tests = {t for t, _, _ in CASES.values()}
    from minipar.course.grading import observed
    for clause, tests in observed(ex02).items():
        assert clause in clauses("ex02"), clause
        assert all(callable(getattr(ex02, t, None)) for t in tests), tests
        assert planted_tests & set(tests), clause
