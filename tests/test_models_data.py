"""Models, data and the single-process reference."""
import pytest
import torch

from minipar import data, reference
from minipar.models import GPT, LSTMLM, MLP, GPTConfig, lm_loss


def _params(m):
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def test_gpt_init_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = GPT(seed=1), GPT(seed=1), GPT(seed=2)
    assert torch.rand(1) == before  # building models drew nothing from the global generator
    pa, pb, pc = _params(a), _params(b), _params(c)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["blocks.0.attn.qkv.weight"], pc["blocks.0.attn.qkv.weight"])


def test_gpt_layers_compose_to_forward_and_loss():
    m = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=3, n_head=2, n_embd=16))
    x = torch.randint(0, 20, (4, 8))
    h = x
    for layer in m.layers():
        h = layer(h)
    assert h.shape == (4, 8, 20)
    torch.testing.assert_close(h, m(x))
    y = torch.randint(0, 20, (4, 8))
    torch.testing.assert_close(m(x, y), lm_loss(m(x), y))
    assert len(m.layers()) == 3 + 2


def test_gpt_tied_weights_are_one_parameter():
    m = GPT(vocab_size=30, tie_weights=True)
    assert m.head.lm_head.weight is m.embed.wte.weight
    names = [n for n, _ in m.named_parameters()]
    assert "head.lm_head.weight" not in names  # listed once, under the embedding


def test_gpt_is_causal():
    m = GPT(vocab_size=20, block_size=8)
    x = torch.randint(0, 20, (1, 8))
    x2 = x.clone()
    x2[0, 5:] = (x2[0, 5:] + 1) % 20
    torch.testing.assert_close(m(x)[:, :5], m(x2)[:, :5])


def test_bad_gpt_config():
    with pytest.raises(ValueError, match="divisible"):
        GPT(n_embd=30, n_head=4)


def test_mlp_and_lstm():
    (x, y), = data.regression_batches(1, 8)
    m = MLP((16, 32, 4))
    assert m(x).shape == (8, 4) and m(x, y).ndim == 0
    assert len(m.layers()) == 2
    lm = LSTMLM(vocab_size=20)
    idx = torch.randint(0, 20, (2, 10))
    assert lm(idx).shape == (2, 10, 20)


def test_corpus_and_tokenizer_roundtrip():
    toks, tok = data.corpus_tokens()
    assert len(toks) > 5000 and tok.vocab_size < 100
    assert tok.decode(toks[:50]) == data.corpus()[:50]


def test_batches_are_a_function_of_seed_and_step():
    toks = data.synthetic_tokens(3000, vocab_size=16)
    assert torch.equal(toks, data.synthetic_tokens(3000, vocab_size=16))
    b1 = data.batches(toks, 3, 4, 8, seed=5)
    b2 = data.batches(toks, 3, 4, 8, seed=5)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(b1, b2))
    x, y = b1[0]
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(b1[0][0], b1[1][0])


def test_shards_cover_the_global_batch():
    x = torch.arange(24).view(8, 3)
    assert torch.equal(torch.cat([data.shard(x, r, 4) for r in range(4)]), x)
    with pytest.raises(ValueError, match="not divisible"):
        data.shard(x, 0, 3)


def test_reference_training_learns_and_the_checker_catches_differences():
    toks, tok = data.corpus_tokens()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_embd=32)
    bs = data.batches(toks, 30, 8, 16)
    run = reference.train_reference(GPT(cfg), bs, reference.adamw(3e-3))
    assert run["losses"][-1] < run["losses"][0] - 0.5
    again = reference.train_reference(GPT(cfg), bs, reference.adamw(3e-3))
    reference.assert_same_training(again, run)  # bitwise deterministic
    bad = {"losses": list(run["losses"]), "params": dict(run["params"])}
    bad["params"]["head.ln_f.bias"] = bad["params"]["head.ln_f.bias"] + 1e-3
    with pytest.raises(AssertionError, match="head.ln_f.bias"):
        reference.assert_same_training(bad, run)
    bad = {"losses": run["losses"][:-1] + [run["losses"][-1] * 1.001], "params": run["params"]}
    with pytest.raises(AssertionError, match="losses"):
        reference.assert_same_training(bad, run)
