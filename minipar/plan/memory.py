"""Memory per GPU of one layout, by component: model states (parameters, gradients, optimizer
state), activations, communication buffers, and ZeRO-3's policies and HSDP (:func:`zero3_states`).
What the estimate must match is measured in notebook 10 and in ``tests/test_plan_zero3_pp.py``."""

# Where each component comes from: model states, Rajbhandari et al. 2020 (ZeRO, §3.1 and §5);
# activations, Korthikanti et al. 2022 (§4-5) and, for the micro-batches in flight, Narayanan et
# al. 2021 (§2.2); the uneven cut, the Llama 3 report (§3.3.2); flash attention, Dao et al. 2022.
# ``layout.attention == "auto"`` here, where no accelerator is named, is materialized
# (:func:`minipar.plan.predict` resolves it for its GPU first). What each must hold is the
# contract above each function; how it is counted is in the hints (``minipar.hint("ex10")``).
from __future__ import annotations

import math

from ..cost.pipeline import peak_activations
from ..cost.recompute import ATTENTION_TERMS
from ..cost.tensor_parallel import activation_terms
from ..cost.zero import zero_bytes_per_rank
from .layout import Layout
from .models import ModelSpec

BUCKET = 25e6


# Contract:
# Given: ``cost.activation_terms`` (Korthikanti et al.'s terms of one GPT layer, by the tensor each
#     keeps) and ``cost.recompute_activation_bytes`` (their sum, with recomputation).
# ex10.A.measured: on one process, the course's GPT blocks (fp32, materialized attention, each
#     recomputation) keep within 3% of what ``minipar.activations.SavedActivations`` measures
#     autograd saving for one block (the numbers are in the graded test).
# ex10.A.gpt: for a GPT (K and V as wide as Q, an MLP of two h × 4h matrices, no experts, on one
#     GPU's whole sequence) with materialized attention (the a·s² scores kept), the bytes are
#     ``cost.recompute_activation_bytes`` for the layout's tp, sequence parallelism and recomputation.
# ex10.A.shapes: every term scales with the tensors it counts, their width and how many there are,
#     and no other term changes: Llama 3 8B (grouped-query K and V, a SwiGLU MLP of three
#     h × 14336 matrices, no dropout) keeps 34·sbh bytes a layer with selective recomputation at
#     s = 8192.
# ex10.A.experts: the tensors inside an expert count once for every expert a token visits, the
#     MLP's input and the dropout mask after the MLP once a token (Mixtral 8x7B, top-2 of 8: 55·sbh
#     under the same conditions).
# ex10.A.cp: a GPU of a context-parallel group keeps what its own share of the tokens needs
#     (s/cp of them), under every recomputation, full included, and its queries meet every key of
#     the sequence.
# ex10.A.flash: neither flash attention nor selective recomputation keeps a term that grows with
#     s². Flash attention keeps, per row and head, one fp32 log-sum-exp, heads split over tp, under
#     no recomputation and selective recomputation; under full recomputation a layer keeps what it
#     keeps with materialized attention, no log-sum-exp. Flash attention keeps no attention-dropout
#     mask (it draws it again in backward), but a model with dropout still keeps, flash or not, the
#     masks of the dropouts after the attention projection and after the MLP (1 byte an element).
def layer_activation_bytes(model: ModelSpec, layout: Layout, seq_len: int) -> float:
    """Bytes one layer keeps per micro-batch on one GPU (Korthikanti et al.'s terms, shaped
    for ``model``; for a GPT they are exactly :func:`minipar.cost.recompute_activation_bytes`)."""
    # >>> ex10 A
    # Korthikanti et al.'s sbh(34 + 5as/h) by term, on the GPU's s/cp tokens, each term scaled to
    # the model's shape (grouped-query K and V, the MLP's width and gating, top-k experts).
    # Materialized attention keeps the a·s² terms; flash keeps Q, K, V, O (already counted) and
    # the per-row log-sum-exp, 4·a·s·b/t bytes (fp32), under any recomputation but full.
    L, h = layout, model.hidden
    s, e, t = seq_len // L.cp, L.bytes_per_element, L.tp
    if L.recompute == "full":
        return e * s * L.micro_batch * h / (t if L.sp else 1)
    terms = activation_terms(s, L.micro_batch, h, model.n_head, t, L.sp,
                             bytes_per_element=e, dropout=model.dropout)
    terms["Q, K, V"] *= (h + 2 * model.kv_dim) / (3 * h)
    terms["GeLU input and output"] *= (model.ffn_width / (4 * h)) * (1.5 if model.gated else 1.0) * model.top_k
    flash = L.attention_on() == "flash"
    for k in ATTENTION_TERMS:            # each GPU's s/cp queries against all s keys
        if k in terms:
            terms[k] = 0.0 if L.recompute == "selective" or flash else terms[k] * L.cp
    if flash:                            # the per-row log-sum-exp, fp32, per head
        terms["log-sum-exp"] = 4 * s * L.micro_batch * model.n_head / t
    return sum(terms.values())
    # <<< ex10 A


