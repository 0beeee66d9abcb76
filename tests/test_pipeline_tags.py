"""A pipeline's message tags: one per (kind, micro-batch, sending stage) within a step.

Two stages of an interleaved schedule on the same pair of ranks (stage 0 → 1 and stage 2 → 3
with p = 2, v = 2) send over the same link; the receiver tells their messages apart only by
tag. Tags that collide go unnoticed while the schedule happens to post both sides in the same
order, and deliver one micro-batch's activation as another's when it does not, so the rule is
observed directly: every send a rank posts in a step goes to a (peer, tag) no other send of
that step uses, and the same for receives."""
from collections import Counter

import torch.distributed as dist

import minipar
from minipar import data, reference
from minipar import pipeline as pp
from minipar.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=8, n_head=2, n_embd=16)


def _posted_tags(schedule, m, v):
    posted = {"send": [], "recv": []}
    real = {"send": dist.isend, "recv": dist.irecv}

    def spy(kind):
        def post(tensor, peer, group=None, tag=0):
            posted[kind].append((peer, tag))
            return real[kind](tensor, peer, group=group, tag=tag)
        return post
    dist.isend, dist.irecv = spy("send"), spy("recv")
    try:
        batches = data.batches(data.synthetic_tokens(2000), 1, 8, CFG.block_size)
        pp.train(GPT(CFG, seed=0), batches, reference.sgd(0.5), schedule=schedule, microbatches=m,
                 virtual_stages=v)
    finally:
        dist.isend, dist.irecv = real["send"], real["recv"]
    return posted


def test_no_two_messages_of_a_step_share_a_link_and_a_tag():
    """Interleaved (p = 2, v = 2, m = 4) and 1F1B (m = 4), one step: each (peer, tag) is used by
    one send and one receive at most, on each rank."""
    for schedule, v in (("interleaved", 2), ("1f1b", 1)):
        for r, posted in enumerate(minipar.launch(_posted_tags, 2, args=(schedule, 4, v))):
            for kind, uses in posted.items():
                assert uses, (schedule, r, kind)
                twice = {k: c for k, c in Counter(uses).items() if c > 1}
                assert not twice, f"{schedule}: rank {r} posted {kind}s sharing (peer, tag): {twice}"
