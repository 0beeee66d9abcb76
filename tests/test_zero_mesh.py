"""ZeRO-2 and ZeRO-3 composed with pipeline and context parallelism on the mesh, and HSDP, against
one process.

Under a pipeline each step runs m micro-batches through a rank's stage. ZeRO-2 reduce-scatters
each micro-batch's gradients into the sharded gradient; ZeRO-3 follows ``reshard_after_forward``:
``"never"`` (the default with a pipeline) keeps the stage's units gathered across the micro-batches
and reduce-scatters the accumulated gradients once, ``"always"`` reshards after every use. Both
train as one process; the bytes and the memory per rank are those of
:func:`minipar.cost.zero3_pipeline_comm_bytes` and ``zero3_pipeline_peak_bytes``.
HSDP (``dp_shard``) shards within blocks and all-reduces the shards across them
(:func:`minipar.cost.hsdp_comm_bytes`). SGD with momentum (K = 4 bytes of state per parameter), rtol 1e-4, atol 1e-5 (AdamW magnifies
last-bit differences of reordered sums past atol 5e-5 on one element of the deeper model)."""
from collections import Counter
from functools import partial

import pytest
import torch

from minipar import hybrid
from minipar import cost
from minipar.data import batches, synthetic_tokens
from minipar.models.gpt import GPT, GPTConfig
from minipar.reference import assert_same_training, train_reference

RTOL, ATOL = 1e-4, 1e-5
MOMENTUM = partial(torch.optim.SGD, lr=0.2, momentum=0.9)
K = 4
DEEP = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16)
DENSE = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
DATA = batches(synthetic_tokens(), 3, 8, 16)
M = 2


def _run(config, world, **options):
    return hybrid.run(GPT(config, seed=0), DATA, world, optimizer=MOMENTUM, **options)


def _collectives(measured, name):
    """How many times rank 0's last step ran ``name`` on each unit, by phase."""
    return Counter((e["labels"].get("phase"), e["labels"].get("unit")) for e in measured["events"]
                   if e["kind"] == "comm" and e["name"] == name)


def test_zero2_and_zero3_under_a_pipeline():
    """dp2·pp2, m=2 (4 ranks, 3 stage units per rank): ZeRO-1, ZeRO-2 and ZeRO-3 with both policies
    train as one process; ZeRO-3 kept gathered all-gathers each unit once per step (2m = 4 times
    resharding), reduce-scatters once (m times resharding) and moves ZeRO-1's bytes; its peak
    memory is ZeRO-1's plus the parameter shards (above ZeRO-1, not below), resharding's stage 3's plus two
    gathered units and one unit's gradients (3 units a stage: above ZeRO-1 too), both measured as the formula."""
    want = train_reference(GPT(DEEP, seed=0), DATA, MOMENTUM)
    runs = {name: _run(DEEP, 4, dp=2, pp=2, microbatches=M, **o) for name, o in {
        "zero1": dict(zero=1), "zero2": dict(zero=2), "never": dict(zero=3),
        "always": dict(zero=3, reshard_after_forward="always")}.items()}
    for got in runs.values():
        assert_same_training(got, want, rtol=RTOL, atol=ATOL)
    z1, z2, never, always = (runs[k].measured[0] for k in ("zero1", "zero2", "never", "always"))
    units = never["unit_sizes"]
    assert len(units) == 3 and units == always["unit_sizes"] == z1["unit_sizes"]
    # all-gathers per unit: once in the first forward, kept; 2m resharding (m forward, m backward)
    assert _collectives(never, "all_gather") == {("forward", u): 1 for u in range(3)}
    assert _collectives(always, "all_gather") == {(ph, u): M for ph in ("forward", "backward") for u in range(3)}
    assert _collectives(never, "reduce_scatter") == {(None, u): 1 for u in range(3)}
    assert _collectives(always, "reduce_scatter") == {(None, u): M for u in range(3)}
    assert sum(_collectives(z2, "reduce_scatter").values()) == 3 * M   # each micro-batch into the shard
    for m, reshard in ((never, False), (always, True)):
        assert m["bytes_by_dim"]["dp"] == pytest.approx(cost.zero3_pipeline_comm_bytes(units, 2, M, reshard))
    assert never["bytes_by_dim"]["dp"] == z1["bytes_by_dim"]["dp"]
    assert always["bytes_by_dim"]["dp"] == 3 * never["bytes_by_dim"]["dp"]
    # memory: at rest both are stage 3; at the peak kept-gathered holds the stage whole
    stage3 = cost.zero_bytes_per_rank(units, 2, 3, k=K, dtype_bytes=4)
    assert never["memory"]["total"] == always["memory"]["total"] == stage3["total"]
    assert z1["memory"]["total"] == cost.zero_bytes_per_rank(units, 2, 1, k=K, dtype_bytes=4)["total"]
    peaks = {}
    for name, m, reshard in (("never", never, False), ("always", always, True)):
        f = cost.zero3_pipeline_peak_bytes(units, 2, reshard, k=K)
        assert m["memory"]["total"] - m["memory"]["grads"] == f["shards"]
        assert m["peak_gathered_bytes"] == f["gathered"]
        assert m["peak_state_bytes"] == f["total"]          # measured at the peak, as the formula
        peaks[name] = f["total"]
    assert never["peak_held_grad_bytes"] == 4 * sum(units)
    # kept gathered peaks above ZeRO-1 by the parameter shards, 4Ψ̂/N; resharding (3 units, two of
    # them layers: 12Ψ/l with l = 3 is not below 8Ψ(1 - 1/N)) between the two here
    assert z1["memory"]["total"] < peaks["always"] < peaks["never"]
    assert peaks["never"] - z1["memory"]["total"] == stage3["params"]


