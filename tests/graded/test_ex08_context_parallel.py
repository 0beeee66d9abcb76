"""Exercise 08: context parallelism, the two ideas ring attention stands on.

A. ``merge_partials(o_a, lse_a, o_b, lse_b)``: the online-softmax merge.
   ``(o_a, lse_a)`` is attention of some queries over one block of keys: ``o`` (..., T, d)
   the softmax-weighted values, ``lse`` (..., T) the log-sum-exp of each query's scores.
   ``(o_b, lse_b)`` is the same over another, disjoint block. Return ``(o, lse)``, attention
   of the same queries over both blocks together.
   Invariant: merging the blocks of a split key set, in any order, gives attention over the
   whole set (to fp32 rounding, rtol = atol = 1e-5), and stays finite and exact when the
   log-sum-exps are near 1000, where a plain ``exp`` overflows.
   Derived in notebook 08, "The online-softmax merge" (Milakov & Gimelshein 2018;
   FlashAttention, Dao et al. 2022, Algorithm 1; ring attention, Liu et al. 2023).

B. ``zigzag_chunks(rank, cp)``: the sequence is cut into 2·cp equal chunks, numbered in
   sequence order, and each rank of a cp group holds two of them. Return the two chunk
   numbers ``rank`` holds, the earlier one first.
   Invariant: together the ranks hold each chunk exactly once, and under a causal mask every
   rank's queries do the same attention work (the query-key pairs they score).
   A rank outside the group is a ``ValueError``.
   Derived in notebook 08, "The causal imbalance, and zigzag" (the Llama 3 report, Dubey et
   al. 2024, §3.3.2).

The last tests run the library's ring attention on 2 and 4 ranks and train the GPT with
context parallelism, your functions in place, and compare with one process. Stuck?
``minipar.hint("ex08", "A")`` gives a nudge, then the idea, then the formula. Grade it with
``python -m minipar.grade ex08``.
"""
import pytest
import torch

import minipar
from minipar import comm, data, reference
from minipar import context_parallel as cpm
from minipar.models import GPT, GPTConfig

EXERCISE = "ex08_context_parallel"
HINTS = {
    "A": ("Attention over both blocks has one normaliser per query: the sum of exp(score) over "
          "all keys. Express it, and each block's share of it, with lse_a and lse_b.",
          "exp(lse) = exp(lse_a) + exp(lse_b); each block's o is weighted by its share of that "
          "sum. Never call exp on a log-sum-exp itself: shift both by their maximum m first, so "
          "every exponential is at most 1.",
          "m = max(lse_a, lse_b); w_a = exp(lse_a - m); w_b = exp(lse_b - m); "
          "lse = m + log(w_a + w_b); o = (w_a·o_a + w_b·o_b) / (w_a + w_b), the weights broadcast "
          "over the last axis (unsqueeze(-1)). The same value as exp(lse_a - lse)·o_a + "
          "exp(lse_b - lse)·o_b, but the division by the sum of the shifted weights keeps the two "
          "weights summing to 1 in fp32."),
    "B": ("Under a causal mask a query at position i attends to i + 1 keys: early chunks are "
          "cheap, late chunks expensive. How can every rank get the same total?",
          "Pair a chunk from the front half of the sequence with one from the back half, so that "
          "a cheap chunk and an expensive one always travel together: the chunk numbers of each "
          "pair sum to the same value.",
          "Rank r holds chunk r and its mirror image 2·cp - 1 - r; check 0 <= rank < cp first."),
}
TIMEOUT = 30


def _qkv(T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, T, 4, generator=g) for _ in range(4)]


