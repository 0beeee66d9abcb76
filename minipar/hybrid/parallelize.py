"""One ordered ``parallelize``: the dimensions applied in the order they nest.

A model is made parallel by transforms applied one after another, each living with its technique
(the shape of torchtitan's ``parallelize_llama``), every option in one frozen :class:`Parallelism`::

    model = apply_tp(model, groups, plan)            # tensor_parallel: column/row pairs (+ SP)
    apply_cp(model, groups, plan)                    # context_parallel: attention over cp
    apply_ep(model, groups, mesh, plan, register)    # experts over ep (aux loss per micro-batch)
    bounds, stages, schedule = apply_pp(...)         # pipeline: pp·v stages, this rank's kept
    apply_recompute(model, plan)                     # activation recomputation in every block
    dp = apply_dp(...)                               # ZeRO 0-3, flat or per-parameter, or HSDP

The order is forced by what each step needs: tensor parallelism replaces the layers the later
steps wrap; context parallelism replaces attention inside them; the experts are sharded inside
the blocks; the pipeline cuts the layers that now exist; recomputation is set on the blocks as
they finally are; data parallelism shards (or reduces) the parameters each rank ended up with,
so it comes last.

The build also makes the step: a transform with work in the training step registers it as it wraps
the model (:meth:`Parallelized.register`), so the step runs it in the build's order. The experts
reset their routing counts before the micro-batches and add their auxiliary losses to the rank's
loss; data parallelism, after backward, reduces the gradients as its ZeRO stage says (averaged over
dp·cp, reduce-scattered, the experts' over expert-dp, HSDP's blocks over ``dp_replicate``):
:func:`~minipar.hybrid.sharding.build_optimizer` is the one place the stage is dispatched on.
:class:`~minipar.hybrid.HybridModel` is this function, the pipeline and the optimizer step."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ..context_parallel import apply_cp
from ..models.recompute import apply_recompute
from ..pipeline import apply_pp
from ..tensor_parallel import apply_tp
from .experts import apply_ep
from .sharding import apply_dp


@dataclass(frozen=True)
class Parallelism:
    """Every option of the composition (the mesh's degrees are the mesh's): ZeRO ``zero`` (0-3) with
    ``sharding`` (``"flat"`` or ``"per-parameter"``), stage 3's ``reshard_after_forward`` policy and
    HSDP's ``dp_shard``; the pipeline's ``schedule``, ``microbatches``, ``virtual_stages`` and
    ``bounds``; ``sequence_parallel``; the data-parallel ``bucket_cap_mb``; ``dtype`` (autocast);
    ``recompute`` (``None``: the model's own); context parallelism's ``layout`` and ``variant``.

    A plan is decided once, by :func:`minipar.hybrid.check` (which validates every option against the
    model and the mesh and returns it normalised: ``dtype`` resolved, ``zero`` the stage in effect);
    the ranks receive it and nothing below re-resolves or changes it."""
    zero: int = 0
    sharding: str = "flat"
    reshard_after_forward: str = "auto"
    dp_shard: int | None = None
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    bounds: tuple[int, ...] | None = None
    sequence_parallel: bool = False
    bucket_cap_mb: float = 25.0
    dtype: object = None
    recompute: str | None = None
    layout: str = "zigzag"
    variant: str = "ring"

    def __post_init__(self):
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"Parallelism(dtype={self.dtype!r}): a plan holds a resolved dtype; "
                            "make plans with minipar.hybrid.check, which decides every option once")

    @classmethod
    def options(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class Parallelized:
    """What :func:`parallelize` made on this rank: the (tensor/context/expert-parallel) ``model``,
    the pipeline's ``bounds``, this rank's ``stages`` and the ``schedule``, ``params`` (this rank's
    by single-device name), and data parallelism ``dp`` (:func:`~minipar.hybrid.sharding.build_optimizer`:
    the ``optimizer``, the dense gradients' ``reducer`` or ``None``, under stage 3 the ``sharded``
    state). The step around the pipeline is what the steps registered, in build order
    (:meth:`register`): :meth:`start` before the forwards, :meth:`finish` after the backward."""
    model: object
    groups: dict
    mesh: object
    bounds: list = None
    stages: dict = None
    schedule: object = None
    params: dict = field(default_factory=dict)
    dp: object = None
    starts: list = field(default_factory=list)
    finishes: list = field(default_factory=list)
    losses: list = field(default_factory=list)

    def register(self, start=None, finish=None, loss=None) -> None:
        """A step's work in the training step: ``start()`` before the micro-batches, ``finish()`` once
        the gradients are in (gradient reduction, ZeRO's reduce-scatter, expert scaling, HSDP's
        all-reduce), ``loss()`` a float this rank adds to its part of the loss."""
        for hooks, fn in ((self.starts, start), (self.finishes, finish), (self.losses, loss)):
            if fn is not None:
                hooks.append(fn)

    def start(self) -> None:
        for fn in self.starts:
            fn()

    def finish(self, loss):
        """The registered work after backward, in build order; returns ``loss`` with the registered
        parts added (a pipeline rank without the last stage: its auxiliary losses alone)."""
        for fn in self.finishes:
            fn()
        for fn in self.losses:
            loss = (loss or 0.0) + fn()
        return loss

    optimizer = property(lambda self: self.dp.optimizer)
    reducer = property(lambda self: self.dp.reducer)
    sharded = property(lambda self: self.dp.sharded)


def parallelize(model, mesh, groups: dict, plan: Parallelism, optimizer, pp_rank: int) -> Parallelized:
    """The single-device GPT ``model`` (on this rank's device) made parallel on ``mesh`` (its process
    ``groups`` by dimension) as ``plan`` says, in the order of the module docstring; ``optimizer`` is
    the factory ``params -> torch.optim.Optimizer``. Each step that has work in the training step
    registers it on the result as it wraps the model (:meth:`Parallelized.register`). A collective
    where a step creates groups."""
    full = model
    model = apply_tp(full, groups, plan)
    out = Parallelized(model, groups, mesh)
    apply_cp(model, groups, plan)
    apply_ep(model, groups, mesh, plan, out.register)
    out.bounds, out.stages, out.schedule = apply_pp(model, full.layers(), pp_rank, mesh, plan)
    apply_recompute(model, plan)
    mine = {id(q) for st in out.stages.values() for q in st.parameters()}
    out.params = {n: q for n, q in model.named_parameters() if id(q) in mine}
    out.dp = apply_dp(out, optimizer, plan)
    return out
