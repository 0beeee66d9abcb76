"""From the planner's layout to a run: the same five dimensions at toy size.

:class:`minipar.plan.Layout` describes a production layout (say dp8 · tp8 · pp16 · cp2 · ep8
with ZeRO-1 on 2048 GPUs); the mesh (:class:`~minipar.mesh.ProcessMesh`) and
``python -m minipar.train`` take the same dimensions. At toy size every dimension the layout
uses keeps size 2 (so each of its groups, collectives and rules is exercised), those it does not
use stay 1, and while the world exceeds ``max_ranks`` the dimensions that need the most ranks
least are set back to 1, tensor then context parallelism (the notes say which). A toy GPT
(layers enough for the stages, heads enough for tp and cp, 2 experts per ep rank) trains on it:

    toy_options(layout) -> (GPTConfig, options for hybrid.run, notes)
    toy_command(layout) -> ["python", "-m", "minipar.production.train", "--dp", "2", ...]
    toy_run(layout, steps=3) -> {"result", "reference", "notes", "options"}

What the mesh refuses is mapped to what it runs, and said: full
recomputation with experts as selective (:func:`~minipar.hybrid.config.check_experts`). ZeRO-3's
``reshard_after_forward`` is passed on, and HSDP runs as 2 replicas × 2 shards (dp 4) where the
toy world has the ranks.
"""
from __future__ import annotations

import math
import sys

from ..data import batches, synthetic_tokens
from ..hybrid import experts
from ..hybrid.train import run
from ..models.gpt import GPTConfig, GPT
from ..reference import adamw

DIMS = ("dp", "cp", "pp", "tp")
SHRINK = ("tp", "cp", "dp", "pp")   # the first set back to 1 when the toy needs too many ranks


def toy_options(layout, max_ranks: int = 8):
    """``(GPTConfig, hybrid.run options, notes)`` for ``layout`` at toy size (module docstring)."""
    size = {d: 2 if getattr(layout, d) > 1 else 1 for d in DIMS}
    ep, notes = (2 if layout.ep > 1 else 1), []
    for d in SHRINK:
        if math.prod(size.values()) <= max_ranks:
            break
        if size[d] > 1 and not (ep > 1 and d in ("dp", "cp") and size["dp"] * size["cp"] == 2):
            size[d] = 1
            notes.append(f"{d}={getattr(layout, d)} runs as {d}=1 (a toy world of at most {max_ranks} ranks)")
    if ep > 1 and size["dp"] * size["cp"] % ep:
        ep = 1
        notes.append(f"ep={layout.ep} runs as ep=1 (no dp·cp ranks left to carve it from)")
    v = getattr(layout, "v", 1) if size["pp"] > 1 else 1
    zero = layout.zero if size["dp"] * size["cp"] > 1 else 0
    dp_shard = None
    if getattr(layout, "hsdp", False) and zero == 3 and ep == 1:   # HSDP: 2 replicas of 2 shards
        if size["dp"] == 2 and 2 * math.prod(size.values()) <= max_ranks:
            size["dp"], dp_shard = 4, 2
        else:
            notes.append(f"HSDP {layout.dp_replicate}×{layout.dp // layout.dp_replicate} runs as plain ZeRO-3 "
                         f"(no ranks left for 2×2 in a toy world of at most {max_ranks})")
    policy = getattr(layout, "reshard_after_forward", "auto") if zero == 3 else "auto"
    recompute = layout.recompute
    if recompute == "full" and ep > 1:
        notes.append("recompute='full' runs as 'selective' (full would route twice: hybrid.config.check_experts)")
        recompute = "selective"
    m = size["pp"] * v if size["pp"] > 1 else 1
    config = GPTConfig(vocab_size=32, block_size=16, n_layer=max(2, size["pp"] * v), n_head=4, n_embd=16,
                       **(dict(moe_every=1, n_experts=2 * ep, top_k=2) if ep > 1 else {}))
    options = dict(size, ep=ep, zero=zero, microbatches=m, virtual_stages=v,
                   schedule=layout.schedule if size["pp"] > 1 else "1f1b",
                   dtype=None if layout.dtype == "fp32" else layout.dtype, recompute=recompute,
                   reshard_after_forward=policy, dp_shard=dp_shard)
    return config, options, notes


def toy_command(layout, steps: int = 4, max_ranks: int = 8) -> list[str]:
    """The ``python -m minipar.train`` command line that trains ``layout`` at toy size."""
    config, o, _ = toy_options(layout, max_ranks)
    argv = [sys.executable, "-m", "minipar.production.train", "--steps", str(steps)]
    for k in ("dp", "cp", "pp", "tp", "ep", "zero", "microbatches", "virtual_stages", "schedule", "recompute"):
        argv += [f"--{k.replace('_', '-')}", str(o[k])]
    argv += ["--reshard-after-forward", o["reshard_after_forward"]]
    if o["dp_shard"]:
        argv += ["--dp-shard", str(o["dp_shard"]), "--dp-replicate", str(o["dp"] // o["dp_shard"])]
    argv += ["--dtype", o["dtype"] or "fp32", "--batch-size", str(o["dp"] * o["microbatches"]),
             "--n-layer", str(config.n_layer), "--n-head", str(config.n_head), "--n-embd", str(config.n_embd),
             "--block-size", str(config.block_size)]
    if config.moe_every:
        argv += ["--n-experts", str(config.n_experts), "--top-k", str(config.top_k)]
    return argv


def toy_run(layout, steps: int = 3, max_ranks: int = 8, seed: int = 0) -> dict:
    """Train ``layout`` at toy size with :func:`minipar.hybrid.run`, and one process on the same
    micro-batches (:func:`minipar.hybrid.experts.moe_reference`). Returns ``{"result"
    (TrainResult), "reference" ({"losses", "params"}), "notes", "options", "config"}``."""
    config, options, notes = toy_options(layout, max_ranks)
    data = batches(synthetic_tokens(vocab_size=config.vocab_size), steps,
                   options["dp"] * options["microbatches"], config.block_size)
    world = options["dp"] * options["pp"] * options["tp"] * options["cp"]   # ep lies inside dp·cp
    result = run(GPT(config, seed=seed), data, world, optimizer=adamw(1e-2, 0.1), **options)
    reference = experts.moe_reference(GPT(config, seed=seed), data, adamw(1e-2, 0.1), dp=options["dp"],
                                        microbatches=options["microbatches"], dtype=options["dtype"])
    return {"result": result, "reference": reference, "notes": notes, "options": options, "config": config}
