"""Challenge 08: a balanced sequence layout for causal attention, for any length and any cp.

``layout(T, cp)`` returns the global positions each of the cp ranks holds. For (T, cp) in
(48, 3), (50, 3), (77, 5), (90, 6), (37, 5) and (200, 8) it must be a partition of 0 .. T-1
whose per-rank causal attention equals full attention, the ranks' token counts must differ
by at most 1, and the busiest rank's causal work (the sum of p + 1 over its positions: the
query-key pairs it scores) must be at most 1.03 × the mean. Contiguous shards are 1.6-1.9 ×
the mean there; the library's zigzag refuses lengths 2·cp does not divide, and zigzag on
unequal chunks misses both the token and the work goal. Grade it with
``python -m minipar.grade ch08``; ``minipar.hint("ch08")`` gives a nudge, then the idea, then
the method.
"""
import torch

from minipar import context_parallel as cpm
from minipar.course.grading import GradeFailure, expect_close, expect_equal, observes

CHALLENGE = "ch08_sequence_layout"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNoti8ENwjAQBFvZAhAtUAYSv42zii2sOxP7EqB6guAzjxnNrSxvLphYaUkdkxKjC0TKYjsYdsdYu'
        'al27GVk0KBnk/WyCW464/rV5tAjWH9Lx3A0lvWEPXPguIXkUWe8PP7FV2TaDI9x+QB0ejFg',
        'sealed:eNo9j7FyAzEIRH9luxTJeCZtuvxDfgDLnIVPJxTB+ex8vZGKVMzwlt3lJ0tdoQvEQQZLmS97kXrFT'
        'c82gMkfo+Edn9CK1LBRiiM2HOIZhERtkKxHoPoEB4fTyvYFzwx+NK4m93BRExetFkJ37tjU/AOmaIUSD/WGR'
        'fpYUr2gsE+HaRvNZlAE850rdHccmRxiIVz8hO+hot2ooNBz8ED8oDRfKxpPxZz1OtX1zfC7c5cwXJnbSJKOa'
        '9FzGPxXPb0AJeFnXg==',
        'sealed:eNpNjzFSwzAQRa/yO8LECYQSSE1J446hUCTZ1ljWKrsynskRIPeh5yg5CWuHgnK1+7/eO45UzBu/Y'
        '4/L+bO+s/ly/sIaK8YzagzkYPPtExpiZDRMA+rNDo6mhEK4r9CGD68rHUrnwSb1mELplil6IwUTcQ8hNIZhB'
        'kqt7kg8Dj7SNN8FxnHmqGCSg3FO+9bYzZ2hyDW/emHTmeFGELXBS9lkJutFQmo3JQz69Ri9krIvIyd4Y7uFR'
        'hOZJJRASZSCi3dbvPIjTqE9mRaU8PDzbTNsN6Zeqhkoqbhazd3R/4sv/rPYYZSgDFfdP/Xgoj5tfwHSR3fF',
    ),
}
CASES = [(48, 3), (50, 3), (77, 5), (90, 6), (37, 5), (200, 8)]
GOAL = 1.03


def _positions(challenge, T, cp):
    got = challenge.layout(T, cp)
    if len(got) != cp:
        raise GradeFailure(f"layout({T}, {cp}) returned {len(got)} lists, expected one per rank ({cp})")
    return [[int(p) for p in ranks] for ranks in got]


@observes('ch08.*.partition', 'ch08.*.exact')
def test_layout_is_a_partition(challenge):
    """Every position on exactly one rank, and each rank's causal attention equals full attention."""
    for T, cp in CASES:
        held = _positions(challenge, T, cp)
        flat = sorted(p for ranks in held for p in ranks)
        expect_equal(flat, list(range(T)), f"layout({T}, {cp}): the positions held, sorted", keys="index")
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, 2, T, 4, generator=g) for _ in range(3))
        o, lse = cpm.masked_attention(q, k, v, causal=True)
        for r, pos in enumerate(held):
            idx = torch.tensor(pos, dtype=torch.long)
            o_r, lse_r = cpm.masked_attention(q[..., idx, :], k, v, q_pos=idx, causal=True)
            expect_close(o_r, o[..., idx, :], "attention output", f"T={T}, cp={cp}, rank {r}", rtol=1e-5, atol=1e-6)


@observes('ch08.*.tokens')
def test_token_counts_balanced(challenge):
    """Each rank holds ⌊T/cp⌋ or ⌈T/cp⌉ tokens (its activation memory)."""
    for T, cp in CASES:
        counts = [len(p) for p in _positions(challenge, T, cp)]
        if max(counts) - min(counts) > 1:
            raise GradeFailure(f"layout({T}, {cp}): tokens per rank {counts}: they differ by "
                               f"{max(counts) - min(counts)}, the goal is at most 1 (memory per rank)")


@observes('ch08.*.work')
def test_causal_work_balanced(challenge):
    """The busiest rank's causal work is at most 1.03 × the mean, on every case."""
    lines, worst = [], 0.0
    for T, cp in CASES:
        work = [sum(p + 1 for p in ranks) for ranks in _positions(challenge, T, cp)]
        ratio = max(work) / (sum(work) / cp)
        worst = max(worst, ratio)
        lines.append(f"  T={T:>3}, cp={cp}: work per rank {work}, busiest / mean = {ratio:.3f}"
                     f"{'' if ratio <= GOAL else '  <- over the goal'}")
    if worst > GOAL:
        raise GradeFailure(f"causal work: the busiest rank does {worst:.3f} × the mean, the goal is at most "
                           f"{GOAL} × (the other ranks wait for it at every ring step)\n" + "\n".join(lines))
