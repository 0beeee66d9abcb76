"""Challenge 06: choose ZeRO-3's units: a small gathered peak with few gathers.

Stage 3 gathers one *unit* (a module whose forward the model calls) at a time, and with
prefetch the next unit's gather starts while the current one computes. Coarse units cost
memory (the whole gathered unit, plus its prefetched neighbour, is alive at once); fine units
cost collectives (every unit is gathered once in forward and once more in backward, and each
collective pays its latency). The library's default, one unit per ``model.layers()`` entry, is
one point of that trade.

Write ``units(model)``: the list of modules to shard as units, in forward order, for the GPT
below (``GPT(GPTConfig(**CONFIG))``: a 512-token vocabulary, so the embedding and the output
layer are the largest pieces). Every parameter must belong to exactly one unit; any module
(``model.embed``, ``model.blocks[0]``, ``model.blocks[0].attn``, ``model.head.lm_head``, ...)
may be one. The graded tests train two steps on 2 ranks with
``minipar.zero.FullyShardedDataParallel(model, units=units(model))`` (prefetch on) and measure:

* **the same training** as one process (fp32 AdamW; rtol 1e-4, atol 5e-5);
* **peak gathered bytes** (``peak_gathered_bytes``, counted from the gathered buffers'
  storages): at most **88,000 bytes** (the default units reach 118,400);
* **all-gathers per step**, counted in the recorded trace: at most **28** (splitting every
  block into its four pieces reaches 67,584 bytes but needs 40).

Grade it with ``python -m minipar.grade ex06`` (the core exercise, then this challenge).
"""
CONFIG = dict(vocab_size=512, block_size=16, n_layer=4, n_head=2, n_embd=32)


def units(model) -> list:
    """The modules ZeRO-3 gathers one at a time, in forward order."""
    raise NotImplementedError("Challenge 06: units")
