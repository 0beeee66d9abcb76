"""Challenge 06, another way: split by search, not by hand.

Start from the library's default units (``model.layers()``); while some pair of consecutive
units is over the budget, replace the larger unit of the worst pair by its children that hold
parameters (their order of registration is their forward order in this GPT). It stops at the
coarsest units that meet the budget along the chain it explores."""
CONFIG = dict(vocab_size=512, block_size=16, n_layer=4, n_head=2, n_embd=32)
BUDGET = 88_000 // 4                                 # elements of fp32, gathered at once


def _size(m):
    return sum(p.numel() for p in m.parameters())


def units(model) -> list:
    out = list(model.layers())
    while True:
        pairs = [(_size(a) + _size(b), i) for i, (a, b) in enumerate(zip(out, out[1:]))]
        worst, i = max(pairs)
        if worst <= BUDGET:
            return out
        j = i if _size(out[i]) >= _size(out[i + 1]) else i + 1
        children = [c for c in out[j].children() if _size(c) > 0]
        if not children:
            raise ValueError(f"cannot split {type(out[j]).__name__} further")
        out[j:j + 1] = children
