"""A mixture-of-experts MLP on one device: router, E expert MLPs, combine.

Shazeer et al. 2017, GShard (Lepikhin et al. 2020), Switch Transformer (Fedus et al. 2021).
For every token x (S tokens, hidden size h):

    p = softmax(x W_r)                        router probabilities over the E experts (fp32)
    (w, e) = top_k(p)                         the k chosen experts and their probabilities
    w <- w / Σ w          (k > 1)             top-k weights renormalised to sum to 1 (GShard, Mixtral);
                                              with k = 1 the raw probability is kept (Switch),
                                              since renormalising would make it 1 and cut the
                                              router off from the loss's gradient
    y = Σ_j w_j · E_{e_j}(x)                  combine: the weighted outputs of the chosen experts

**Capacity** (GShard §2.2). With ``capacity_factor`` c, every expert takes at most

    C = ceil(k · S / E · c)

assignments. Policy: by position. An expert keeps the first C tokens routed to it in token
order (the flattened ``(B, T)`` order, which is the ranks' shards concatenated in rank
order) and drops the rest; a dropped assignment contributes nothing (the other weights are
not renormalised), and the block's residual connection carries the token on unchanged.
``capacity_factor=None`` is dropless: every assignment is computed.

**Auxiliary load-balancing loss** (Switch eq. 4, GShard's top-k form):

    aux = E · Σ_i f_i · P_i,   f_i = (assignments routed to i) / (k·S),  P_i = mean_tokens p_i

f_i counts routing before dropping and carries no gradient; aux = 1 when routing is uniform.
**Router z-loss** (ST-MoE, Zoph et al. 2022 eq. 5): z = mean_tokens (logsumexp(x W_r))².
The layer leaves ``aux_coef · aux + z_coef · z`` in ``self.loss``; the GPT adds it to its loss.

**Inside a pipeline** a stage holding an MoE layer never sees the model's loss, so the layer
adds its own: with ``aux_scale`` set (1/m for m micro-batches, :mod:`minipar.hybrid.experts`) the
output carries ``aux_scale · self.loss`` into backward (:class:`AuxLoss`: forward is the
identity, backward also gives the auxiliary loss the gradient ``aux_scale``), and
``aux_total`` sums ``aux_scale · self.loss`` over the micro-batches (the value of its part of
the batch's loss), ``routed`` the assignments per expert. Capacity and f_i are then counted
per micro-batch, as in production systems.
"""
from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    """One expert: the GPT's MLP, ``proj(gelu(fc(x)))``."""

    def __init__(self, h: int, hidden: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(h, hidden), nn.Linear(hidden, h)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """C = ceil(k·S/E · factor) assignments per expert; ``None`` when dropless.

    Computed in exact rational arithmetic, the factor taken as the decimal it is written as
    (``Fraction(str(1.1))`` = 11/10): in floating point ``2·50/2·1.1`` is 55.00000000000001
    and would round up to 56."""
    if capacity_factor is None:
        return None
    c = Fraction(str(capacity_factor))
    return -(-(top_k * n_tokens * c.numerator) // (n_experts * c.denominator))


def route(logits: torch.Tensor, top_k: int):
    """Router probabilities ``p`` (S, E, fp32), top-k weights (S, k) and experts (S, k)."""
    probs = logits.float().softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def keep_within_capacity(expert_of: torch.Tensor, n_experts: int, cap: int | None,
                         before: torch.Tensor | None = None) -> torch.Tensor:
    """Which assignments (flat, in token order) an expert keeps: the first ``cap`` per expert.
    ``before[i]``: how many assignments to expert i come ahead of these ones in the order
    capacity counts in; zero (``None``) on one device."""
    if cap is None:
        return torch.ones_like(expert_of, dtype=torch.bool)
    one_hot = F.one_hot(expert_of, n_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1          # 0, 1, 2... within each expert
    if before is not None:
        position = position + before.to(expert_of.device)[expert_of]
    return position < cap


def balance_loss(probs: torch.Tensor, expert_of: torch.Tensor, n_experts: int,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
    """E · Σ f_i P_i with ``counts`` the assignments per expert over the whole batch
    (given under expert parallelism, where a rank sees only its own tokens)."""
    if counts is None:
        counts = torch.bincount(expert_of, minlength=n_experts)
    f = counts.to(probs.dtype) / counts.sum()
    return n_experts * (f.detach() * probs.mean(dim=0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean (logsumexp of the router logits)²."""
    return logits.float().logsumexp(dim=-1).square().mean()


class AuxLoss(torch.autograd.Function):
    """``y`` unchanged; in backward the auxiliary loss ``aux`` gets the gradient ``scale``, as if
    ``scale · aux`` had been added to the model's loss (the layer's output carries it)."""

    @staticmethod
    def forward(ctx, y, aux, scale: float):
        ctx.scale, ctx.aux = scale, (aux.shape, aux.dtype, aux.device)
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """Drop-in for the GPT's MLP: ``(B, T, h) -> (B, T, h)``; ``self.loss`` the weighted
    auxiliary losses of the last forward, ``self.stats`` its routing (counts, drops)."""

    def __init__(self, h: int, n_experts: int = 8, top_k: int = 2, capacity_factor: float | None = None,
                 aux_coef: float = 0.01, z_coef: float = 0.0, hidden: int | None = None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_coef, self.z_coef = aux_coef, z_coef
        self.router = nn.Linear(h, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(h, hidden or 4 * h) for _ in range(n_experts))
        self.loss, self.stats = None, {}
        self.aux_scale, self.aux_total, self.routed = None, 0.0, None

    def with_aux_loss(self, y: torch.Tensor) -> torch.Tensor:
        """``y``, carrying ``aux_scale · self.loss`` into backward when ``aux_scale`` is set."""
        if self.aux_scale is None or self.loss is None:
            return y
        self.aux_total = self.aux_total + self.loss.detach() * self.aux_scale   # stays on the device
        counts = self.stats["counts"]                     # the micro-batch's, over its ranks
        self.routed = counts.clone() if self.routed is None else self.routed + counts
        return AuxLoss.apply(y, self.loss, self.aux_scale)

    def aux_losses(self, logits, probs, expert_of, counts=None):
        """Set ``self.loss`` = aux_coef · aux + z_coef · z; returns (aux, z)."""
        aux = balance_loss(probs, expert_of, self.n_experts, counts)
        z = z_loss(logits)
        self.loss = self.aux_coef * aux + self.z_coef * z
        return aux, z

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                  # (S, h), token order
        logits = self.router(x)
        probs, weights, experts = route(logits, self.top_k)
        expert_of = experts.reshape(-1)                               # (S·k,) assignments
        token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        cap = capacity(x.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        keep = keep_within_capacity(expert_of, self.n_experts, cap)
        aux, z = self.aux_losses(logits, probs, expert_of)
        y = torch.zeros_like(x)
        w = weights.reshape(-1, 1)
        E = self.n_experts
        slot = torch.where(keep, expert_of, E)                        # a dropped assignment: "expert" E
        kept = torch.bincount(slot, minlength=E + 1)[:E]
        sizes = kept.tolist()                                         # the layer's one host read
        by_expert = torch.argsort(slot, stable=True)[:sum(sizes)]     # grouped by expert, token order within
        for expert, sel in zip(self.experts, by_expert.split(sizes)):   # every expert, on no rows too:
            out = expert(x[token_of[sel]]) * w[sel].to(x.dtype)           # one no token chose gets a zero
            y = y.index_add(0, token_of[sel], out)                          # gradient, as in every layout
        self.stats = {"counts": torch.bincount(expert_of, minlength=E), "kept": kept,  # on the device
                      "dropped": ~keep, "experts": experts.detach(),
                      "aux": aux.detach(), "z": z.detach(), "capacity": cap}
        return self.with_aux_loss(y.reshape(shape))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model`` (in module order), including expert-parallel ones."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_loss(model: nn.Module):
    """Σ over the model's MoE layers of their weighted auxiliary losses (last forward)."""
    return sum((m.loss for m in moe_layers(model) if m.loss is not None), 0.0)
