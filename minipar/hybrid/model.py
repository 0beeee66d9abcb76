"""3D parallelism: the GPT split by layers (pp), within layers (tp), replicated over dp, composed
as in Megatron-LM (Narayanan et al. 2021, §3) from minipar's own pieces:

* **tp**: every rank builds :class:`~minipar.tensor_parallel.TensorParallelGPT` over its
  tensor-parallel group (the single-device GPT itself when ``tp == 1``), with the weights
  of the single-device model it is given;
* **pp**: the model's ``layers()`` are cut into ``pp·v`` balanced stages
  (:func:`~minipar.pipeline.partition`); this rank runs the stages of its pipeline coordinate
  with :class:`~minipar.pipeline.Pipeline` over its pipeline group (the loss on the last
  stage is the vocabulary-parallel cross-entropy);
* **dp**: each global batch is cut into dp shards (:func:`minipar.data.shard`); after the
  pipeline's flush the gradients are averaged over the data-parallel group by the
  :class:`~minipar.data_parallel.Reducer` (one bucketed all-reduce), or with ZeRO
  (:mod:`.sharding`: stage 1 everywhere, stages 2-3 and ``fully_shard`` on a dp × tp mesh).

With equal shards and equal micro-batches the averaged gradient is the single-process
gradient of the global mean loss, ∇L = 1/(d·m) Σ_shards Σ_micro ∇ℓ, so every step is the
single-process step (up to the order of floating-point sums).

* **ep**: a mixture-of-experts GPT's MoE layers are spread over the rank's ep group (carved out of
  dp·cp, :class:`~minipar.mesh.ProcessMesh`), capacity and the auxiliary loss counted per
  micro-batch; the step then equals :func:`minipar.hybrid.experts.moe_reference` (one process
  accumulating the same micro-batches), :mod:`.experts` states why and how."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm, strategy
from ..runtime import trace
from ..runtime.backend import current_device
from ..context_parallel import sequence_positions, set_positions, shard_sequence
from ..data import shard
from ..mesh import ProcessMesh
from ..models.gpt import GPT
from ..pipeline import Pipeline
from ..reference import sgd
from ..tensor_parallel import gather_shards, shard_state_dict, unshard_state_dict
from . import experts
from .config import check
from .parallelize import Parallelism, parallelize


class HybridModel:
    """One rank's part of the single-device GPT ``model`` (same weights on every rank) trained on a
    ``dp × pp × tp`` :class:`ProcessMesh`. ``train_step(x, y)`` trains on one global batch and returns
    its mean loss (the same on every rank); ``optimizer`` (built by the factory ``optimizer``, default
    SGD) is the torch optimizer or the ZeRO-1 wrapper; ``full_state_dict()`` /
    ``load_full_state_dict(sd)`` move the single-device GPT's weights in and out (collectives: call
    them on every rank). ``params`` maps this rank's single-device names to its parameters; ``coords``
    is its ``{"pp", "dp", "tp"}``. ZeRO with ``dp·cp == 1`` is plain training (nothing to shard over). Its options are one
    :class:`~minipar.hybrid.parallelize.Parallelism` (``plan=``, or its fields as keywords), applied
    by :func:`~minipar.hybrid.parallelize.parallelize` in the order the dimensions nest.
    ``zero=2|3`` compose with every dimension (:mod:`.sharding`): ``reshard_after_forward`` is stage 3's
    policy under a pipeline, ``dp_shard`` < dp makes it HSDP (:mod:`.hsdp`)."""

    def __init__(self, model: GPT, mesh: ProcessMesh, *, optimizer=None, plan: Parallelism | None = None,
                 **options):
        config = model.config
        if plan is None:   # the options decided here, once (a plan from check is already decided)
            plan = check(config, None, dist.get_world_size(), dp=mesh.dp, pp=mesh.pp, tp=mesh.tp, cp=mesh.cp,
                         ep=mesh.ep, **options)
        elif options:
            raise TypeError(f"HybridModel: a plan and options {sorted(options)}: the plan holds every option")
        if not mesh.groups:
            mesh.build()
        self.moe = bool(config.moe_every)
        self.groups = g = dict(mesh.groups)
        if self.moe and mesh.ep == 1:   # an expert group of one rank: torch's own split of the world
            g["ep"], _ = dist.new_subgroups(1)
        self.config, self.mesh = config, mesh
        self.coords = mesh.coordinates(dist.get_rank())
        self.plan, self.m = plan, plan.microbatches
        self.sequence_parallel, self.layout = plan.sequence_parallel, plan.layout
        self.device = current_device()                      # where this rank computes
        full = model.to(self.device)                        # the single-device model
        self.full_names = list(full.state_dict())
        self.full_shapes = {k: v.shape for k, v in full.state_dict().items()}
        self.parts = parts = parallelize(full, mesh, g, plan, optimizer or sgd(), self.coords["pp"])
        self.model, self.bounds, self.stages, self.schedule = parts.model, parts.bounds, parts.stages, parts.schedule
        self.params, self.optimizer, self.reducer, self.sharded = parts.params, parts.optimizer, parts.reducer, parts.sharded
        self._act = (1, config.block_size, config.n_embd)
        self.pipe = Pipeline(self.stages, self.schedule, lambda s: self._act, g["pp"],
                             loss_fn=self.model.loss, dtype=plan.dtype)   # the GPT's (tp: vocabulary-parallel)
        self.last_step: dict = {}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """The step body on the global batch ``(x, y)`` (every rank passes the same batch):
        this rank's dp shard, m micro-batches through the pipeline, then what the composition's
        steps registered for after backward (:meth:`~minipar.hybrid.parallelize.Parallelized.finish`:
        gradients averaged over dp, ZeRO's reduce-scatters, the experts'), optimizer step. Returns this
        rank's part of the loss (:attr:`loss_groups` make it the global mean); :meth:`train_step` and
        :func:`minipar.hybrid.train` run it in :func:`minipar.strategy.loop`."""
        dp, d = self.mesh.dp, self.coords["dp"]
        xs, ys = shard(x.to(self.device), d, dp), shard(y.to(self.device), d, dp)
        if self.mesh.cp > 1:  # this rank's tokens of every sequence, at their global positions
            c, r, T = self.mesh.cp, self.coords["cp"], xs.shape[1]
            xs, ys = shard_sequence(xs, r, c, self.layout), shard_sequence(ys, r, c, self.layout)
            set_positions(self.model, sequence_positions(T, r, c, self.layout, device=self.device))
        seq = xs.shape[1] // (self.mesh.tp if self.sequence_parallel else 1)
        self._act = (xs.shape[0] // self.m, seq, self.config.n_embd)
        self.optimizer.zero_grad(set_to_none=True)
        self.parts.start()
        loss = self.parts.finish(self.pipe.step(xs, ys))
        with trace.region("optimizer"):
            self.optimizer.step()                           # ZeRO-1: reduce-scatter, step, gather
        return loss

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step on the global batch ``(x, y)`` (:meth:`step` in :func:`minipar.strategy.loop`).
        Returns the global mean loss; ``last_step`` holds this rank's ``bytes`` sent by mesh
        dimension (the trace's labels), its ``events`` and ``seconds``."""
        losses, measured = strategy.loop([(x, y)], lambda i, batch: self.step(*batch), **self.loss_groups,
                                         events=True)
        self.last_step = self.step_record(measured)
        return losses[0]

    @staticmethod
    def step_record(measured: dict) -> dict:
        """``last_step`` from the loop's ``measured``: ``seconds``, ``events`` and ``bytes``
        (by dimension, dp, pp and tp always present)."""
        sent = measured["bytes_by_dim"]
        return {"seconds": measured["seconds"], "events": measured["events"],
                "bytes": {**{d: sent.get(d, 0) for d in ("dp", "pp", "tp")}, **sent}}

    @property
    def loss_groups(self) -> dict:
        """The loss record's groups (:func:`minipar.strategy.record_loss`): the last stage's loss
        and each stage's auxiliary losses are parts summed over pp; each dp·cp rank holds the mean
        of its own tokens, averaged over dp·cp: the global mean loss."""
        return {"parts_over": self.groups["pp"], "mean_over": self.groups["dp_cp"]}

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by single-device name (tensor-parallel shards)."""
        return dict(self.params)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of this rank's parameters (its stages, its tp shards), single-device names."""
        return {k: v.detach().clone() for k, v in self.params.items()}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device GPT's state dict (names, full tensors), on every rank: the tp
        shards all-gathered in the tp group, then the experts combined over the ep group and the
        stages over the pp group (all-reduces of disjoint parts). A collective of the whole mesh."""
        mine = self.parts.dp.gather_params()                # ZeRO-3: gathered over dp·cp
        if self.mesh.tp > 1:
            mine = unshard_state_dict(gather_shards(mine, self.groups["tp"]))
        names = [k for k in self.full_names if k in self.full_shapes]
        if self.mesh.pp > 1 or self.mesh.ep > 1:   # disjoint parts: stages over pp, experts over ep
            sizes = [self.full_shapes[k].numel() for k in names]
            flat = torch.cat([mine[k].reshape(-1).float() if k in mine else torch.zeros(n, device=self.device)
                              for k, n in zip(names, sizes)])
            if self.mesh.ep > 1:   # each expert on one rank of the ep group: sum the disjoint parts
                mask = torch.cat([torch.full((n,), experts.is_expert(k), device=self.device)
                                  for k, n in zip(names, sizes)])
                part = flat * mask
                comm.all_reduce(part, group=self.groups["ep"], name="gather_state")
                flat = torch.where(mask, part, flat)
            if self.mesh.pp > 1:
                comm.all_reduce(flat, group=self.groups["pp"], name="gather_state")
            mine = {k: x.view(self.full_shapes[k]).clone() for k, x in zip(names, flat.split(sizes))}
        if self.config.tie_weights:
            mine.setdefault("head.lm_head.weight", mine["embed.wte.weight"])
        return {k: mine[k].clone() for k in names}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load this rank's part (its stages, its tp shards) of a single-device GPT state dict."""
        if not self.parts.dp.whole:
            raise NotImplementedError("loading weights into a ZeRO-3 mesh is not supported: its parameters "
                                      "are shards; load them before building it (zero < 3)")
        t, r = self.mesh.tp, self.coords["tp"]
        for k, p in self.params.items():
            p.copy_(shard_state_dict({k: state_dict[k]}, t, r)[k] if t > 1 and not experts.is_expert(k)
                    else state_dict[k])

    def memory(self) -> dict[str, int]:
        """Bytes of model states this rank holds: ``{"params", "grads", "optimizer", "total"}``
        (distinct storages, as :func:`minipar.zero.held_state_bytes` counts them)."""
        return self.parts.dp.memory()


def build(model: GPT, mesh: ProcessMesh, **kwargs) -> HybridModel:
    """Inside every rank: build ``mesh``'s process groups (if not built yet) and this
    rank's :class:`HybridModel` of the GPT ``model``. Keyword arguments are :class:`HybridModel`'s."""
    return HybridModel(model, mesh, **kwargs)
