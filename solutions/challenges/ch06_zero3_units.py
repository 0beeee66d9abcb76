"""Challenge 06, one way: reasoned by hand from the sizes.

With prefetch the peak is the largest pair of consecutive units. The pieces, in elements:
embedding 16,896 (wte 16,384 + wpe 512), a block 12,704 (ln1 64, attn 4,224, ln2 64,
mlp 8,352), the head 16,448 (ln_f 64, lm_head 16,384). Two whole blocks side by side
(25,408 elements, 101,632 bytes) or a block beside the embedding or the head are over the
88,000 bytes (22,000 elements) budget; a whole block beside a split one's MLP (21,056) fits.
So: the embedding whole, then blocks split and whole in turn, and the head in its two pieces:
13 units, 26 gathers, a peak of 21,056 elements."""
CONFIG = dict(vocab_size=512, block_size=16, n_layer=4, n_head=2, n_embd=32)


def units(model) -> list:
    out = [model.embed]
    for i, block in enumerate(model.blocks):
        out += [block.ln1, block.attn, block.ln2, block.mlp] if i % 2 == 0 else [block]
    return out + [model.head.ln_f, model.head.lm_head]
