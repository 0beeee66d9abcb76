"""Which (dp, pp, tp) configurations can train a given GPT, and which one to choose.

:func:`check` is the plain error before launch: the mesh must cover the world
(``dp·pp·tp = world_size``), each strategy's own constraints must hold (tensor parallelism
splits heads, hidden size and vocabulary by ``tp``; a pipeline needs at least one layer
per stage; the batch must cut into ``dp`` shards of ``m`` equal micro-batches).

:func:`choose_config` applies the advice of Narayanan et al. 2021 ("Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", §3, Takeaways #1 and #2), with the
memory per rank from :func:`minipar.cost.hybrid_memory_per_rank`: its contract says what the
choice must achieve; notebook 07 measures the bytes each dimension sends."""
from __future__ import annotations

from dataclasses import replace

from .. import precision, strategy
from .hsdp import check_hsdp
from .parallelize import Parallelism
from .sharding import reshard_policy
from ..cost import hybrid_memory_per_rank
from ..mesh import ProcessMesh, group_members
from ..models.gpt import GPTConfig
from ..models.recompute import check_mode
from ..context_parallel import check_config as check_context_parallel
from ..pipeline import check_config as check_schedule
from ..tensor_parallel import check as check_tensor_parallel


def num_layers(config: GPTConfig) -> int:
    """Layers a pipeline can cut between: embedding, ``n_layer`` blocks, head."""
    return config.n_layer + 2


def num_params(config: GPTConfig) -> int:
    """Ψ, the single-device GPT's parameter count (tied weights counted once)."""
    c, h = config, config.n_embd
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    embed = c.vocab_size * h + c.block_size * h
    head = 2 * h + (0 if c.tie_weights else c.vocab_size * h)
    return embed + c.n_layer * block + head


@strategy.checks
def check(model, batches, world_size: int | None, dp: int = 1, pp: int = 1,
          tp: int = 1, microbatches: int = 1, schedule: str = "1f1b", virtual_stages: int = 1,
          sequence_parallel: bool = False, batch_size: int | None = None, dtype=None, cp: int = 1,
          layout: str = "zigzag", variant: str = "ring", ep: int = 1, zero: int | None = None,
          recompute=None, sharding: str = "flat", seq_len: int | None = None,
          bucket_cap_mb: float = 25.0, bounds: list[int] | None = None,
          reshard_after_forward: str = "auto", dp_shard: int | None = None) -> Parallelism:
    """Raise a plain ``ValueError`` if the GPT ``model`` (or its ``GPTConfig``) cannot train on a
    dp × pp × tp (× cp, ep) mesh of ``world_size`` ranks (the rules: the module docstring). Call it
    in the driver, before any process starts (:func:`~minipar.hybrid.run` does); ``world_size=None``
    checks the layout alone; the global batch is ``batch_size``, else that of ``batches``; the
    sequence length that of ``batches``, else ``seq_len``. Every option of :func:`~minipar.hybrid.train`
    is one here; any other is refused by name.

    Returns the plan, every option decided here once (:class:`~minipar.hybrid.parallelize.Parallelism`):
    ``dtype`` resolved (:func:`minipar.precision.resolve`: ``None`` for fp32, else a ``torch.dtype``),
    ``zero`` the stage in effect (``None`` is 0, and so is any stage when ``dp·cp = 1``: there is
    nothing to shard over), ``bounds`` a tuple. The ranks build from it and decide nothing again."""
    config = getattr(model, "config", model)
    zero = zero or 0
    ProcessMesh(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, world_size=world_size)
    check_experts(config, dp, cp, ep, sequence_parallel, recompute)
    check_zero(zero, pp, cp, tp, sharding, config, reshard_after_forward)
    check_hsdp(dp, dp_shard, zero, ep)
    if cp > 1:  # context parallelism: T cut over cp (2·cp for zigzag), Ulysses needs cp | heads/tp
        seq_len = batches[0][0].shape[1] if batches else seq_len
        check_context_parallel(replace(config, moe_every=0),  # the mesh composes the MoE layers itself
                               cp, seq_len, layout,
                               variant, tp, sequence_parallel, recompute)
    if tp > 1:
        check_tensor_parallel(config, None, tp, sequence_parallel)
    elif sequence_parallel:
        raise ValueError("sequence_parallel needs tp > 1 (it splits the sequence over the tp ranks)")
    check_schedule(schedule, pp, microbatches, virtual_stages, num_layers(config))
    if config.tie_weights and pp > 1:
        raise ValueError("tie_weights=True with pp > 1: the embedding and the head would live on "
                         "different stages and their shared matrix would need its own all-reduce; "
                         "use tie_weights=False")
    if config.dropout:
        raise ValueError(f"dropout={config.dropout}: hybrid training is checked against one process "
                         "and needs dropout=0")
    batch_size = batch_size or (batches[0][0].shape[0] if batches else None)
    if batch_size is not None and batch_size % (dp * microbatches):
        raise ValueError(f"global batch {batch_size} cannot be split into dp={dp} shards of "
                         f"m={microbatches} equal micro-batches (need a multiple of {dp * microbatches})")
    if recompute is not None:
        check_mode(recompute)
    return Parallelism(zero=zero if dp * cp > 1 else 0, sharding=sharding,
                       reshard_after_forward=reshard_after_forward, dp_shard=dp_shard, schedule=schedule,
                       microbatches=microbatches, virtual_stages=virtual_stages,
                       bounds=None if bounds is None else tuple(bounds), sequence_parallel=sequence_parallel,
                       bucket_cap_mb=bucket_cap_mb, dtype=precision.resolve(dtype), recompute=recompute,
                       layout=layout, variant=variant)


