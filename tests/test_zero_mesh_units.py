"""The mesh's composition, beyond training equal to one process: ZeRO-3's unit order that
prefetching and the reduce-scatters follow, HSDP's blocks when context parallelism shares the
data-parallel ranks, and recomputation reaching the blocks. Each can go wrong while the losses
stay right, so each is observed directly: the last step's trace events (rank 0), the memory each
rank holds against :mod:`minipar.cost`'s formulas, the bytes saved for backward. fp32 on the CPU, SGD with momentum (K = 4), rtol 1e-4, atol 1e-5 as in
``test_zero_mesh.py``."""
from functools import partial

import torch

from minipar import cost, hybrid
from minipar.data import batches, synthetic_tokens
from minipar.models.gpt import GPT, GPTConfig
from minipar.reference import assert_same_training, train_reference

RTOL, ATOL = 1e-4, 1e-5
MOMENTUM = partial(torch.optim.SGD, lr=0.2, momentum=0.9)
DEEP = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16)
DATA = batches(synthetic_tokens(), 3, 8, 16)


def _run(world, **options):
    return hybrid.run(GPT(DEEP, seed=0), DATA, world, optimizer=MOMENTUM, **options)


def _comm(measured, name, phase=None):
    return [e for e in measured["events"] if e["kind"] == "comm" and e["name"] == name
            and (phase is None or e["labels"].get("phase") == phase)]


def test_every_unit_is_in_the_order_so_backward_prefetches_each_and_reduces_last_first():
    """dp2 ZeRO-3 on the mesh (reshard after forward): every forward starts the unit order afresh
    before the first unit's own hook, so the order holds every unit; the backward then prefetches
    every unit but the last one it reaches (units n-2 ... 0, each once) and reduce-scatters in
    reverse forward order, unit n-1 first and unit 0 last, one call each."""
    got = _run(2, dp=2, zero=3, reshard_after_forward="always")
    assert_same_training(got, train_reference(GPT(DEEP, seed=0), DATA, MOMENTUM), rtol=RTOL, atol=ATOL)
    m = got.measured[0]
    n = len(m["unit_sizes"])
    prefetched = [e["labels"]["unit"] for e in _comm(m, "all_gather", "backward") if e["labels"].get("prefetch")]
    assert sorted(prefetched) == list(range(n - 1)), f"backward prefetches of units {prefetched}, want 0..{n - 2}"
    reduced = [e["labels"]["unit"] for e in _comm(m, "reduce_scatter")]
    assert reduced == list(reversed(range(n))), f"reduce-scatters of units {reduced}"


def test_hsdp_blocks_take_in_the_context_parallel_partners():
    """dp2·cp2, ZeRO-3 with dp_shard=1 (4 ranks): a shard block is dp_shard·cp = 2 ranks (the cp
    partners hold the same parameters, so they shard them too) and the 2 blocks all-reduce their
    shards. Trains as one process; each rank holds stage 3's bytes for N = 2 (not a whole
    replica, as blocks of dp_shard ranks alone would give) and sends the formula's bytes."""
    got = _run(4, dp=2, cp=2, zero=3, dp_shard=1)
    assert_same_training(got, train_reference(GPT(DEEP, seed=0), DATA, MOMENTUM), rtol=RTOL, atol=ATOL)
    for m in got.measured:
        units = m["unit_sizes"]
        assert m["memory"]["total"] == cost.zero_bytes_per_rank(units, 2, 3, k=4, dtype_bytes=4)["total"], \
            (m["memory"], cost.zero_bytes_per_rank(units, 2, 3, k=4, dtype_bytes=4))
        want = cost.hsdp_comm_bytes(units, 2, 2)
        got_bytes = {d: m["bytes_by_dim"].get(d, 0) for d in want}
        assert got_bytes == want, (got_bytes, want)


def _saved_bytes(mode, **mesh):
    from minipar.activations import SavedActivations
    with SavedActivations() as saved:
        hybrid.train(GPT(DEEP, seed=0), DATA[:1], optimizer=MOMENTUM, recompute=mode, **mesh)
    return saved.bytes


def test_the_composition_applies_recomputation_on_every_layout():
    """``recompute=`` reaches the blocks whatever the layout (dp2 with ZeRO-3, tp2): one step saves
    fewer bytes for backward with "selective" than with "none", and fewer again with "full"
    (only each block's input), counted by :class:`minipar.activations.SavedActivations`."""
    import minipar
    for mesh in (dict(dp=2, zero=3), dict(tp=2)):
        got = {mode: minipar.launch(_saved_bytes, 2, args=(mode,), kwargs=mesh)[0]
               for mode in ("none", "selective", "full")}
        assert got["full"] < got["selective"] < got["none"], (mesh, got)
