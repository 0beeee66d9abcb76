"""Stage 3's prefetch overlaps the next unit's all-gather with this unit's compute.

Started before unit i computes, unit i+1's gather must not be waited for until unit i+1 is
used: a prefetch that waits at once gathers early but overlaps nothing. The trace shows which:
an asynchronous collective is recorded when it is waited for, so in the order of a rank's
events a prefetched gather of unit i+1 comes after unit i's forward (waited at i+1's use), and in
the backward a prefetched gather of unit i-1 after unit i's backward. Both designs, 2 ranks, one
step; nothing here depends on timing, only on the order of the events."""
import torch
import torch.distributed as dist

import minipar
from minipar import data
from minipar.models import GPT, GPTConfig
from minipar.runtime import trace
from minipar.zero import FullyShardedDataParallel, fully_shard

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16)


def _order():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for design in ("flat", "per-parameter"):
        model = GPT(CFG, seed=0)
        fwd = FullyShardedDataParallel(model) if design == "flat" else fully_shard(model)
        x, y = data.batches(data.synthetic_tokens(2000), 1, 4, CFG.block_size)[0]
        mark = trace.mark()
        fwd(data.shard(x, r, n), data.shard(y, r, n)).backward()
        out[design] = [(e["kind"], e["name"], e["labels"].get("phase"), e["labels"].get("unit"),
                        bool(e["labels"].get("prefetch"))) for e in trace.since(mark)]
    return out


def test_a_prefetched_gather_is_waited_for_at_its_units_use_not_when_started():
    for r, res in enumerate(minipar.launch(_order, 2)):
        for design, events in res.items():
            where = {(k, name, u): i for i, (k, name, _, u, _) in enumerate(events) if k == "compute"}
            prefetched = [(i, phase, u) for i, (k, name, phase, u, pre) in enumerate(events)
                          if k == "comm" and name == "all_gather" and pre]
            assert prefetched, (design, "no prefetched gather")
            for i, phase, u in prefetched:
                before = ("compute", "forward", u - 1) if phase == "forward" else ("compute", "backward", u + 1)
                assert i > where[before], (
                    f"{design}, rank {r}: unit {u}'s prefetched {phase} gather was waited for before "
                    f"unit {before[2]}'s {phase} ran")