# Contract:
# Given: returns ``{"params", "grads", "optimizer"}``; ``cost.zero_bytes_per_rank`` is there.
# ex10.B.measured: on the course's GPT (fp32 AdamW) each component is within 5% of the mean over
#     the ranks of what ``hybrid.train`` measures, on every layout the graded test ran (dp, tp, pp,
#     cp and ZeRO 0-3; the numbers are in the test and notebook 10). The test gives your function a
#     spec of that GPT whose ``num_params()`` is its real Ψ, 27,552 elements, every bias and norm
#     counted (``ModelSpec``'s own count, 25,600, leaves out biases, norms and position
#     embeddings): what is compared is your bytes for that Ψ against the bytes measured. The mean
#     over the ranks counts no padding (see ex10.B.zero).
# ex10.B.bytes: bf16 mixed precision keeps 16-bit parameters and gradients beside an fp32
#     master copy and Adam's two moments; fp32 keeps no master copy.
# ex10.B.zero: ZeRO stage 1, 2, 3 shards the optimizer state, then the gradients, then the
#     parameters over every rank that holds a copy of the same parameters, and no further; a
#     shard is an exact N-th of what the N ranks share, unpadded, even when N does not divide it.
# ex10.B.local: a GPU holds only its tensor- and pipeline-parallel share of the dense parameters,
#     the embedding and the head included.
# ex10.B.experts: every ep group holds each expert once (E/ep experts a rank), cut like the dense
#     parameters by tensor and pipeline parallelism; the ranks that hold a copy of the same experts
#     are the group ZeRO shards their states over (ex10.B.zero).
def model_state_bytes(model: ModelSpec, layout: Layout) -> dict[str, float]:
    """``{"params", "grads", "optimizer"}`` bytes per GPU (ZeRO formulas on the local share)."""
    # >>> ex10 B
    # A GPU holds Ψ/(tp·pp) of the dense parameters and Ψ_experts/(tp·pp·ep) of the experts';
    # 16-bit parameters and gradients with K = 12 (fp32 master and two moments), fp32 K = 8;
    # ZeRO shards over dp·cp (dp·cp/ep for the experts), unpadded (the mean over the ranks).
    L, e = layout, layout.bytes_per_element
    k = 12 if e == 2 else 8
    experts = model.n_layer * model.n_experts * model.expert_params() if model.n_experts > 1 else 0
    dense = model.num_params() - experts
    parts = [zero_bytes_per_rank(dense / (L.tp * L.pp), L.dp * L.cp, L.zero, k, e, padded=False)]
    if experts:
        parts.append(zero_bytes_per_rank(experts / (L.tp * L.pp * L.ep), L.dp * L.cp // L.ep,
                                         L.zero, k, e, padded=False))
    return {c: sum(p[c] for p in parts) for c in ("params", "grads", "optimizer")}
    # <<< ex10 B