def test_zero3_with_cp_tp_and_pp():
    """ZeRO-3 sharded over dp·cp: dp2·cp2 per-parameter (4 ranks), dp2·cp2·pp2 flat and
    dp2·tp2·pp2 (8 ranks, m=2) train as one process; cp's ranks reduce with dp's (the dp_cp group)."""
    want = train_reference(GPT(DENSE, seed=0), DATA, MOMENTUM)
    for world, options in ((4, dict(dp=2, cp=2, zero=3, sharding="per-parameter")),
                           (8, dict(dp=2, cp=2, pp=2, zero=3, microbatches=M)),
                           (8, dict(dp=2, tp=2, pp=2, zero=3, microbatches=M))):
        got = _run(DENSE, world, **options)
        assert_same_training(got, want, rtol=RTOL, atol=ATOL)
        sent = got.measured[0]["bytes_by_dim"]
        assert sent["dp_cp" if options.get("cp") else "dp"] > 0, (options, sent)


def test_hsdp_2x2_zero3():
    """HSDP, dp4 = 2 replicas × 2 shards, ZeRO-3 (4 ranks, flat and per-parameter): trains as one
    process; each rank holds stage 3's bytes for N = 2, not 4, and sends the formula's bytes:
    3(S-1)/S·Ψ̂ within its block, one all-reduce of its Ψ̂/S shard across blocks (fewer in all than
    ZeRO-3 over 4 ranks, of which only the replicas' all-reduce crosses the blocks)."""
    want = train_reference(GPT(DENSE, seed=0), DATA, MOMENTUM)
    plain = _run(DENSE, 4, dp=4, zero=3).measured[0]
    for sharding in ("flat", "per-parameter"):
        got = _run(DENSE, 4, dp=4, zero=3, dp_shard=2, sharding=sharding)
        assert_same_training(got, want, rtol=RTOL, atol=ATOL)
        m = got.measured[0]
        units = plain["unit_sizes"]
        assert m["memory"]["total"] == cost.zero_bytes_per_rank(units, 2, 3, k=K, dtype_bytes=4)["total"]
        assert m["memory"]["total"] > plain["memory"]["total"]
        if sharding == "flat":
            want_bytes = cost.hsdp_comm_bytes(units, 2, 2)
            assert {d: m["bytes_by_dim"][d] for d in want_bytes} == pytest.approx(want_bytes)
            assert sum(want_bytes.values()) < plain["bytes_by_dim"]["dp"]
    with pytest.raises(ValueError, match="divisor of dp=4"):
        hybrid.check(DENSE, None, 4, dp=4, zero=3, dp_shard=3)
    with pytest.raises(ValueError, match="needs zero=3"):
        hybrid.check(DENSE, None, 4, dp=4, zero=1, dp_shard=2)
