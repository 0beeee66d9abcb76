"""What each notebook's text states, checked on what its executed cells printed.

A notebook says, beside its figures, the numbers that carry its lesson: a loss difference from
one process, bytes recorded against the formula's, a bubble against ``(p-1)/m``. A claim is
one such line: a regular expression that must match the printed text of some code cell, and a
check of the numbers it captures. A claim whose line is no longer printed fails too, so a
rewritten cell cannot drop its number silently.

Tolerances are those of the runs the notebooks make: fp32 on CPU (or the learner's GPU), so an
equivalence is asserted to 1e-4 in the loss, formulas and recorded bytes exactly.
"""
from __future__ import annotations

import ast
import re

NUM = r"([-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?)"


def num(s: str) -> float:
    return float(s.replace(",", ""))


def small(limit):
    """Every captured number is at most ``limit`` in size."""
    return lambda m: all(abs(num(g)) <= limit for g in m.groups())


def equal(m) -> bool:
    """The captured numbers are all the same."""
    vals = [num(g) for g in m.groups()]
    return max(vals) == min(vals)


def same_list(m) -> bool:
    """Two captured Python literals are equal."""
    a, b = (ast.literal_eval(g) for g in m.groups())
    return a == b


def holds(m) -> bool:
    return True


def close_lists(rtol):
    def check(m):
        a, b = (ast.literal_eval(g) for g in m.groups())
        return len(a) == len(b) and all(abs(float(x) - float(y)) <= rtol * abs(float(y)) for x, y in zip(a, b))
    return check


def formula_is_measured(m) -> bool:
    """``{...} | formula: {...}``: the formula's entries equal the measured ones."""
    got, want = (ast.literal_eval(g) for g in m.groups())
    return all(got[k] == v for k, v in want.items())


def product(m) -> bool:
    """``a = b × c``."""
    a, b, c = (num(g) for g in m.groups())
    return a == b * c