def check_experts(config, dp: int, cp: int, ep: int, sequence_parallel: bool = False,
                  recompute=None) -> None:
    """The rules of expert parallelism on the mesh (:mod:`minipar.hybrid.experts`)."""
    if not config.moe_every:
        if ep > 1:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model (moe_every > 0, n_experts > 1): "
                             "a dense GPT has no experts to spread")
        return
    if config.n_experts % ep:
        raise ValueError(f"n_experts={config.n_experts} cannot be split evenly over ep={ep} ranks")
    if not 1 <= config.top_k <= config.n_experts:
        raise ValueError(f"top_k={config.top_k} must be between 1 and n_experts={config.n_experts}")
    if config.capacity_factor is not None and (ep != dp or cp > 1):
        raise ValueError(f"capacity_factor={config.capacity_factor} with dp={dp}, cp={cp}, ep={ep}: "
                         "capacity is counted over the ep group's tokens in rank order, which is the "
                         "micro-batch's token order only when ep = dp and cp = 1; use those, or "
                         "capacity_factor=None (dropless)")
    if sequence_parallel:
        raise ValueError("sequence_parallel with MoE layers: the experts expect every tp rank to hold "
                         "the whole sequence; use sequence_parallel=False")
    if recompute == "full":
        raise ValueError("recompute='full' with MoE layers on the mesh would run the routing (and count "
                         "its auxiliary loss) twice per micro-batch; use 'selective' or 'none'")


