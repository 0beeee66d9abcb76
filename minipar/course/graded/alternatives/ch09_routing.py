"""Challenge 09, another way: a capacity that reroutes instead of dropping.

Give every expert a capacity of 1.25 × its share, k·S/E, and place the tokens in order of
the router's confidence (its top probability, most confident first): each takes its best
experts that still have room. A token the router is sure of gets its first choice; the
undecided ones, which lose least, overflow to their next-best expert. Nothing is dropped
while the total capacity (1.25 · k · S) exceeds the k · S assignments."""
import math

import torch


def route(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    probs = logits.float().softmax(-1)
    S, E = probs.shape
    cap = math.floor(1.25 * top_k * S / E)
    room = [cap] * E
    prefs = probs.argsort(-1, descending=True).tolist()
    out = torch.full((S, top_k), -1, dtype=torch.long)
    for s in probs.max(-1).values.argsort(descending=True).tolist():
        j = 0
        for e in prefs[s]:
            if room[e]:
                out[s, j], room[e], j = e, room[e] - 1, j + 1
                if j == top_k:
                    break
    return out
