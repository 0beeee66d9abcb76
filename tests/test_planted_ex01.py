"""Exercise 01's contract, clause by clause: the solution with one clause broken fails the
graded test that CONTRACT names for it, with a message naming the clause."""
import pytest

from minipar.course.graded import test_ex01_collectives as ex01
from planted import fails, planted

ALL_REDUCE_HALVES = ('''        _reduce_scatter_chunks(chunks, group, "ring_all_reduce")
        _all_gather_chunks(chunks, group, "ring_all_reduce")''')

WORLD_RANK_OLD = """    n, r = group_size(group), group_rank(group)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_c, recv_c = (r - s - 1) % n"""
WORLD_RANK_NEW = WORLD_RANK_OLD.replace("group_rank(group)", "torch.distributed.get_rank()")
TREE = """                isend(flat, (vr + mask + src) % n, group, name="broadcast", round=k).wait()
            elif mask <= vr < 2 * mask:
                recv(flat, (vr - mask + src) % n, group, name="broadcast", round=k)"""
STAR = """                pass
        if vr == 0:
            for d in range(1, n):
                isend(flat, (d + src) % n, group, name="broadcast").wait()
        else:
            recv(flat, src, group, name="broadcast")"""
CHAIN = """            if vr > 0:
                irecv(piece, left, group, name="broadcast", piece=i).wait()
            if vr < n - 1:
                sends.append(isend(piece, right, group, name="broadcast", piece=i))"""
STORE_AND_FORWARD = """            if vr > 0:
                irecv(piece, left, group, name="broadcast", piece=i).wait()
        for i, piece in enumerate(flat.tensor_split(min(pieces, max(flat.numel(), 1)))):
            if vr < n - 1:
                sends.append(isend(piece, right, group, name="broadcast", piece=i))"""
CHAIN_STAR = """            if vr > 0:
                irecv(piece, src, group, name="broadcast", piece=i).wait()
            if vr == 0:
                sends += [isend(piece, (src + d) % n, group, name="broadcast", piece=i) for d in range(1, n)]"""
DEEP_TREE = """        for k in range((n - 1).bit_length()):  # round k, mask = 2^k
            mask = 1 << k
            if vr < mask and vr + mask < n:
                isend(flat, (vr + mask + src) % n, group, name="broadcast", round=k).wait()
            elif mask <= vr < 2 * mask:
                recv(flat, (vr - mask + src) % n, group, name="broadcast", round=k)"""
ROOT_THEN_CHAIN = """        pw = [1 << k for k in range((n - 1).bit_length())]
        chain = [1] + [v for v in range(2, n) if v not in pw]
        if vr == 0:
            for d in pw:
                isend(flat, (d + src) % n, group, name="broadcast").wait()
        elif vr in pw:
            recv(flat, src, group, name="broadcast")
        else:
            recv(flat, (chain[chain.index(vr) - 1] + src) % n, group, name="broadcast")
        if vr in chain and chain.index(vr) + 1 < len(chain):
            isend(flat, (chain[chain.index(vr) + 1] + src) % n, group, name="broadcast").wait()"""
CHECK_FIRST = """    if algorithm not in ("tree", "ring"):  # before anything else: a group of one rank too
        raise ValueError(f"algorithm must be 'tree' or 'ring', got {algorithm!r}")
    n, r = group_size(group), group_rank(group)
    if n == 1:
        return tensor"""
CHECK_AFTER_ONE = """    n, r = group_size(group), group_rank(group)
    if n == 1:
        return tensor
    if algorithm not in ("tree", "ring"):
        raise ValueError(f"algorithm must be 'tree' or 'ring', got {algorithm!r}")"""
NOT_IN_PLACE = [("flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)",
                 "flat = tensor.reshape(-1).clone()"),
                ("""    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor""", "    return flat.view_as(tensor)")]
RS_EXCHANGE = """        buf = torch.empty_like(chunks[recv_c])
        exchange(chunks[send_c], right, buf, left, group, name=name, step=s, phase="reduce-scatter")"""
RS_WHOLE = """        whole = torch.cat(chunks)
        got = torch.empty_like(whole)
        exchange(whole, right, got, left, group, name=name, step=s, phase="reduce-scatter")
        buf = got.split([c.numel() for c in chunks])[recv_c]"""
