"""Challenge 09: a routing policy that balances the experts without dropping tokens.

Plain top-k routing follows the router: on the course's text, whose characters are far from
uniform (a space is one token in six), the busiest of 8 experts gets 1.7 × its share. A
capacity cuts the excess but drops what it cuts: at 1.3 × the mean, 5.4% of the assignments.

Write ``route(logits, top_k)``: from the router logits ``(S, E)`` of S tokens over E experts,
the experts each token is sent to, an int64 tensor ``(S, top_k)`` of distinct experts per
token, ``-1`` where an assignment is dropped. ``course_logits(S, E, offset)`` below gives the
logits the grader uses: a freshly initialised router on the course GPT's normalised token
embeddings of the course's text. The graded tests measure, on (S, E, top_k) = (4096, 8, 2)
from the text's start and (4096, 4, 1) from its 1605th token:

* **balance**: the busiest expert's assignments at most **1.3 ×** the mean, k·S/E;
* **drops**: under **5%** of the k·S assignments dropped;
* **fidelity**: the router probability of the chosen experts, summed over the tokens, at
  least **0.95 ×** that of plain top-k (sending tokens anywhere balances, but ignores the
  router: a uniform random choice keeps about 0.5 × here).

Grade it with ``python -m minipar.grade ch09`` (this challenge alone; ``grade ex09`` grades the core
exercise, then this challenge). Stuck? ``minipar.hint("ch09")``.
"""
import torch
import torch.nn.functional as F


def course_logits(S: int = 4096, E: int = 8, offset: int = 0) -> torch.Tensor:
    """Router logits (S, E) of the course's text from ``offset``: unit-variance router on the
    layer-normalised token embeddings of the course GPT (seed 0)."""
    from minipar import data
    from minipar.models import GPT, GPTConfig
    toks, tok = data.corpus_tokens()
    gpt = GPT(GPTConfig(vocab_size=tok.vocab_size, n_embd=32, n_layer=1, n_head=2, block_size=64), seed=0)
    w = torch.randn(E, 32, generator=torch.Generator().manual_seed(E)) / 32 ** 0.5
    with torch.no_grad():
        return F.layer_norm(gpt.embed.wte(toks[offset:offset + S]), (32,)) @ w.T


def route(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """(S, top_k) int64: each token's experts, -1 for a dropped assignment."""
    raise NotImplementedError("Challenge 09: route")
