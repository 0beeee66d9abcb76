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
from minipar.course.grading import diagnose, expect, expect_close, expect_equal, expect_same_training
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
    """merge_partials of attention on keys 0..9 and 10..15 equals attention on all 16 keys."""
    q, k, v, _ = _qkv()
    o, lse = cpm.attention_block(q, k, v)
    a = cpm.attention_block(q, k[..., :10, :], v[..., :10, :])
    b = cpm.attention_block(q, k[..., 10:, :], v[..., 10:, :])
    o_m, lse_m = cpm.merge_partials(*a, *b)
    expect_close(lse_m, lse, "merged lse (attention on all 16 keys), index (batch, head, query)",
                 where="keys 0..9 merged with 10..15", rtol=1e-5, atol=1e-5)
    expect_close(o_m, o, "merged o (attention on all 16 keys), index (batch, head, query, feature)",
                 where="keys 0..9 merged with 10..15", rtol=1e-5, atol=1e-5)


def test_merge_many_blocks_any_order(impl):
    """Merging four blocks one at a time, in either order, gives attention on all of them."""
    q, k, v, _ = _qkv()
    o, lse = cpm.attention_block(q, k, v)
    parts = [cpm.attention_block(q, k[..., i:i + 4, :], v[..., i:i + 4, :]) for i in range(0, 16, 4)]
    for name, order in (("first to last", parts), ("last to first", parts[::-1])):
        acc = order[0]
        for p in order[1:]:
            acc = cpm.merge_partials(*acc, *p)
        expect_close(acc[1], lse, "lse of four blocks of 4 keys merged one at a time", where=name, rtol=1e-5, atol=1e-5)
        expect_close(acc[0], o, "o of four blocks of 4 keys merged one at a time", where=name, rtol=1e-5, atol=1e-5)


def test_merge_is_stable_for_large_scores(impl):
    """Log-sum-exps near 1000 (exp would overflow) still merge to finite, correct values."""
    o_a, o_b = torch.ones(3, 2), torch.full((3, 2), 3.0)
    lse_a, lse_b = torch.tensor([1000.0, 1000.0, 5.0]), torch.tensor([1000.0, 999.0, 1000.0])
    o, lse = cpm.merge_partials(o_a, lse_a, o_b, lse_b)
    w = torch.sigmoid(lse_a - lse_b)                      # weight of block a
    with diagnose(lambda e: not bool(torch.isfinite(lse).all() and torch.isfinite(o).all()),
                  "exp(1000) overflows in fp32: subtract the larger lse before exp"):
        expect_close(lse, torch.logaddexp(lse_a, lse_b), "merged lse for lse_a = [1000, 1000, 5], "
                     "lse_b = [1000, 999, 1000]", where="large scores")
        expect_close(o[:, 0], w * 1 + (1 - w) * 3, "merged o (o_a = 1, o_b = 3), per query", where="large scores")


def test_zigzag_chunks(impl):
    """Rank r holds chunks r and 2·cp-1-r; together the ranks hold each of the 2·cp chunks once."""
    expect_equal(tuple(cpm.zigzag_chunks(0, 1)), (0, 1), "rank 0's chunks for cp = 1 (zigzag_chunks(0, 1))",
                 keys="entry")
    expect_equal(tuple(cpm.zigzag_chunks(1, 4)), (1, 6), "rank 1's chunks for cp = 4 (zigzag_chunks(1, 4))",
                 keys="entry")
    for cp in (2, 3, 4):
        got = {r: tuple(cpm.zigzag_chunks(r, cp)) for r in range(cp)}
        expect_equal(sorted(c for pair in got.values() for c in pair), list(range(2 * cp)),
                     f"cp = {cp}: the chunks all ranks hold together (each of the {2 * cp} once); per rank: {got}")
        expect_equal(got, {r: (r, 2 * cp - 1 - r) for r in range(cp)}, f"zigzag chunks, cp = {cp}", keys="rank")


def test_zigzag_rank_off_the_group(impl):
    """A rank outside 0 .. cp-1 is a ValueError."""
    for bad in (4, -1):
        try:
            got = cpm.zigzag_chunks(bad, 4)
        except ValueError:
            continue
        expect(False, f"zigzag_chunks({bad}, cp=4) returned {got}; rank {bad} is off the group: a ValueError")


def test_zigzag_shards_balance_the_causal_work(impl):
    """With your chunks, shard_sequence and unshard_sequence round-trip and every rank's tokens
    have the same total position (the causal work each rank's queries do)."""
    x = torch.arange(16).view(1, 16)
    shards = [cpm.shard_sequence(x, r, 4, "zigzag") for r in range(4)]
    expect_equal({r: sh.tolist()[0] for r, sh in enumerate(shards)},
                 {r: [2 * r, 2 * r + 1, 14 - 2 * r, 15 - 2 * r] for r in range(4)},
                 "positions each rank holds (16 tokens, cp = 4, zigzag)", keys="rank")
    expect_close(cpm.unshard_sequence(shards, "zigzag"), x, "unshard_sequence(shard_sequence(x)) (x = 0..15)",
                 rtol=0, atol=0)
    expect_equal([int(sh.sum()) for sh in shards], [int(shards[0].sum())] * 4,
                 "the sum of the positions each rank holds (its causal work)", keys="rank")


def _ring(layout):
    c, r = comm.group_size(), comm.group_rank()
    q, k, v, w = _qkv(T=16)
    ql, kl, vl = (cpm.shard_sequence(t, r, c, layout, dim=2).requires_grad_() for t in (q, k, v))
    o, lse = cpm.ring_attention(ql, kl, vl, None, True, layout)
    (o * cpm.shard_sequence(w, r, c, layout, dim=2)).sum().backward()
    return [o.detach(), lse, ql.grad, kl.grad, vl.grad]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_with_your_code(impl, cp):
    """The library's ring attention (zigzag, causal) equals full attention: O, lse, dQ, dK, dV."""
    q, k, v, w = (t.clone() for t in _qkv(T=16))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = cpm.masked_attention(q, k, v, causal=True)
    (o * w).sum().backward()
    want = [o.detach(), lse.detach(), q.grad, k.grad, v.grad]
    results = minipar.launch(_ring, cp, args=("zigzag",), timeout=TIMEOUT)
    T = 16
    for i, name in enumerate(("O", "lse", "dQ", "dK", "dV")):
        for r, res in enumerate(results):
            c0, c1 = r, 2 * cp - 1 - r                    # zigzag, written out independently
            parts = want[i].chunk(2 * cp, dim=2)
            mine = torch.cat([parts[c0], parts[c1]], dim=2)
            expect_close(res[i], mine, f"{name}, index (batch, head, position within the rank's shard, ...)",
                         where=f"cp = {cp}, rank {r} (sequence chunks {c0} and {c1} of {2 * cp}, "
                               f"{T // (2 * cp)} positions each)", rtol=1e-5, atol=1e-5)


def test_training_with_your_code(impl):
    """The GPT trained with ring attention on 2 ranks (zigzag) matches one process."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    batches = data.batches(data.synthetic_tokens(2000, 32), 2, 2, 16)
    want = reference.train_reference(GPT(cfg, seed=0), batches, reference.sgd(0.1))
    got = cpm.run(GPT(cfg, seed=0), batches, 2, optimizer=reference.sgd(0.1), variant="ring",
                  layout="zigzag", timeout=TIMEOUT)
    expect_same_training(got, want, "the GPT with ring attention on 2 ranks", rtol=1e-5, atol=1e-6)


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
    from minipar.course.grading import expect_close
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
