"""Expert parallelism on the mesh: EP × DP × CP × PP × TP, and what equivalence means there.

**The definition.** A pipeline cuts every dp shard into m micro-batches, and an MoE layer
only ever sees one micro-batch at a time. So, as in production systems (GShard's groups,
Megatron-Core, DeepSeek-V3), routing statistics are per micro-batch: for micro-batch i (the
i-th micro-batch of every dp shard, together: :func:`micro_batches`) every MoE layer counts

    capacity  C_i = ceil(k · S_i / E · c)         S_i the micro-batch's tokens
    aux_i     = E · Σ_e f_{i,e} · P_{i,e}          f, P over the micro-batch's tokens

and the batch's loss is L = 1/m Σ_i (ℓ_i + aux_coef · aux_i + z_coef · z_i). The reference is
one process that accumulates the same m micro-batches (:func:`moe_reference`); with m = 1 it
is the ordinary single-process step. The mesh reproduces it:

* every MoE layer becomes :class:`~minipar.expert_parallel.ExpertParallelMoE` over the rank's
  ep group (carved out of dp·cp, :class:`~minipar.mesh.ProcessMesh`), f summed over the whole
  dp·cp group (``token_group``), P this rank's: the mean over the dp·cp ranks of each rank's
  aux is aux_i;
* the auxiliary loss rides on the layer's output (``aux_scale = 1/m``,
  :class:`minipar.models.moe.AuxLoss`): the stage that holds the layer adds its gradient,
  whichever stage computes ℓ_i;
* dense gradients are averaged over dp·cp; an expert's are summed over its expert-dp group
  and divided by dp·cp (each rank's loss is the mean of its own S/(dp·cp) tokens: the sum
  gathers every token once, ÷ dp·cp makes it the global mean); an expert no token of the
  whole batch chose gets a zero gradient, as in one process (:class:`minipar.models.moe.MoE`
  runs every expert, on no rows too), so every optimizer steps every expert every step.

Capacity is counted over the ep group's tokens, by position in rank order: it equals the
reference's only when the ep group holds the whole micro-batch in token order, ep = dp and
cp = 1 (:func:`check` says so otherwise).
"""
from __future__ import annotations

import torch

from .. import comm, precision, strategy
from ..runtime.backend import device as rank_device
from ..data import shard
from ..expert_parallel import shard_experts as shard_experts_over
from ..models.moe import MoE, moe_layers
from ..reference import place, sgd, trained_params


def micro_batches(t: torch.Tensor, dp: int, m: int) -> list[torch.Tensor]:
    """The m micro-batches of the global batch ``t``: micro-batch i is the i-th of the m chunks
    of every dp shard, concatenated in dp order (the rows the mesh's ranks hold at step i)."""
    chunks = [shard(t, d, dp).chunk(m) for d in range(dp)]
    return [torch.cat([c[i] for c in chunks]) for i in range(m)]


def moe_reference(model, batches, make_optimizer=None, dp: int = 1, microbatches: int = 1,
                    dtype=None) -> dict:
    """One process, the stated reference of the mesh (module docstring): every step
    accumulates the gradients of the m micro-batches (:func:`micro_batches`), each loss
    (cross-entropy plus its own auxiliary losses) divided by m, then steps once. Returns
    ``{"losses", "params"}`` as :func:`minipar.reference.train_reference`, and trains ``model``
    itself on the ranks' device, as it does (:func:`minipar.reference.place`)."""
    precision.resolve(dtype)
    here = place(model, rank_device())
    opt = (make_optimizer or sgd())(model.parameters())
    losses = []
    for x, y in batches:
        x, y = x.to(here), y.to(here)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(micro_batches(x, dp, microbatches), micro_batches(y, dp, microbatches)):
            with strategy.forward(dtype, here):
                loss = model(xm, ym) / microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return {"losses": losses, "params": trained_params(model)}


def is_expert(name: str) -> bool:
    """An expert's parameter (sharded over ep, reduced over expert-dp), by single-device name."""
    return ".experts." in name


def shard_experts(model, groups: dict, mesh, microbatches: int):
    """Every MoE layer of ``model`` (in place) over this rank's ep group, f summed over dp·cp,
    its auxiliary loss carried by its output with weight 1/m."""
    token_group = groups["dp_cp"] if mesh.dp * mesh.cp > mesh.ep else None
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is MoE:
                child.aux_scale = 1.0 / microbatches
    shard_experts_over(model, groups["ep"], token_group)
    return model


def apply_ep(model, groups: dict, mesh, plan, register=None):
    """The composition's third step: a mixture-of-experts GPT's experts over ``groups["ep"]``
    (:func:`shard_experts`, the auxiliary loss per micro-batch); a dense GPT is left as it is. With
    experts it registers its part of the step (``register``, :meth:`~minipar.hybrid.parallelize.
    Parallelized.register`): the routing counts reset before the micro-batches (:func:`begin_step`),
    this rank's auxiliary losses added to its loss (:func:`aux_value`). Their gradients are data
    parallelism's to reduce (:mod:`.sharding`: over expert-dp, under every ZeRO stage)."""
    if any(type(m) is MoE for m in model.modules()):   # (a tensor-parallel GPT's config says moe_every=0)
        shard_experts(model, groups, mesh, plan.microbatches)
        if register is not None:
            register(start=lambda: begin_step(model), loss=lambda: aux_value(model))
    return model


def begin_step(model) -> None:
    """Forget the last step's auxiliary loss and routing counts."""
    for m in moe_layers(model):
        m.aux_total, m.routed = 0.0, None


def aux_value(model) -> float:
    """This rank's part of the batch's loss from its MoE layers: Σ_i aux_scale · loss_i."""
    return float(sum(m.aux_total for m in moe_layers(model)))   # one read per step, not per forward


def reduce_expert_gradients(model, params: dict, group, n_tokens_ranks: int) -> None:
    """Expert gradients (``params``: name -> parameter, this rank's experts): summed over
    the expert-dp ``group``, ÷ dp·cp (``n_tokens_ranks``); an expert no token of the batch
    chose ends with a zero gradient, as in one process."""
    comm.all_reduce_gradients([p for n, p in params.items() if is_expert(n)], group=group, divide_by=n_tokens_ranks,
                              skip_alone=True, name="expert_grads", dim="dp", reduced_over="expert_dp")


def scale_expert_gradients(model, params: dict, factor: float) -> None:
    """Under ZeRO-1 (which averages over expert-dp itself): expert gradients × ``factor``
    (1/ep, so that the mean over the dp·cp/ep replicas becomes the sum ÷ dp·cp)."""
    for n, p in params.items():
        if is_expert(n) and p.grad is not None:
            p.grad.mul_(factor)


class Optimizers:
    """Several optimizers stepped as one (ZeRO-1 of the dense parameters over dp·cp and of the
    experts over expert-dp): ``parts``; ``optim``/``shards`` are the first part's (the
    checkpoint reads every part, :func:`minipar.production.checkpoint.local_pieces`)."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.optim = getattr(self.parts[0], "optim", self.parts[0])
        self.param_groups = [g for o in self.parts for g in o.param_groups]

    @property
    def shards(self):
        return [s for o in self.parts for s in getattr(o, "shards", [])]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.parts:
            o.step()

    def unit_sizes(self) -> list[int]:
        return [n for o in self.parts if hasattr(o, "unit_sizes") for n in o.unit_sizes()]
