"""Exercise 01's contract, clause by clause: the solution with one clause broken fails the
graded test that CONTRACT names for it, with a message naming the clause."""
import pytest

from minipar.course.graded import test_ex01_collectives as ex01
from planted import fails, planted

ALL_REDUCE_HALVES = ('''        _reduce_scatter_chunks(chunks, group, "ring_all_reduce")
        _all_gather_chunks(chunks, group, "ring_all_reduce")''')

CASES = {
    "avg not divided": ("test_average_four_ranks", [("flat /= n", "pass")], r"not divided by n"),
    "remainder dropped": ("test_sum_uneven_sizes",
                          [("chunks = list(flat.tensor_split(n))",
                            "chunks = list(flat[:n * (flat.numel() // n)].tensor_split(n))")],
                          r"size 3 does not divide"),
    "a copy returned": ("test_in_place_and_returned",
                        [("tensor.copy_(flat.view_as(tensor))\n    return tensor",
                          "tensor.copy_(flat.view_as(tensor))\n    return tensor.clone()")],
                        r"in place, and returns that same tensor"),
    "a chunk sent twice": ("test_bytes_match_cost_model",
                           [(ALL_REDUCE_HALVES, ALL_REDUCE_HALVES + '\n        _all_gather_chunks(chunks, group, "ring_all_reduce")')],
                           r"bytes sent by each rank, all-reducing \d+ floats over \d+ ranks"),
    "the world's size on a group": ("test_pieces_on_any_group",
                                    [("flat /= n", "flat /= torch.distributed.get_world_size()")],
                                    r"any group.*divides by n = 3"),
    "input changed": ("test_pieces_on_any_group",
                      [("chunks = [c.clone() for c in tensor.reshape(-1).tensor_split(n)]",
                        "chunks = list(tensor.reshape(-1).tensor_split(n))")],
                      r"the input tensor is left unchanged"),
    "sizes ignored": ("test_pieces_on_any_group",
                      [("if len(sizes) != n or sizes[r] != chunk.numel():", "if len(sizes) != n:")],
                      r"sizes that do not match this rank's chunk are a ValueError"),
    "src ignored": ("test_pieces_on_any_group",
                    [("flat, vr = tensor.view(-1), (r - src) % n", "src = 0; flat, vr = tensor.view(-1), r")],
                    r"from any src"),
    "an unknown algorithm accepted": ("test_pieces_on_any_group",
                                      [("raise ValueError(f\"algorithm must be 'tree' or 'ring', got {algorithm!r}\")",
                                        "pass")],
                                      r"any other algorithm is a ValueError"),
}


@pytest.mark.parametrize("case", CASES)
def test_planted_answer_fails_its_clause(case, tmp_path):
    test, edits, match = CASES[case]
    from minipar.course.grading import observed
    clauses = [k for k, v in observed(ex01).items() if test in v]
    assert clauses, f"{test} observes no clause of the contract"
    with planted("ex01", tmp_path, *edits):
        fails(getattr(ex01, test), match=match)


def test_every_clause_is_in_the_contract_and_tested():
    from minipar.course.grading import observed
    from minipar.course.markers import clauses
    planted_tests = {t for t, _, _ in CASES.values()}
    for clause, tests in observed(ex01).items():
        assert clause in clauses("ex01"), clause
        assert planted_tests & set(tests), clause
