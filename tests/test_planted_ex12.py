"""ex12's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""

from minipar.course.graded import test_ex12_adaptive as g
from tests.planted import contract_tests

NO_LOCAL = ("            kept = mine >= 0 ", "            kept = mine < -1 ")
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "every element of a new holding gets exactly one source": (
        [("            rest, at = need[~kept], pos[~kept]", "            rest, at = need, pos")],
        g.test_plan_by_hand, r"moves from 4 ranks holding all of \[0, 1, 2, 3\]"),
    "a local copy": ([NO_LOCAL], g.test_plan_by_hand, r"moves from 4 ranks holding all"),
    "else the first holder after it in ring order": (
        [("            for r in [(q + j) % world for j in range(1, world)]:",
          "            for r in [r for r in range(world) if r != q]:")],
        g.test_plan_by_hand, r"moves when ranks 0 and 3 hold"),
    "the moves come sorted by (dst, src)": (
        [("    out.moves.sort(key=lambda mv: (mv.dst, mv.src))", "    pass")],
        g.test_plan_by_hand, r"moves for keys a \(4 elements\) and b"),
    "an element held by no rank is a ``ValueError`` naming the key": (
        [('                raise ValueError(f"{key}: elements', '                raise ValueError(f"elements')],
        g.test_plan_errors, r"does not name the key w"),
    "old and new holdings of a different number of ranks are a": (
        [("    if len(new) != world:", "    if False:")],
        g.test_plan_errors, r"from 2 old holdings to 3 new ones: what it raises"),
    "each at its key's itemsize": (
        [("            kept = mine >= 0 ", "            kept = (mine >= 0) & (where[(q + 1) % world, need] < 0) ")],
        g.test_plan_random, r"seed 0, 3 ranks: bytes each rank sends \(itemsize per key"),
    "the values arrive bit for bit": (
        [("    for s, ms in enumerate(in_moves):\n        if s == me:",
          "    for s, ms in reversed(list(enumerate(in_moves))):\n        if s == me:")],
        g.test_execute_on_ranks, r"rank \d's [a-z_/]+ after the switch"),
    "the all-to-all's observed bytes equal the plan's": (
        [("torch.cat([tensors[mv.key][mv.src_pos] for mv in ms]) if",
          "torch.cat([tensors[mv.key][mv.src_pos] for mv in ms] * 2) if"),
         ("    out_sizes = [sum(mv.numel", "    out_sizes = [2 * sum(mv.numel")],
        g.test_execute_on_ranks, r"bytes rank \d's all-to-all sent"),
    "fp32 state only": (
        [("    if dtypes - {torch.float32}:", "    if False:")],
        g.test_execute_on_ranks, r"a switch of float64 state on rank \d"),
    "``from_runs(runs_of(i))`` gives back i, an empty index included": (
        [("        ends = torch.cat([breaks, torch.tensor([len(i)])])",
          "        ends = torch.cat([breaks, torch.tensor([len(i) - 1])])")],
        g.test_runs, r"runs_of\(\[3, 4, 5, 9, 10, 0\]\)"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex12", g, PLANTS)