def test_merge_two_blocks(impl):
    """merge_partials of attention on keys 0..9 and 10..15 equals attention on all 16 keys.
    Hint: lse = m + log(exp(lse_a - m) + exp(lse_b - m)); o = exp(lse_a - lse)·o_a + exp(lse_b - lse)·o_b."""
    q, k, v, _ = _qkv()
    o, lse = cpm.attention_block(q, k, v)
    a = cpm.attention_block(q, k[..., :10, :], v[..., :10, :])
    b = cpm.attention_block(q, k[..., 10:, :], v[..., 10:, :])
    o_m, lse_m = cpm.merge_partials(*a, *b)
    torch.testing.assert_close(lse_m, lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_m, o, rtol=1e-5, atol=1e-5)


def test_merge_many_blocks_any_order(impl):
    """Merging four blocks one at a time, in either order, gives attention on all of them.
    Hint: the merge must not care which block comes first (it is symmetric in a and b)."""
    q, k, v, _ = _qkv()
    o, lse = cpm.attention_block(q, k, v)
    parts = [cpm.attention_block(q, k[..., i:i + 4, :], v[..., i:i + 4, :]) for i in range(0, 16, 4)]
    for order in (parts, parts[::-1]):
        acc = order[0]
        for p in order[1:]:
            acc = cpm.merge_partials(*acc, *p)
        torch.testing.assert_close(acc[1], lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(acc[0], o, rtol=1e-5, atol=1e-5)


def test_merge_is_stable_for_large_scores(impl):
    """Log-sum-exps near 1000 (exp would overflow) still merge to finite, correct values.
    Hint: subtract the running maximum m = max(lse_a, lse_b) before calling exp."""
    o_a, o_b = torch.ones(3, 2), torch.full((3, 2), 3.0)
    lse_a, lse_b = torch.tensor([1000.0, 1000.0, 5.0]), torch.tensor([1000.0, 999.0, 1000.0])
    o, lse = cpm.merge_partials(o_a, lse_a, o_b, lse_b)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    w = torch.sigmoid(lse_a - lse_b)                      # weight of block a
    torch.testing.assert_close(o[:, 0], w * 1 + (1 - w) * 3)
    torch.testing.assert_close(lse, torch.logaddexp(lse_a, lse_b))


def test_zigzag_chunks(impl):
    """Rank r holds chunks r and 2·cp-1-r; together the ranks hold each of the 2·cp chunks once.
    Hint: return (rank, 2 * cp - 1 - rank)."""
    assert tuple(cpm.zigzag_chunks(0, 1)) == (0, 1)
    assert tuple(cpm.zigzag_chunks(1, 4)) == (1, 6)
    for cp in (2, 3, 4):
        got = [tuple(cpm.zigzag_chunks(r, cp)) for r in range(cp)]
        assert got == [(r, 2 * cp - 1 - r) for r in range(cp)], got
        assert sorted(c for pair in got for c in pair) == list(range(2 * cp))


def test_zigzag_rank_off_the_group(impl):
    """A rank outside 0 .. cp-1 is a ValueError.
    Hint: check 0 <= rank < cp first."""
    for bad in (4, -1):
        with pytest.raises(ValueError):
            cpm.zigzag_chunks(bad, 4)


def test_zigzag_shards_balance_the_causal_work(impl):
    """With your chunks, shard_sequence and unshard_sequence round-trip and every rank's tokens
    have the same total position (the causal work each rank's queries do).
    Hint: shard_sequence(x, r, cp, "zigzag") concatenates the chunks zigzag_chunks(r, cp) names."""
    x = torch.arange(16).view(1, 16)
    shards = [cpm.shard_sequence(x, r, 4, "zigzag") for r in range(4)]
    assert torch.equal(cpm.unshard_sequence(shards, "zigzag"), x)
    assert len({int(s.sum()) for s in shards}) == 1
    assert shards[0].tolist() == [[0, 1, 14, 15]]


def _ring(layout):
    c, r = comm.group_size(), comm.group_rank()
    q, k, v, w = _qkv(T=16)
    ql, kl, vl = (cpm.shard_sequence(t, r, c, layout, dim=2).requires_grad_() for t in (q, k, v))
    o, lse = cpm.ring_attention(ql, kl, vl, None, True, layout)
    (o * cpm.shard_sequence(w, r, c, layout, dim=2)).sum().backward()
    return [o.detach(), lse, ql.grad, kl.grad, vl.grad]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_with_your_code(impl, cp):
    """The library's ring attention (zigzag, causal) equals full attention: O, lse, dQ, dK, dV.
    Hint: if only the zigzag cases fail, check B; if every case fails, check A first."""
    q, k, v, w = (t.clone() for t in _qkv(T=16))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = cpm.masked_attention(q, k, v, causal=True)
    (o * w).sum().backward()
    want = [o.detach(), lse.detach(), q.grad, k.grad, v.grad]
    results = minipar.launch(_ring, cp, args=("zigzag",), timeout=TIMEOUT)
    for i, name in enumerate(("O", "lse", "dQ", "dK", "dV")):
        got = cpm.unshard_sequence([res[i] for res in results], "zigzag", dim=2)
        torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_training_with_your_code(impl):
    """The GPT trained with ring attention on 2 ranks (zigzag) matches one process.
    Hint: the earlier tests isolate the merge and the chunks; make those pass first."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    batches = data.batches(data.synthetic_tokens(2000, 32), 2, 2, 16)
    want = reference.train_reference(GPT(cfg, seed=0), batches, reference.sgd(0.1))
    got = cpm.run(GPT(cfg, seed=0), batches, 2, optimizer=reference.sgd(0.1), variant="ring",
                  layout="zigzag", timeout=TIMEOUT)
    reference.assert_same_training(got, want, rtol=1e-5, atol=1e-6)


def _documented_merge(o_a, lse_a, o_b, lse_b):
    """The merge exactly as notebook 08 and the last tier of HINTS["A"] write it."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    lse = m + torch.log(w_a + w_b)
    o = (w_a.unsqueeze(-1) * o_a + w_b.unsqueeze(-1) * o_b) / (w_a + w_b).unsqueeze(-1)
    return o, lse


def test_documented_merge_formula_passes(impl):
    """The merge formula the notebook documents, coded literally, meets this file's tolerance
    (rtol = atol = 1e-5) on the test cases above, log-sum-exps near 1000 included, and your
    merge_partials agrees with it."""
    from minipar.grading import expect_close
    q, k, v, _ = _qkv()
    o, lse = cpm.attention_block(q, k, v)
    a = cpm.attention_block(q, k[..., :10, :], v[..., :10, :])
    b = cpm.attention_block(q, k[..., 10:, :], v[..., 10:, :])
    o_a, o_b = torch.ones(3, 2), torch.full((3, 2), 3.0)
    lse_a, lse_b = torch.tensor([1000.0, 1000.0, 5.0]), torch.tensor([1000.0, 999.0, 1000.0])
    w = torch.sigmoid(lse_a - lse_b)
    doc_big = _documented_merge(o_a, lse_a, o_b, lse_b)
    expect_close(doc_big[0][:, 0], w * 1 + (1 - w) * 3, "documented merge's O", "lse near 1000",
                 rtol=1e-5, atol=1e-5)
    doc = _documented_merge(*a, *b)
    expect_close(doc[0], o, "documented merge's O", "keys 0..9 and 10..15", rtol=1e-5, atol=1e-5)
    expect_close(doc[1], lse, "documented merge's lse", "keys 0..9 and 10..15", rtol=1e-5, atol=1e-5)
    got, got_big = cpm.merge_partials(*a, *b), cpm.merge_partials(o_a, lse_a, o_b, lse_b)
    for i, name in enumerate(("O", "lse")):
        expect_close(got[i], doc[i], f"merge_partials' {name}", "keys 0..9 and 10..15", rtol=1e-5, atol=1e-5)
        expect_close(got_big[i], doc_big[i], f"merge_partials' {name}", "lse near 1000", rtol=1e-5, atol=1e-5)
