"""Training the GPT with context parallelism (and data parallelism over it), checked and launched.

``check`` / ``train`` / ``run`` in the shape of :mod:`minipar.strategy`. With ``dp = 1`` the
job (or ``group``) is one cp group; with ``dp > 1`` the ranks form a dp × cp
:class:`~minipar.mesh.ProcessMesh` (cp faster): each global batch is cut into dp shards, each
shard's sequences over the cp ranks, and gradients are summed over dp × cp.
"""
from __future__ import annotations

import torch.distributed as dist

from .. import comm, strategy
from ..runtime import trace
from ..data import shard
from ..mesh import ProcessMesh
from ..models.recompute import check_mode
from ..reference import sgd
from ..strategy import full_params
from .attention import VARIANTS
from .model import all_reduce_grads, local_loss, parallelize
from .sharding import check_sequence, sequence_positions, shard_sequence
from .ulysses import check_heads


def check_config(config, cp: int, seq_len: int | None = None, layout: str = "zigzag",
                 variant: str = "ring", tp: int = 1, sequence_parallel: bool = False,
                 recompute=None) -> None:
    """Plain ``ValueError`` unless the GPT ``config`` can run context-parallel over ``cp`` ranks (``tp``-way
    tensor-parallel inside each): sequences of ``seq_len`` must cut into cp (contiguous) or 2·cp
    (zigzag) chunks; Ulysses needs cp | heads per tp rank."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if cp > 1 and getattr(config, "moe_every", 0):
        raise ValueError("context parallelism is implemented for the dense GPT (moe_every=0)")
    if cp > 1 and sequence_parallel:
        raise ValueError("sequence_parallel with cp > 1 is not supported (the sequence is already "
                         "split over the cp ranks); use one or the other")
    check_mode(recompute)   # all three work with every variant (.attention: what "selective" keeps)
    if variant == "ulysses":
        check_heads(config.n_head, cp, tp)
    if seq_len is not None:
        check_sequence(seq_len, cp, layout)


@strategy.checks
def check(model, batches, world_size: int, variant: str = "ring", layout: str = "zigzag",
          dp: int = 1, dtype=None, recompute=None) -> None:
    """Plain ``ValueError`` before launch for a setup context parallelism cannot train."""
    if not isinstance(dp, int) or dp < 1 or world_size % dp:
        raise ValueError(f"dp={dp} must be a positive int dividing world_size={world_size}")
    cp = world_size // dp
    c = getattr(model, "config", None)
    if c is None or not hasattr(model, "blocks"):
        raise ValueError("context parallelism trains the course GPT (minipar.models.GPT)")
    if c.dropout:
        raise ValueError(f"dropout={c.dropout}: training is checked against one process and needs dropout=0")
    check_config(c, cp, None, layout, variant, recompute=recompute)
    strategy.check_options(model, dtype, recompute)
    for step, (x, _) in enumerate(batches):
        check_sequence(x.shape[1], cp, layout)
        if x.shape[0] % dp:
            raise ValueError(f"global batch {step} has {x.shape[0]} sequences, which dp={dp} "
                             "ranks cannot split evenly")


def _groups(dp: int, group):
    """(cp group, gradient group, dp coordinate, dp) for this rank."""
    if dp == 1:
        return group, group, 0, 1
    if group is not None:
        raise ValueError("dp > 1 builds its own dp × cp mesh over the world; pass group=None")
    mesh = ProcessMesh(dp=dp, cp=dist.get_world_size() // dp).build()
    if mesh.cp == 1:
        return None, mesh.group("dp"), mesh.rank("dp"), dp
    return mesh.group("cp"), mesh.group("dp_cp"), mesh.rank("dp"), dp


def train(model, batches, optimizer=None, group=None, variant: str = "ring",
          layout: str = "zigzag", dp: int = 1, dtype=None, recompute=None) -> dict:
    """On every rank: train the GPT ``model`` with context parallelism on the global ``batches``.
    Returns ``{"losses", "params" (rank 0 of the gradient group), "measured"}``: the last step's
    bytes sent by name and dimension, its attention seconds and seconds (:func:`minipar.strategy.loop`).
    ``group``: the cp group when ``dp = 1``; ``dp > 1`` lays a dp × cp mesh over the world. ``recompute`` (``None``: the model's own) is set on every
    block; under ``"full"`` the backward runs each block's attention communication again."""
    dtype = strategy.prepare(model, dtype, recompute)   # the options every strategy takes, decided once
    cp_group, grad_group, d, dp = _groups(dp, group)
    single = cp_group is None and dp > 1                      # cp = 1 inside a dp mesh
    cp, r = (1, 0) if single else (comm.group_size(cp_group), comm.group_rank(cp_group))
    if not single and cp > 1:
        parallelize(model, cp_group, variant, layout)
    opt = (optimizer or sgd())(list(model.parameters()))
    dev, dim = next(model.parameters()).device, "dp_cp" if dp > 1 else "cp"

    def step(i, batch):
        x, y = batch
        xs, ys = shard(x, d, dp).to(dev), shard(y, d, dp).to(dev)
        xl, yl = shard_sequence(xs, r, cp, layout), shard_sequence(ys, r, cp, layout)
        pos = sequence_positions(xs.shape[1], r, cp, layout, device=dev)
        opt.zero_grad(set_to_none=True)
        with strategy.forward(dtype, dev, "forward", step=i):
            loss = local_loss(model, xl, yl, pos) / (cp * dp)
        trace.backward(loss, step=i)
        all_reduce_grads(model.parameters(), grad_group, dim=dim)
        with trace.region("optimizer", step=i):
            opt.step()
        return loss, _measure

    # each rank's loss is its term of the mean, already / (cp·dp): the record sums the terms
    losses, measured = strategy.loop(batches, step, mean_over=strategy.WHOLE, parts_over=grad_group, dim=dim)
    measured.memory = strategy.state_memory(model, opt)
    params = full_params(model.named_parameters()) if comm.group_rank(grad_group) == 0 else None
    return {"losses": losses, "params": params, "measured": measured}


def _measure(events) -> dict:
    """The step's bytes by operation name and its attention seconds (forward and backward)."""
    by_name = {}
    for e in events:
        if e["kind"] == "comm":
            by_name[e["name"]] = by_name.get(e["name"], 0) + e["bytes_sent"]
    attn = sum(e["end"] - e["start"] for e in events
               if e["kind"] == "compute" and e["name"] in ("attention", "attention_backward"))
    return {"bytes_by_name": by_name, "attention_seconds": attn}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check` (plain errors before launch), then :func:`train` on ``world_size`` ranks."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
