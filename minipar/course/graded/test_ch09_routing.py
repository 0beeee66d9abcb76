"""Challenge 09: a routing policy that balances the experts without dropping tokens.

``route(logits, top_k)`` returns each token's experts, (S, top_k) int64, distinct per token,
-1 for a dropped assignment. On the course's text (``course_logits``: (S, E, top_k) =
(4096, 8, 2) from the start, (4096, 4, 1) from token 1605) the busiest expert must get at
most 1.3 × the mean k·S/E assignments, under 5% of the assignments may be dropped, and the
router probability of the chosen experts must be at least 0.95 × plain top-k's. The library's
routing (``minipar.models.moe.route``, plain top-k, with or without its capacity) meets at
most two of the three. Grade it with ``python -m minipar.grade ch09``; ``minipar.hint("ch09")``
gives a nudge, then the idea, then the method.
"""
import torch
import torch.nn.functional as F

from minipar import data
from minipar.course.grading import GradeFailure, expect_equal, observes
from minipar.models import GPT, GPTConfig

CHALLENGE = "ch09_routing"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNotjMENwkAMBFvZBqABHrTAj7flOJyV0/lkG0K6x0J5jmY0j046kDYvG+wj3o2WAGGVHfKd4hm3Q'
        'qZJrHlgcZuBvVFCE/zOuOLZlFs9NhmBbiHoQpFVSa2bHHhZadCwIj+/Zeiv1bGqV8/NlOX+A25QNac=',
        'sealed:eNo9kMFSwzAMRH9ljzDTljv3HjnxBXasNJoaq2MphXwZd76MTWi4edbatyu92V1grS6ISRB2lebbs'
        '9sc0qGOuRUZtEhByhRf12/tcBmslWMWD8jXTXpgMA9H1Yj6D7h1yykrxeWEs9JL66RjIIGm48OaNTl7bNE+W'
        'BfmOiNH65s2TKaD4KnaJwGrmpBnXx7RB0x6mfafBi11XUue2T60bohqqTjkLg2sdgAnL8rtqfSdQ2o3+4BX4'
        'oJX4cocuf58v7+cCS6oEn+FrI08Sov9aGxoLhi1e5x+AYXNfXM=',
        'sealed:eNpNkDtuwzAQRK8ypYTIchIgTQQ3BlynyAlIaSUuRJEEuf6dzL1PlrXiACkHmJl9O3s25RMWO7x2y'
        'JTICAxGOsMdw5BpgPBCaqFLoixFjVWJoyzmUvk4sZQaL7B1KzHN1Vy3HAbuqXTw0Qzqthz6eAxSPQsaLBw8h'
        'Unc7lB3enqzQxFKuN9QraHNmm0XMqGqa2z/ywZnFqeIxWUOM4dpDXeYSSvEEZZYBNZ4E3ql711UnBZfGTnGR'
        'R/pTVKs0ceYq7f2/eN+m++37+2hhvI93+xw4sKy9kmcKRTY60NxVp2QcrTGsme5Nr8H+xhGHigIRs5FGpgwY'
        'OITgUzvoDvBkvr+ZhSnQxdh7+GMuh5w7Q8t7IpZ',
    ),
}
CASES = [(4096, 8, 2, 0), (4096, 4, 1, 1605)]
BALANCE, DROPS, FIDELITY = 1.3, 0.05, 0.95


def _logits(S, E, offset):
    """The same logits as the challenge file's course_logits (the grader keeps its own copy)."""
    toks, tok = data.corpus_tokens()
    gpt = GPT(GPTConfig(vocab_size=tok.vocab_size, n_embd=32, n_layer=1, n_head=2, block_size=64), seed=0)
    w = torch.randn(E, 32, generator=torch.Generator().manual_seed(E)) / 32 ** 0.5
    with torch.no_grad():
        return F.layer_norm(gpt.embed.wte(toks[offset:offset + S]), (32,)) @ w.T


def _measure(challenge):
    if "_measured" not in vars(challenge):             # once per loaded module
        out = []
        for S, E, k, offset in CASES:
            logits = _logits(S, E, offset)
            got = challenge.route(logits.clone(), k)
            got = torch.as_tensor(got, dtype=torch.long)
            expect_equal(list(got.shape), [S, k], f"route's output shape for S={S}, k={k}")
            if ((got < -1) | (got >= E)).any():
                raise GradeFailure(f"E={E}, k={k}: experts must be 0 .. {E - 1} or -1 (dropped)")
            for j in range(k):
                for i in range(j):
                    same = (got[:, i] == got[:, j]) & (got[:, i] >= 0)
                    if same.any():
                        s = int(same.nonzero()[0])
                        raise GradeFailure(f"E={E}, k={k}: token {s} is sent twice to expert {int(got[s, i])}")
            probs = logits.softmax(-1)
            kept = got[got >= 0]
            load = torch.bincount(kept, minlength=E)
            mass = (probs.gather(1, got.clamp(min=0)) * (got >= 0)).sum() / probs.topk(k, -1).values.sum()
            out.append({"case": f"S={S}, E={E}, k={k}", "load": load.tolist(), "busiest": load.max().item() / (k * S / E),
                        "dropped": (got < 0).float().mean().item(), "fidelity": mass.item()})
        challenge._measured = out
    return challenge._measured


def _check(challenge, key, ok, goal, meaning):
    res = _measure(challenge)
    bad = [r for r in res if not ok(r[key])]
    if bad:
        lines = "\n".join(f"  {r['case']}: {key} {r[key]:.3f} (assignments per expert {r['load']})" for r in res)
        raise GradeFailure(f"{key}: {bad[0][key]:.3f} on {bad[0]['case']}, the goal is {goal} ({meaning})\n{lines}")


@observes('ch09.*.busiest')
def test_busiest_expert(challenge):
    """The busiest expert gets at most 1.3 × the mean number of assignments."""
    _check(challenge, "busiest", lambda v: v <= BALANCE, f"at most {BALANCE} × the mean",
           "the other experts wait for the busiest one")


@observes('ch09.*.dropped')
def test_dropped_assignments(challenge):
    """Under 5% of the k·S assignments are dropped."""
    _check(challenge, "dropped", lambda v: v < DROPS, f"under {DROPS:.0%}", "a dropped token skips the layer")


@observes('ch09.*.fidelity')
def test_router_fidelity(challenge):
    """The chosen experts keep at least 0.95 × the router probability plain top-k keeps."""
    _check(challenge, "fidelity", lambda v: v >= FIDELITY, f"at least {FIDELITY} × top-k's",
           "the router's choice is what the model learns; sending tokens anywhere ignores it")
