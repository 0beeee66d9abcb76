"""ex12's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""

from minipar.course.graded import test_ex12_adaptive as g
from tests.planted import contract_tests

NO_LOCAL = ("            kept = mine >= 0 ", "            kept = mine < -1 ")
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex12.A.once": (
        [("            rest, at = need[~kept], pos[~kept]", "            rest, at = need, pos")],
        g.test_plan_by_hand, r"moves from 4 ranks holding all of \[0, 1, 2, 3\]"),
    "ex12.A.local": ([NO_LOCAL], g.test_plan_by_hand, r"moves from 4 ranks holding all"),
    "ex12.A.ring": (
        [("            for r in [(q + j) % world for j in range(1, world)]:",
          "            for r in [r for r in range(world) if r != q]:")],
        g.test_plan_by_hand, r"moves when ranks 0 and 3 hold"),
    "ex12.A.sorted": (
        [("    out.moves.sort(key=lambda mv: (mv.dst, mv.src))", "    pass")],
        g.test_plan_by_hand, r"moves for keys a \(4 elements\) and b"),
    "ex12.A.missing": (
        [('                raise ValueError(f"{key}: elements', '                raise ValueError(f"elements')],
        g.test_plan_errors, r"does not name the key w"),
    "ex12.A.world": (
        [("    if len(new) != world:", "    if False:")],
        g.test_plan_errors, r"from 2 old holdings to 3 new ones: what it raises"),
    "ex12.A.bytes": (
        [("            kept = mine >= 0 ", "            kept = (mine >= 0) & (where[(q + 1) % world, need] < 0) ")],
        g.test_plan_random, r"seed 0, 3 ranks: bytes each rank sends \(itemsize per key"),
    "ex12.B.values": (
        [("    for mv in (mv for ms in in_moves for mv in ms):\n",
          "    for mv in (mv for ms in reversed(in_moves) for mv in ms):\n")],
        g.test_execute_on_ranks, r"rank \d's [a-z_/]+ after the switch"),
    "ex12.B.bytes": (
        [("    in_sizes = [sum(mv.numel", "    in_sizes = [2 * sum(mv.numel"),
         ("    out_sizes = [sum(mv.numel", "    out_sizes = [2 * sum(mv.numel")],
        g.test_execute_on_ranks, r"bytes rank \d's all-to-all sent"),
    "ex12.B.fp32": (
        [("    if dtypes - {torch.float32}:", "    if False:")],
        g.test_execute_on_ranks, r"a switch of float64 state on rank \d"),
    "ex12.C.runs": (
        [("        ends = torch.cat([breaks, torch.tensor([len(i)])])",
          "        ends = torch.cat([breaks, torch.tensor([len(i) - 1])])")],
        g.test_runs, r"runs_of\(\[3, 4, 5, 9, 10, 0\]\)"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex12", g, PLANTS)
