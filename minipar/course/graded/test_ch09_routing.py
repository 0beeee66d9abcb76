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
HINTS = {
    "": ("Plain top-k overloads a few experts; a capacity drops what it cuts. Which tokens lose "
         "least when they go to another expert than their first choice?",
         "Move only the tokens the router is undecided about: their second-best expert costs little "
         "router probability. Either shift a per-expert bias on the scores used for the choice (lower "
         "for a busy expert, higher for an idle one) until the loads even out, or give every expert a "
         "room slightly above k·S/E and let the confident tokens choose first.",
         "Bias: b = 0; repeat a few hundred times: experts = (softmax(logits) + b).topk(k).indices; "
         "load = bincount(experts, minlength=E); b -= step · (load - load.mean()) / load.mean(), with "
         "a shrinking step; keep the most balanced choice. Or rooms: cap = floor(1.25·k·S/E) per "
         "expert; visit the tokens by their top probability, most confident first, and give each its "
         "best experts that still have room."),
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
