"""One data-parallel training run under any ZeRO stage, in the shape of every strategy
(:mod:`minipar.strategy`): :func:`check`, :func:`train`, :func:`run`.

``train(model, batches, optimizer, group, stage=1)`` runs on every rank of ``group``: rank
r trains on its shard ``minipar.data.shard(x, r, N)`` of each global batch, so the mean of
the ranks' losses is the single-process loss. It returns the losses, the final full
parameters by name, and what the last step ``measured``: ``memory``, bytes per component
(:func:`minipar.memory.held_state_bytes`, ``activations`` from
:class:`minipar.activations.SavedActivations`, for stage 3 the peak bytes of gathered units
in flight), ``bytes_sent`` (and ``bytes_by_dim``) by this rank, the ``unit_sizes`` the
formulas take, and ``seconds`` (:func:`minipar.strategy.loop`). Activation bytes are
counted in the first step, so the saved-tensor hooks stay off the timed last step.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import strategy
from ..activations import SavedActivations
from ..comm import group_rank, group_size
from ..data import shard
from ..reference import sgd
from ..memory import held_state_bytes
from .per_parameter import sharded_state
from .stages import OPTIMIZERS, shard_module, stage_optimizer


def wrap(stage: int, model: torch.nn.Module, optimizer_cls, group=None, param_dtype=None,
         sharding: str = "flat", prefetch: bool = True, reduce_dtype=None, persist_below=None,
         persist=None, **kwargs):
    """``(forward, optimizer)`` for ``stage``: the model (or its stage-3 wrapper) and an
    optimizer with ``zero_grad()``/``step()``. Units are ``model.layers()``. Stage 3 comes
    in two designs: ``sharding="flat"`` (:class:`FullyShardedDataParallel`, flat units) or
    ``"per-parameter"`` (:func:`fully_shard`, FSDP2's: the model's own parameters become shards),
    with ``prefetch``, ``persist_below``/``persist`` (both: small parameters kept whole) and
    ``reduce_dtype`` (per parameter)."""
    keep = dict(persist_below=persist_below, persist=persist)
    if stage == 3 and sharding == "per-parameter":
        shard_module(model, group, sharding, param_dtype=param_dtype, reduce_dtype=reduce_dtype, prefetch=prefetch,
                     **keep)
        return model, optimizer_cls(model.parameters(), **kwargs)
    if sharding != "flat":
        raise ValueError(f"sharding must be 'flat' or (stage 3 only) 'per-parameter', got {sharding!r}")
    if reduce_dtype is not None:
        raise ValueError("reduce_dtype is an option of stage 3's per-parameter design (sharding='per-parameter')")
    if stage != 3 and (persist_below is not None or persist is not None):
        raise ValueError("persist_below/persist keep parameters whole under stage 3; stages 0-2 never shard them")
    if stage == 3:
        fsdp = shard_module(model, group, sharding, param_dtype=param_dtype, prefetch=prefetch, **keep)
        return fsdp, optimizer_cls(fsdp.parameters(), **kwargs)
    if stage not in OPTIMIZERS:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    units = [list(m.parameters()) for m in model.layers()] if hasattr(model, "layers") else model.parameters()
    extra = {"param_dtype": param_dtype} if stage else {}
    return model, stage_optimizer(stage, units, optimizer_cls, group, **extra, **kwargs)


@strategy.checks
def check(model, batches, world_size: int, stage: int = 1, param_dtype=None, dtype=None, recompute=None,
          sharding: str = "flat", prefetch: bool = True, reduce_dtype=None, persist_below=None,
          persist=None, max_grad_norm=None) -> None:
    """Plain errors before launch: a known stage and design, batches that split into equal shards,
    persistence only under stage 3."""
    if persist_below is not None or persist is not None:
        if stage != 3:
            raise ValueError("persist_below/persist keep parameters whole under stage 3; stages 0-2 never shard them")
        if persist_below is not None and (not isinstance(persist_below, int) or persist_below < 0):
            raise ValueError(f"persist_below must be a number of elements (an int >= 0), got {persist_below!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if sharding not in ("flat", "per-parameter") or (sharding == "per-parameter" and stage != 3):
        raise ValueError(f"sharding must be 'flat' or, with stage 3, 'per-parameter'; got {sharding!r} at stage {stage}")
    if reduce_dtype is not None and sharding != "per-parameter":
        raise ValueError("reduce_dtype is an option of stage 3's per-parameter design (sharding='per-parameter')")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    for k, (x, _) in enumerate(batches):
        if x.shape[0] % world_size:
            raise ValueError(f"global batch {k} has {x.shape[0]} samples: not {world_size} equal shards")
    strategy.check_options(model, dtype, recompute)


def train(model, batches, optimizer=None, group=None, stage: int = 1, param_dtype=None,
          dtype=None, recompute=None, sharding: str = "flat", prefetch: bool = True, reduce_dtype=None,
          persist_below=None, persist=None, max_grad_norm=None) -> dict:
    """Train ``model`` on ``batches`` under ZeRO ``stage`` (``sharding``, ``prefetch``,
    ``reduce_dtype``, ``persist_below``, ``persist``: :func:`wrap`'s; ``max_grad_norm``: clipping);
    every rank returns ``{"losses", "params", "measured"}`` (see the module doc). ``optimizer``:
    a factory ``params -> Optimizer`` (default SGD, lr 0.1)."""
    dtype = strategy.prepare(model, dtype, recompute)   # the options every strategy takes, decided once
    r, n = group_rank(group), group_size(group)
    clip = {} if max_grad_norm is None else {"max_grad_norm": max_grad_norm}
    fwd, opt = wrap(stage, model, optimizer or sgd(), group, param_dtype, sharding=sharding, prefetch=prefetch,
                    reduce_dtype=reduce_dtype, persist_below=persist_below, persist=persist, **clip)
    s3 = (sharded_state(fwd) if sharding == "per-parameter" else fwd) if stage == 3 else None  # stage 3's state
    device = next(model.parameters()).device
    acts = SavedActivations(model)

    def measure(events) -> dict:          # the last step's figures, read after it
        memory = held_state_bytes(s3, optimizer=opt) if stage == 3 else held_state_bytes(opt)
        memory["activations"] = acts.bytes
        if stage == 3:
            memory["gathered_peak"] = s3.peak_gathered_bytes
        return {"memory": memory, "unit_sizes": (s3 if stage == 3 else opt).unit_sizes(),
                "persistent": s3.persistent_numel() if stage == 3 else 0,
                "grad_norm": getattr(opt, "grad_norm", None)}

    def step(i, batch):
        x, y = batch
        opt.zero_grad()
        # activation bytes: counted in the first step (every step saves the same), off the timed ones
        with acts if i == 0 else nullcontext(), strategy.forward(dtype, device):
            loss = fwd(shard(x, r, n), shard(y, r, n))
        loss.backward()
        opt.step()
        return loss, measure

    losses, measured = strategy.loop(batches, step, mean_over=group)
    params = s3.gather_full_params() if stage == 3 else strategy.full_params(model.named_parameters())
    return {"losses": losses, "params": params, "measured": measured}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` ranks."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