# notebook number -> [(what the text says, pattern, check, least number of matching lines)]
CLAIMS = {
    "00": [("a collective gives every rank the sum of the ranks", r"\[6\.0, 6\.0, 6\.0, 6\.0\]", holds, 1),
           ("a failing rank is named with its error", r"rank 2 of 4 failed: ValueError", holds, 1),
           ("a hang is reported, naming the rank", r"rank\(s\) \[0\] of 2 still running", holds, 1)],
    "01": [("the token ring sums the ranks", r"rank 0 got back 6\.0 = 0 \+ 1 \+ 2 \+ 3", holds, 1),
           ("all-reduce leaves the sum on every rank",
            r"all_reduce: r0=\[60\.0, 64\.0, 68\.0, 72\.0\]  r1=\[60\.0, 64\.0, 68\.0, 72\.0\]", holds, 1),
           ("by hand, a reduce-scatter of the sum gives rank r its chunk r",
            r"chunks by rank: \[240\.0, 256\.0, 272\.0, 288\.0\]", holds, 1),
           ("after reduce-scatter step s every rank's fullest chunk holds s+2 ranks' data",
            r"ranks' data in each rank's fullest chunk: \[\(2, 3, 4\)\]", holds, 1),
           ("after all-gather step s every rank holds s+2 complete chunks",
            r"complete chunks on each rank: \[\(2, 3, 4\)\]", holds, 1),
           ("each rank of the ring sends 2(n-1)/n·N, measured",
            r"bytes sent per rank: measured \[(\d+), (\d+), (\d+), (\d+)\] B, 2\(n-1\)/n·N·4 = (\d+) B", equal, 1),
           ("the tree's root sends ⌈log2 n⌉ messages, all ranks reached in ⌈log2 n⌉ rounds",
            r"tree: the root sends (\d+) messages \(⌈log2 n⌉ = (\d+)\), the last rank has it after round (\d+);",
            equal, 3),
           ("both broadcasts send (n-1)·N in all", r"(\d+) B and (\d+) B in all = \(n-1\)·N·4 = (\d+) B", equal, 3)],
    "02": [("DDP's losses are one process's", r"largest loss difference over 20 steps: " + NUM, small(1e-4), 1),
           ("every reducer sends 2(n-1)/n·Ψ·4 bytes",
            r"theory 2\(n-1\)/n·Ψ·4 B = " + NUM + r" MiB[\s\S]*?naive: .*?, " + NUM +
            r" MiB sent[\s\S]*?bucketed: .*?, " + NUM + r" MiB sent[\s\S]*?overlapped: .*?, " + NUM + " MiB sent",
            equal, 1),
           ("accumulation sends the formula's bytes", r"same training; " + NUM + r" B sent per step = .*? = " + NUM + " B",
            equal, 1)],
    "03": [("the split model trains as one process", r"max \|loss difference\|: " + NUM, small(1e-5), 1),
           ("crossed messages, float64: the same losses",
            r"pipelined with crossed messages: (\[.*?\])\s+float64 losses, one process:\s+(\[.*?\])",
            close_lists(1e-12), 1)],
    "04": [("the bubble of naive and GPipe is (p-1)/m",
            r"naive\s+bubble \(idle / useful time\) = " + NUM + r"\s+GPipe m=4\s+bubble \(idle / useful time\) = "
            + NUM + r"\s+theory: \(p-1\)/m = " + NUM + " and " + NUM,
            lambda m: num(m[1]) == num(m[3]) and num(m[2]) == num(m[4]), 1),
           ("every schedule trains as one process", r"max \|loss - single process\| = " + NUM, small(1e-5), 4),
           ("the schedules are valid", r"all four schedules: valid and deadlock-free", holds, 1),
           ("a step let through round by round is one process's",
            r"round by round on 2 ranks: loss " + NUM + "; one process: " + NUM,
            lambda m: abs(num(m[1]) - num(m[2])) <= 1e-5, 1)],
    "05": [("the TP MLP computes the single-device MLP", r"max \|TP MLP - single-device MLP\| = " + NUM,
            small(1e-5), 1),
           ("the ranks' halves sum to one device's Z and ∂L/∂X",
            r"summed over the ranks: max \|Σ Z_r - Z\| " + NUM + r", max \|Σ ∂L/∂X_r - ∂L/∂X\| " + NUM, small(1e-5), 1),
           ("the TP MLP sends one all-reduce each way", r"sent " + NUM + r" B forward and " + NUM + r" B backward "
            r"\(one all-reduce of the activation: " + NUM + r" B\)", equal, 2),
           ("vocabulary-parallel loss is the gathered loss",
            r"loss: vocabulary-parallel " + NUM + ", gathered " + NUM,
            lambda m: abs(num(m[1]) - num(m[2])) <= 1e-5, 1),
           ("TP (and SP) train as one process", r"max \|Δ loss\| " + NUM + r", max \|Δ parameter\| " + NUM,
            small(1e-5), 4)],
    "06": [("all four stages train as one process", r"all four stages train exactly like one process", holds, 1),
           ("Adam's state is 3 × a rank's shard", r"optimizer " + NUM + " elements = " + r"3 × its " + NUM +
            "-element shard", lambda m: num(m[1]) == 3 * num(m[2]), 1),
           ("stage 3 holds a quarter of the model states on 4 ranks",
            r"stage 3 with minipar’s code: same training as one process; " + NUM
            + r" bytes of model states per rank instead of " + NUM,
            lambda m: 4 * num(m[1]) == num(m[2]), 1)],
    "07": [("3D is one process", r"3D \(2×2×2\) = one process", holds, 1),
           ("HSDP's bytes by group are the formula's", r"HSDP 2×2, bytes by group: (\{.*?\}) \| formula: (\{.*?\})",
            formula_is_measured, 1)],
    "08": [("each variant sends the formula's bytes", r"bytes sent per rank " + NUM + r" \(formula " + NUM + r"\)",
            equal, 6),
           ("each variant computes attention on all keys", r"max \|Δ\| over O, lse, dQ, dK, dV = " + NUM,
            small(1e-5), 6),
           ("CP trains as one process", r"same losses and weights \(max \|Δ\| = " + NUM + r"\)", small(1e-5), 3)],
    "09": [("the MoE parameter formula counts the layer", r"counted: " + NUM + r"\s+formula: " + NUM, equal, 1),
           ("dispatch bytes are the routed formula's", r"recorded\s+" + NUM + r" B\s+routed formula\s+" + NUM + " B",
            equal, 4),
           ("EP's layer output is one device's", r"largest output difference against one device: " + NUM,
            small(1e-6), 1),
           ("DP × EP trains as one process", r"largest parameter difference " + NUM, small(1e-5), 1)],
    "10": [("the planner's memory is the measured memory", r"memory predicted exactly for all 10 strategies: True",
            holds, 1),
           ("activations held at the peak are the formula's", r"held at the peak, measured (\[.*?\]); the formula (\[.*?\])",
            same_list, 2),
           ("the fit to Table 1 is within 10%", r"Table 1 errors .*?; max " + NUM + "%", small(10), 1)],
    "11": [("torchrun trains as the launcher does", r"same 8 losses as under minipar.runtime.launch: True", holds, 1),
           ("a checkpoint is the weights before the update", r"is the weights before the update: True", holds, 1),
           ("a corrupt rank file is named", r"CheckpointError: rank_00001\.pt: corrupt", holds, 1)],
    "12": [("a switch moves the bytes its plan counts", r"\d+\s+\S+\s+\S+\s+" + NUM + r"\s+" + NUM + r"\s+\d+\n",
            equal, 2),
           ("the command's losses across switches are one process's",
            r"worst relative difference from one process: " + NUM, small(1e-4), 1),
           ("a grow keeps the processes that started (the pid started, reported at the start, at the end)",
            r"\((\d+), (\d+), (\d+)\)", lambda m: m[1] == m[2] == m[3], 4)],
}


def printed(nb) -> list[str]:
    """The text each code cell printed (streams and plain-text results), one string per cell."""
    out = []
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        text = ""
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream":
                text += o.get("text", "")
            elif "text/plain" in o.get("data", {}):
                text += o["data"]["text/plain"] + "\n"
        out.append(text)
    return out


def problems(number: str, nb) -> list[str]:
    """Each claim of notebook ``number`` that its executed copy ``nb`` does not bear out."""
    cells, out = printed(nb), []
    for what, pattern, check, least in CLAIMS.get(number, []):
        found = [m for text in cells for m in re.finditer(pattern, text)]
        if len(found) < least:
            out.append(f"{what}: {len(found)} printed line(s) match /{pattern[:60]}/, expected at least {least}")
        bad = [m[0].strip()[:120] for m in found if not check(m)]
        if bad:
            out.append(f"{what}: not borne out by {bad[0]!r}")
    return out