AG_EXCHANGE = """exchange(chunks[send_c], right, buf, left, group, name=name, step=s, phase="all-gather")"""
AG_DIRECT = """exchange(chunks[r], (r + s + 1) % n, buf, (r - s - 1) % n, group, name=name, step=s, phase="all-gather")"""

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
    "the world's size on a group": ("test_group_ranks",
                                    [("flat /= n", "flat /= torch.distributed.get_world_size()")],
                                    r"divides by n = 3"),
    "the world rank as the group rank": ("test_group_ranks",
                                         [(WORLD_RANK_OLD, WORLD_RANK_NEW)],
                                         r"(?s)group ranks 0, 1, 2.*receives from group rank 0: itself.*"
                                         r"group ranks, numbered within the group"),
    "a flat star for a tree": ("test_broadcast_tree", [(TREE, STAR)],
                               r"messages src \(rank 1\) sent \(⌈log2 8⌉ = 3; sent to ranks \[2, 3, 4, 5, 6, 7, 0\]\)"),
    "a chain that stores before it forwards": ("test_broadcast_chain", [(CHAIN, STORE_AND_FORWARD)],
                                               r"its first piece was sent on only after its last piece had arrived"),
    "a chain from src to every rank": ("test_broadcast_chain", [(CHAIN, CHAIN_STAR)],
                                       r"rank \d: messages received, as \(from rank, elements\)"),
    "a ring half sending the whole buffer": ("test_one_chunk_per_step", [(RS_EXCHANGE, RS_WHOLE)],
                                             r"ring_reduce_scatter on 4 ranks, 4096 elements: elements in each "
                                             r"rank's largest message: rank 0: expected 1024, got 4096"),
    "the whole buffer, counted in bytes": ("test_bytes_match_cost_model", [(RS_EXCHANGE, RS_WHOLE)],
                                           r"bytes sent by each rank"),
    "an all-gather straight to every rank": ("test_ring_neighbours", [(AG_EXCHANGE, AG_DIRECT)],
                                             r"ring_all_gather on 4 ranks, rank 0: the ranks it sent to"),
    "input changed": ("test_pieces_on_the_world",
                      [("chunks = [c.clone() for c in tensor.reshape(-1).tensor_split(n)]",
                        "chunks = list(tensor.reshape(-1).tensor_split(n))")],
                      r"the input tensor is left unchanged"),
    "sizes ignored": ("test_pieces_on_the_world",
                      [("if len(sizes) != n or sizes[r] != chunk.numel():", "if len(sizes) != n:")],
                      r"sizes that do not match this rank's chunk are a ValueError"),
    "src ignored": ("test_pieces_on_the_world",
                    [("flat, vr = tensor.view(-1), (r - src) % n", "src = 0; flat, vr = tensor.view(-1), r")],
                    r"from any src"),
    "an unknown algorithm accepted": ("test_pieces_on_the_world",
                                      [("raise ValueError(f\"algorithm must be 'tree' or 'ring', got {algorithm!r}\")",
                                        "pass")],
                                      r"any other algorithm is a ValueError"),
    "a root that sends log2 n messages, the rest a chain": ("test_broadcast_tree", [(DEEP_TREE, ROOT_THEN_CHAIN)],
                                                             r"on 8 ranks: a rank is 5 messages away from src"),
    "a chain of empty pieces": ("test_pieces_on_the_world",
                                [("flat.tensor_split(min(pieces, max(flat.numel(), 1)))", "flat.tensor_split(pieces)")],
                                r"as many pieces as it has elements, if fewer"),
    "the algorithm checked after one rank's early return": ("test_pieces_on_the_world",
                                                            [(CHECK_FIRST, CHECK_AFTER_ONE)],
                                                            r"on a group of one rank"),
    "a reduce-scatter average not divided": ("test_pieces_on_the_world",
                                             [('return chunks[r] / n if op == "avg" else chunks[r]',
                                               "return chunks[r]")], r"chunk r of the average"),
    "a result not in place": ("test_in_place_and_returned", NOT_IN_PLACE, r"in place, and returns that same tensor"),
}
# the one clause each failure names (grade prints its line): the check that failed, not every
# clause its test observes
NAMED = {"avg not divided": "ex01.*.avg", "remainder dropped": "ex01.*.uneven", "a copy returned": "ex01.*.in_place",
         "the world's size on a group": "ex01.*.avg", "the world rank as the group rank": "ex01.*.group",
         "input changed": "ex01.*.input_kept", "sizes ignored": "ex01.*.size_check", "src ignored": "ex01.*.src",
         "an unknown algorithm accepted": "ex01.*.algorithm", "a chain of empty pieces": "ex01.*.chain",
         "the algorithm checked after one rank's early return": "ex01.*.algorithm",
         "a reduce-scatter average not divided": "ex01.*.avg", "a result not in place": "ex01.*.in_place",
         "a root that sends log2 n messages, the rest a chain": "ex01.*.tree"}


@pytest.mark.parametrize("case", CASES)
def test_planted_answer_fails_its_clause(case, tmp_path):
    test, edits, match = CASES[case]
    from minipar.course.failure_clauses import named
    from minipar.course.grading import observed
    clauses = [k for k, v in observed(ex01).items() if test in v]
    assert clauses, f"{test} observes no clause of the contract"
    with planted("ex01", tmp_path, *edits):
        message = fails(getattr(ex01, test), match=match)
    if case in NAMED:
        assert named(message, getattr(ex01, test).__observes__) == [NAMED[case]], message


def test_a_result_not_in_place_fails_only_its_clause(tmp_path):
    """A correct sum that is returned, not left in the given tensor: the sums are read where the
    contract says the result is (the returned tensor), so only the in-place test fails."""
    with planted("ex01", tmp_path, *NOT_IN_PLACE):
        for test in ("test_sum_two_ranks", "test_bytes_match_cost_model"):
            getattr(ex01, test)("exercise")


def test_a_hang_names_an_unwaited_send():
    from minipar.runtime.launch import LaunchTimeout
    assert "never waited on" in str(LaunchTimeout(30, [1], 4))


def test_every_clause_is_in_the_contract_and_tested():
    from minipar.course.grading import observed
    from minipar.course.markers import clauses
    planted_tests = {t for t, _, _ in CASES.values()}
    for clause, tests in observed(ex01).items():
        assert clause in clauses("ex01"), clause
        assert planted_tests & set(tests), clause