def check_zero(zero: int, pp: int = 1, cp: int = 1, tp: int = 1, sharding: str = "flat",
               config=None, reshard_after_forward: str = "auto") -> None:
    """ZeRO on the mesh: every stage with any dp, cp, tp, pp and ep; the dense parameters sharded
    over dp·cp, the experts' over their expert-dp group (dp·cp/ep ranks). Under a pipeline stage 2 reduce-scatters each micro-batch into
    the sharded gradient, and stage 3 keeps a stage's units gathered across its micro-batches
    unless ``reshard_after_forward="always"`` (:mod:`.sharding`)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r} must be 0, 1, 2 or 3")
    reshard_policy(reshard_after_forward, pp)
    if sharding not in ("flat", "per-parameter"):
        raise ValueError(f"sharding={sharding!r} must be 'flat' or 'per-parameter'")
    if zero == 3 and config is not None and config.tie_weights:
        raise ValueError("ZeRO-3 gathers one layer at a time and tie_weights=True shares a matrix between "
                         "the first and the last: use tie_weights=False")


def valid_configs(config: GPTConfig, world_size: int, batch_size: int | None = None,
                  microbatches: int = 1) -> list[dict[str, int]]:
    """Every ``{"dp", "pp", "tp"}`` with product ``world_size`` that passes :func:`check`."""
    out = []
    for tp in range(1, world_size + 1):
        for pp in range(1, world_size // tp + 1):
            if world_size % (tp * pp):
                continue
            dp = world_size // (tp * pp)
            try:
                check(config, None, world_size, dp, pp, tp, microbatches, batch_size=batch_size)
            except ValueError:
                continue
            out.append({"dp": dp, "pp": pp, "tp": tp})
    return out


# Contract:
# Given: ``valid_configs`` lists every dp·pp·tp = world_size the model and the batch accept;
#     ``hybrid_memory_per_rank`` (fp32 Adam) their model states per rank; ``group_members`` (part
#     B) their groups; node k holds ranks k·ranks_per_node .. (k+1)·ranks_per_node - 1; the
#     result is ``{"dp", "pp", "tp"}``: Narayanan et al.'s advice (§3, Takeaways #1 and #2).
# ex07.C.fit: the chosen configuration's model states per rank fit in ``memory_per_rank`` (no
#     limit when ``None``); states of exactly ``memory_per_rank`` bytes fit.
# ex07.C.prefer: of the configurations that fit, the choice is the best by these aims, the first
#     the most important: (1) as much data parallelism as memory allows (it sends the fewest
#     bytes per useful FLOP); (2) no tensor-parallel group spans two nodes, if a configuration
#     as good by (1) keeps every one inside a node (its all-reduces, in every layer, carry the
#     most bytes); (3) the smallest pipeline bubble: with the microbatches fixed, the fewest
#     pipeline stages.
# ex07.C.none: nothing left is a ``ValueError`` whose message gives ``memory_per_rank``.
def choose_config(config: GPTConfig, world_size: int, batch_size: int, microbatches: int = 1,
                  memory_per_rank: float | None = None, ranks_per_node: int = 8,
                  zero1: bool = False) -> dict[str, int]:
    """The configuration ``{"dp", "pp", "tp"}`` to train ``config`` on ``world_size`` ranks,
    among the valid ones (:func:`check`) whose model states fit in ``memory_per_rank`` bytes
    (``None``: no limit; fp32 Adam, :func:`minipar.cost.hybrid_memory_per_rank`), on nodes of
    ``ranks_per_node`` ranks. Raises ``ValueError`` if none fits."""
    # >>> ex07 C
    best, psi = None, num_params(config)
    for c in valid_configs(config, world_size, batch_size, microbatches):
        need = hybrid_memory_per_rank(psi, c["dp"], c["pp"], c["tp"], zero1=zero1)["total"]
        if memory_per_rank is not None and need > memory_per_rank:
            continue
        # least model parallelism; tp groups inside a node (tp ≤ ranks_per_node is not enough when
        # tp does not divide it); the fewest stages (bubble (p-1)/m)
        crosses = any(len({q // ranks_per_node for q in group_members(r, "tp", c["dp"], c["pp"], c["tp"])}) > 1
                      for r in range(world_size))
        key = (c["tp"] * c["pp"], crosses, c["pp"])
        if best is None or key < best[0]:
            best = (key, c)
    if best is None:
        raise ValueError(f"no configuration of {world_size} ranks can train this model within "
                         f"{memory_per_rank} bytes per rank")
    return best[1]
    # <<< ex07 C