# Contract:
# Given: returns the bytes on the busiest GPU by component. Your part builds ``out``, a dict
#     holding ``model_state_bytes``' three components and ``"activations"``; the code after it adds
#     ``"buffers"``, replaces the model states by ``zero3_states``' under HSDP or a ZeRO-3 that keeps
#     a stage's parameters gathered, and adds ``"total"``.
#     ``cost.peak_activations`` gives the micro-batches a pipeline rank holds at its peak, and
#     ``Layout.microbatches`` the micro-batches of one step.
# ex10.C.in_flight: ``activations`` is what the busiest pipeline stage holds at its peak, every
#     stage counted with its own layers (``stage_layers``, uneven cuts too) and its own micro-batches
#     in flight, of the micro-batches one data-parallel rank runs in a step.
# ex10.C.last_stage: under every schedule (1F1B, GPipe, interleaved 1F1B, ZB-H1), the last of two or
#     more stages is counted as 1F1B runs it, each micro-batch's whole backward right after its
#     forward: one micro-batch in flight (on the last rank, its whole stage's layers once).
# ex10.C.recompute: full recomputation rebuilds one layer at a time during backward, everything
#     that layer would keep without recomputation (with the same attention), on whichever stage is
#     the busiest, one stage or several.
# ex10.C.logits: the last stage also holds one micro-batch's fp32 logits, as this GPU holds them
#     (its share of the vocabulary and of the tokens).
# ex10.C.one_stage: with one stage, the first stage is the last: it holds the logits, and the
#     micro-batches in flight of the schedule's one rank (all of them under GPipe, which runs every
#     forward before the first backward); the rule of ex10.C.last_stage is for two or more stages.
def memory_per_gpu(model: ModelSpec, layout: Layout, seq_len: int, global_batch: int) -> dict[str, float]:
    """Bytes on the busiest GPU: ``{"params", "grads", "optimizer", "activations", "buffers", "total"}``
    (the contract above; ZeRO-3's policy and HSDP through :func:`zero3_states`)."""
    L = layout
    # >>> ex10 C
    # Stage r holds peak_activations(schedule, p, m, r, v)/v stages' worth of micro-batches of its
    # own layers; the last of several stages is charged one (1F1B runs each backward right after
    # its forward); full recomputation adds one layer's "none" activations; the last stage adds
    # one micro-batch's fp32 logits, 4·(s/cp)·b·V/t. The busiest stage counts.
    out = model_state_bytes(model, L)
    m = L.microbatches(global_batch)
    per_layer = layer_activation_bytes(model, L, seq_len)
    rebuilt = layer_activation_bytes(model, L.replace(recompute="none"), seq_len) if L.recompute == "full" else 0.0
    logits = 4 * (seq_len // L.cp) * L.micro_batch * model.vocab / L.tp
    act = 0.0
    for r, layers in enumerate(stage_layers(model.n_layer, L.pp)):
        in_flight = 1 if (r == L.pp - 1 and r > 0) else peak_activations(L.schedule, L.pp, m, r, L.v) / L.v
        held = in_flight * layers * per_layer + rebuilt + (logits if r == L.pp - 1 else 0.0)
        act = max(act, held)
    out["activations"] = act
    # <<< ex10 C
    # kept gathered, the buffers' one gathered layer is part of the whole stage zero3_states counts
    out["buffers"] = comm_buffer_bytes(model, _without_gathered_layer(L), seq_len)
    if L.hsdp or L.kept_gathered:
        out.update(zero3_states(model, L))
    out["total"] = sum(out.values())
    return out


def _without_gathered_layer(layout: Layout) -> Layout:
    """``layout`` whose buffers hold no gathered layer when it keeps a stage's parameters gathered."""
    return layout.replace(zero=0, dp_shard=None, reshard_after_forward="auto") if layout.kept_gathered else layout


def zero3_states(model: ModelSpec, layout: Layout) -> dict[str, float]:
    """``{"params", "grads", "optimizer"}`` bytes per GPU at the peak of a ZeRO-3 step with the
    layout's policy (``Layout.reshard_after_forward``) and HSDP split (``Layout.dp_shard``): the
    shards of stage 3 over each replica's ranks only, and kept gathered (the default under a
    pipeline), the stage's whole parameters and gradients beside the shards, which sits above
    ZeRO-1, not between ZeRO-1 and ZeRO-3 (measured by ``hybrid.run``'s ``peak_state_bytes``).
    Resharding is FSDP's steady state: stage 3's states and one gathered layer among the buffers."""
    # Kept gathered, a stage's parameters stay whole from its first forward to the reduce-scatter
    # after its last backward, its gradients accumulate whole on them: params eΨ/N + eΨ, grads eΨ,
    # optimizer KΨ/N (Ψ the stage's share; minipar.cost.zero3_pipeline_peak_bytes). Resharding also
    # holds, at a unit's reduce-scatter, the prefetched unit and its whole gradients (2eΨ/l more),
    # which this count leaves out.
    L = layout
    shards = model_state_bytes(model, L.replace(dp=L.dp // L.dp_replicate, dp_shard=None))
    if not L.kept_gathered:
        return shards
    whole = model_state_bytes(model, L.replace(zero=0, dp_shard=None, reshard_after_forward="auto"))
    return {"params": shards["params"] + whole["params"], "grads": whole["grads"],
            "optimizer": shards["optimizer"]}


# Contract:
# ex10.C.even: stages get l/p layers each when p divides l.
# ex10.C.uneven: otherwise ⌈l/p⌉, and the stages that hold one fewer are, in this order, the
#     first, the last, then the second, the third, the fourth, ... (counting up from the front,
#     never the second-to-last before every other stage has one fewer).
def stage_layers(n_layer: int, pp: int) -> list[int]:
    """Layers of each pipeline stage (the contract above): the first stage holds the most
    micro-batches in flight and the last adds the head and the loss, which is why Llama 3 cut its
    126 layers over 16 stages unevenly (Llama Team 2024, §3.3.2)."""
    # >>> ex10 C
    q, fewer = -(-n_layer // pp), -(-n_layer // pp) * pp - n_layer
    out = [q] * pp
    for r in ([0, pp - 1] + list(range(1, pp - 1)))[:fewer]:
        out[r] -= 1
    return out
    # <<< ex10 C


# Contract:
# ex10.C.bucket: a 25 MB gradient bucket when dp·cp > 1.
# ex10.C.sp_input: whenever tp > 1, one (s/cp, b, h) tensor of a layer's input, whole on the GPU for
#     the tensor-parallel matmuls (all-gathered under sequence parallelism): the same bytes with
#     sequence_parallel True or False; none when tp = 1.
# ex10.C.boundary: a pipeline stage's two boundary activations when pp > 1 (over tp with sequence
#     parallelism, whole without it).
# ex10.C.zero3: ZeRO-3's one gathered layer (Ψ/l over tp), Ψ the whole model's ``num_params()``:
#     with experts, every expert of the model is counted, whatever ep (not only a rank's E/ep).
def comm_buffer_bytes(model: ModelSpec, layout: Layout, seq_len: int) -> float:
    """The buffers collectives need beside the model states and activations."""
    # >>> ex10 C
    L = layout
    e, sbh = L.bytes_per_element, (seq_len // L.cp) * L.micro_batch * model.hidden
    out = BUCKET if L.dp * L.cp > 1 else 0.0
    if L.tp > 1:
        out += e * sbh
    if L.pp > 1:
        out += 2 * e * sbh / (L.tp if L.sp else 1)
    if L.zero == 3:
        out += e * (model.num_params() / model.n_layer) / L.tp
    return out
    # <<< ex10 C


def _gathered_layer(model: ModelSpec, layout: Layout) -> float:
    """The bytes of ZeRO-3's one gathered layer when it reshards (what :func:`comm_buffer_bytes`
    adds for ZeRO-3), 0 otherwise."""
    if layout.zero != 3 or layout.kept_gathered:
        return 0.0
    without = layout.replace(zero=0, dp_shard=None, reshard_after_forward="auto")
    return comm_buffer_bytes(model, layout, 1) - comm_buffer_bytes(model, without, 1)


def model_states_at_peak(model: ModelSpec, layout: Layout) -> float:
    """Bytes of model states per GPU at the step's peak: :func:`memory_per_gpu`'s params, grads and
    optimizer, and ZeRO-3's gathered layer, which it counts among the buffers when resharding (what
    ``hybrid.run`` measures as ``peak_state_bytes``, less the prefetched unit and one unit's gradients)."""
    L = layout
    states = zero3_states(model, L) if (L.hsdp or L.kept_gathered) else model_state_bytes(model, L)
    return sum(states.values()) + _gathered_layer(model, L)
