"""Stage 3's shard spans: which elements of which parameter each rank's shard holds.

Checkpoints save and load through these spans (``production/checkpoint/state.py``), so they
must name exactly the parameter's own elements: across the ranks they partition every
parameter once, and never include the padding rows that make a first dimension divisible by
the ranks (FSDP2's design pads the last rank's shard). Both designs, on first dimensions that
the rank count does not divide (5 and 3 rows over 2 ranks)."""
import torch
import torch.distributed as dist
import torch.nn as nn

import minipar
from minipar.zero import FullyShardedDataParallel, fully_shard


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _spans():
    out = {}
    for design in ("flat", "per-parameter"):
        model = _model()
        full = {name: p.detach().reshape(-1).clone() for name, p in model.named_parameters()}
        names = {}
        for mod_name, m in model.named_modules():
            for attr, p in m._parameters.items():
                names[id(p)] = names[(id(m), attr)] = f"{mod_name}.{attr}" if mod_name else attr
        if design == "flat":
            wrapped = FullyShardedDataParallel(model, units=[model[0], model[2]])
            spans = wrapped.shard_spans()
        else:
            wrapped = fully_shard(model, units=[model[0], model[2]])
            spans = wrapped.__dict__["_fully_shard"].shard_spans()
        rows = []
        for key, shard, a, b, s in spans:
            name = names[(id(key[0]), key[1])] if isinstance(key, tuple) else names[id(key)]
            held = shard.detach().reshape(-1)[s:s + (b - a)]
            rows.append((name, a, b, bool(torch.equal(held, full[name][a:b]))))
        out[design] = {"spans": rows, "numel": {k: v.numel() for k, v in full.items()}}
    return out


def test_shard_spans_partition_every_parameter_without_padding():
    """Over 2 ranks the spans of each parameter cover its elements exactly once, each span's
    shard elements equal the parameter's, and no span reaches past the parameter's end."""
    results = minipar.launch(_spans, 2)
    for design in ("flat", "per-parameter"):
        numel = results[0][design]["numel"]
        covered = {name: [] for name in numel}
        for r, res in enumerate(results):
            for name, a, b, same in res[design]["spans"]:
                assert 0 <= a < b <= numel[name], (design, r, name, a, b, numel[name])
                assert same, f"{design}: rank {r}'s shard does not hold {name}[{a}:{b}]"
                covered[name].append((a, b))
        for name, spans in covered.items():
            got = sorted(spans)
            assert got[0][0] == 0 and got[-1][1] == numel[name], (design, name, got)
            assert all(x[1] == y[0] for x, y in zip(got, got[1:])), (design, name, got)
