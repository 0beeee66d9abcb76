"""Exercise 10: where the memory of one GPU goes, for one parallel layout.

``memory_per_gpu(model, layout, seq_len, global_batch)`` returns the bytes on the busiest GPU
by component, and the planner (``minipar.plan.predict`` and ``search``) rejects every
layout whose total does not fit. You write all of it but the final sum. The formulas you need
from earlier chapters are there already: ``cost.activation_terms`` (Korthikanti et al.'s terms
of one layer), ``cost.zero_bytes_per_rank`` (the ZeRO stages) and ``cost.peak_activations``
(the micro-batches a pipeline rank holds at its peak).

A. ``layer_activation_bytes(model, layout, seq_len)``: the bytes one layer keeps per
   micro-batch on one GPU. For a GPT they are exactly ``cost.recompute_activation_bytes`` on
   the layout's tp, sequence parallelism and recomputation; for other shapes the terms scale:
   grouped-query K and V (Q, K, V is h + 2·kv_dim wide, not 3h), the MLP's width and gating
   (ffn/4h, × 1.5 for a gated MLP, × top_k for the experts a token visits). Everything is
   counted on the GPU's s/cp tokens, and the attention scores of those s/cp queries span all s
   keys. Selective recomputation keeps no attention-score term; flash attention keeps no score
   term either, and adds the fp32 log-sum-exp, 4·(s/cp)·b·a/t bytes.
B. ``model_state_bytes(model, layout)``: ``{"params", "grads", "optimizer"}``. A GPU holds
   Ψ/(tp·pp) of the dense parameters and Ψ_experts/(tp·pp·ep) of the experts'; 2 + 2 + 12 bytes
   per parameter in bf16, 4 + 4 + 8 in fp32; ZeRO stage 1, 2, 3 divides the optimizer state, then
   the gradients, then the parameters by the dp·cp ranks, and the experts' by dp·cp/ep.
C. ``stage_layers(n_layer, pp)``, ``comm_buffer_bytes(model, layout, seq_len)`` and the
   ``activations`` of ``memory_per_gpu``. Stages get l/p layers each when p divides l; otherwise
   ⌈l/p⌉, and the stages that hold one fewer are the first and the last, then the second, the
   third, ... ``activations`` is what the busiest pipeline stage holds at its peak: stage r holds
   its ``stage_layers`` for the micro-batches in flight on it, the last stage (with pp > 1) one;
   full recomputation also rebuilds one layer's full activations during backward; the last
   stage also holds one micro-batch's fp32 logits (sharded over tp, on the GPU's s/cp tokens);
   with one stage, the first stage is the last. The buffers are a 25 MB gradient bucket when
   dp·cp > 1, the all-gathered (s/cp, b, h) input of a sequence-parallel layer when tp > 1, a
   pipeline stage's two boundary activations when pp > 1 (over tp with sequence parallelism),
   and ZeRO-3's one gathered layer (Ψ/l over tp).

Derived in notebook 10, "Where the memory goes" (ZeRO, Rajbhandari et al. 2020, §3.1;
Korthikanti et al. 2022, §4-5 and Table 2; Narayanan et al. 2021, §2.2 for the micro-batches
in flight; the Llama 3 report, §3.3.2, for the uneven cut). The tests compare with the formulas
on GPT-3 1.3B, Llama 3 8B and Mixtral 8x7B. Stuck? ``minipar.hint("ex10", "A")`` (or "B",
"C") gives a nudge, then the idea, then the pseudo-code. Grade it with
``python -m minipar.grade ex10``.
"""
import math

import pytest

from minipar import cost, plan
from minipar.plan.memory import comm_buffer_bytes, stage_layers
from minipar.course.grading import expect_equal, observes

EXERCISE = "ex10_planning"
HINTS = {
    "A": ("Start from Korthikanti et al.'s terms on the GPU's own tokens. Which of them depend on the "
          "model's shape beyond h and a, and which hold the s² scores?",
          "Take cost.activation_terms on s/cp tokens (tp, sp, bytes per element, dropout as the model "
          "has it); scale \"Q, K, V\" by (h + 2·kv_dim)/(3h) and \"GeLU input and output\" by (ffn/4h) "
          "(× 1.5 gated) × top_k. The score terms (ATTENTION_TERMS) are s/cp queries against s keys: "
          "× cp, or 0 under selective recomputation or flash attention. Full recomputation keeps only "
          "each layer's input.",
          "full: return e·(s/cp)·b·h / (tp if sp else 1). Else terms = activation_terms(s/cp, b, h, a, tp, "
          "sp, bytes_per_element=e, dropout=model.dropout); terms['Q, K, V'] *= (h + 2·kv)/(3h); "
          "terms['GeLU input and output'] *= ffn/(4h)·(1.5 if gated)·top_k; for each score term: 0 if "
          "selective or flash else × cp; with flash add 4·(s/cp)·b·a/tp; return the sum."),
    "B": ("Which parameters does one GPU hold at all, before ZeRO divides anything?",
          "Split Ψ into the experts' (n_layer·E·expert_params, for an MoE model) and the rest. The dense "
          "part is cut by tp·pp and ZeRO-sharded over dp·cp; the experts by tp·pp·ep and sharded over "
          "dp·cp/ep. K = 12 optimizer bytes per parameter in bf16, 8 in fp32.",
          "k = 12 if e == 2 else 8; parts = [zero_bytes_per_rank(dense/(tp·pp), dp·cp, zero, k, e, "
          "padded=False)] (+ zero_bytes_per_rank(experts/(tp·pp·ep), dp·cp//ep, ...)); return the sums "
          "of params, grads and optimizer over the parts."),
    "C": ("Start from the model states, then ask: how many micro-batches of how many layers does "
          "each stage hold at once, and what does the last stage hold besides its layers?",
          "m = global_batch / (dp·b) micro-batches; stage r holds peak_activations(schedule, pp, m, r, "
          "v) / v of them, each of its stage_layers(l, pp)[r] layers; with pp > 1 the last stage holds "
          "one micro-batch of its layers (1F1B's last stage runs each backward right after its "
          "forward); full recomputation adds one layer with recompute=\"none\"; the logits are "
          "4·(s/cp)·b·V/tp bytes. For the cut, ⌈l/p⌉ each, then take one from stages 0, p-1, 1, 2, ... "
          "until the sum is l.",
          "out = model_state_bytes(model, L); for r, layers in enumerate(stage_layers(l, pp)): in_flight "
          "= 1 on the last of several stages, else peak_activations(L.schedule, L.pp, m, r, L.v) / L.v; "
          "held = in_flight·layers·per_layer + rebuilt (+ logits on the last stage); "
          "out[\"activations\"] = the largest held. Buffers: BUCKET if dp·cp > 1; + e·sbh if tp > 1; "
          "+ 2·e·sbh/(tp if sp else 1) if pp > 1; + e·Ψ/l/tp under ZeRO-3 (sbh on s/cp tokens)."),
}
CONTRACT = {
    "For a GPT they are exactly ``cost.recompute_activation_bytes``": "test_layer_activations_of_a_gpt",
    "grouped-query K and V (Q, K, V is h + 2·kv_dim wide, not 3h), the MLP's width and gating":
        "test_layer_activations_of_other_shapes",
    "× top_k for the experts a token visits": "test_layer_activations_of_other_shapes",
    "the attention scores of those s/cp queries span all s keys": "test_layer_activations_with_cp",
    "flash attention keeps no score term either, and adds the fp32 log-sum-exp": "test_layer_activations_with_cp",
    "2 + 2 + 12 bytes per parameter in bf16, 4 + 4 + 8 in fp32": "test_model_states",
    "ZeRO stage 1, 2, 3 divides the optimizer state, then the gradients, then the parameters by the dp·cp ranks":
        "test_model_states",
    "Ψ/(tp·pp) of the dense parameters and Ψ_experts/(tp·pp·ep) of the experts'": "test_model_states_of_experts",
    "Stages get l/p layers each when p divides l": "test_stage_layers",
    "the stages that hold one fewer are the first and the last, then the second, the third": "test_stage_layers",
    "stage r holds its ``stage_layers`` for the micro-batches in flight on it": "test_pipeline_in_flight",
    "the last stage (with pp > 1) one": "test_last_stage_with_big_logits",
    "full recomputation also rebuilds one layer's full activations during backward":
        "test_full_recompute_adds_one_layer",
    "the last stage also holds one micro-batch's fp32 logits (sharded over tp, on the GPU's s/cp tokens)":
        ("test_activations_without_pipeline", "test_last_stage_with_big_logits"),
    "with one stage, the first stage is the last": "test_activations_without_pipeline",
    "a 25 MB gradient bucket when dp·cp > 1": "test_buffers",
    "the all-gathered (s/cp, b, h) input of a sequence-parallel layer when tp > 1": "test_buffers",
    "a pipeline stage's two boundary activations when pp > 1 (over tp with sequence parallelism)": "test_buffers",
    "ZeRO-3's one gathered layer (Ψ/l over tp)": "test_buffers",
}
LLAMA = plan.MODELS["llama3-8b"]
GPT13 = plan.MODELS["gpt3-1.3b"]
MIXTRAL = plan.MODELS["mixtral-8x7b"]


def _approx(got, want, what):
    """Equal within 1e-9 of each other (floating-point sums in another order), else the numbers."""
    if got != pytest.approx(want, rel=1e-9):
        expect_equal(got, want, what)


def _logits(model, lay, s):
    return 4 * (s // lay.cp) * lay.micro_batch * model.vocab / lay.tp


# ----------------------------------------------------------------------------- A: one layer
@observes('ex10.A.gpt')
def test_layer_activations_of_a_gpt(impl):
    """GPT-3 1.3B: one layer's bytes equal cost.recompute_activation_bytes, for every recomputation,
    with and without tensor and sequence parallelism."""
    s, M = 2048, GPT13
    for tp, sp in ((1, False), (2, False), (4, True)):
        for rc in ("none", "selective", "full"):
            lay = plan.Layout(tp=tp, sequence_parallel=sp, recompute=rc, micro_batch=2, attention="materialized")
            want = cost.recompute_activation_bytes(s, 2, M.hidden, M.n_head, tp, sp and tp > 1, rc)
            _approx(plan.layer_activation_bytes(M, lay, s), want,
                    f"GPT-3 1.3B, s = {s}, b = 2, tp = {tp}, sequence parallel {sp}, recompute={rc!r}: bytes of one layer")


@observes('ex10.A.other_shapes', 'ex10.A.top_k')
def test_layer_activations_of_other_shapes(impl):
    """Llama 3 8B (grouped-query attention, SwiGLU, no dropout) and Mixtral 8x7B (top-2 of 8 experts),
    selective recomputation: one layer's bytes."""
    sbh = 8192 * 4096
    lay = plan.Layout(recompute="selective", attention="materialized")
    # 4 + 4 (norm and linear inputs) + 3 (Q, K, V: (h + 2h/4)/(3h) of 6) + 2 (attention output)
    # + 16 · (14336/16384) · 1.5 = 21 (the gated MLP), in units of sbh
    _approx(plan.layer_activation_bytes(LLAMA, lay, 8192), 34 * sbh,
            "Llama 3 8B, s = 8192, selective: bytes of one layer")
    _approx(plan.layer_activation_bytes(MIXTRAL, lay, 8192), 55 * sbh,
            "Mixtral 8x7B, s = 8192, selective: bytes of one layer")


@observes('ex10.A.cp_scores', 'ex10.A.flash')
def test_layer_activations_with_cp(impl):
    """Llama 3 8B, no recomputation, cp = 2, materialized and flash attention: one layer's bytes."""
    s, a = 8192, LLAMA.n_head
    scores = 2 * a * s * s                 # softmax output, 2 bytes (Llama has no dropout terms)
    for cp in (1, 2):
        lay = plan.Layout(cp=cp, attention="materialized")
        _approx(plan.layer_activation_bytes(LLAMA, lay, s), 34 * (s // cp) * 4096 + scores / cp,
                f"Llama 3 8B, s = {s}, cp = {cp}, materialized: bytes of one layer")
        lay = plan.Layout(cp=cp, attention="flash")
        _approx(plan.layer_activation_bytes(LLAMA, lay, s), 34 * (s // cp) * 4096 + 4 * (s // cp) * a,
                f"Llama 3 8B, s = {s}, cp = {cp}, flash: bytes of one layer")


# ----------------------------------------------------------------------------- B: model states
@observes('ex10.B.model_states', 'ex10.B.zero_stages')
def test_model_states(impl):
    """Model-state bytes per GPU in bf16 and fp32, under ZeRO 0 to 3, tensor, pipeline, data and context
    parallelism."""
    psi = LLAMA.num_params()
    cases = ((plan.Layout(recompute="full"), (2, 2, 12)),
             (plan.Layout(recompute="full", dtype="fp32"), (4, 4, 8)),
             (plan.Layout(dp=8, zero=1), (2, 2, 12 / 8)),
             (plan.Layout(dp=4, cp=2, zero=2), (2, 2 / 8, 12 / 8)),
             (plan.Layout(dp=8, zero=3), (2 / 8, 2 / 8, 12 / 8)),
             (plan.Layout(dp=2, tp=2, pp=2, zero=1), (2 / 4, 2 / 4, 12 / 8)))
    for lay, per in cases:
        m = plan.model_state_bytes(LLAMA, lay)
        for k, b in zip(("params", "grads", "optimizer"), per):
            _approx(m[k], b * psi, f"Llama 3 8B, {lay}: {k} bytes")


@observes('ex10.B.experts')
def test_model_states_of_experts(impl):
    """Mixtral 8x7B: model-state bytes per GPU, expert and dense parameters, with expert parallelism."""
    experts = MIXTRAL.n_layer * MIXTRAL.n_experts * MIXTRAL.expert_params()
    dense = MIXTRAL.num_params() - experts
    for lay in (plan.Layout(dp=8, ep=8, zero=1), plan.Layout(dp=8, ep=4, tp=2, zero=1),
                plan.Layout(dp=4, cp=2, ep=2, zero=3)):
        n, t = lay.dp * lay.cp, lay.tp * lay.pp
        d, x = dense / t, experts / (t * lay.ep)
        shard = {"params": lay.zero >= 3, "grads": lay.zero >= 2, "optimizer": lay.zero >= 1}
        per = {"params": 2, "grads": 2, "optimizer": 12}
        m = plan.model_state_bytes(MIXTRAL, lay)
        for k in per:
            want = per[k] * (d / n + x / (n // lay.ep) if shard[k] else d + x)
            _approx(m[k], want, f"Mixtral 8x7B, {lay}: {k} bytes")


# ----------------------------------------------------------------------------- C: the busiest stage
@observes('ex10.C.even_stages', 'ex10.C.uneven_stages')
def test_stage_layers(impl):
    """stage_layers: the layers per stage when p divides l and when it does not (Llama 3 405B among the
    cases)."""
    for (l, p), want in (((32, 4), [8, 8, 8, 8]), ((32, 1), [32]), ((126, 16), [7] + [8] * 14 + [7]),
                         ((32, 3), [10, 11, 11]), ((12, 5), [2, 2, 3, 3, 2]), ((10, 4), [2, 3, 3, 2])):
        expect_equal(list(stage_layers(l, p)), want, f"stage_layers({l}, {p}): layers per stage", keys="stage")


@observes('ex10.C.logits', 'ex10.C.one_stage')
def test_activations_without_pipeline(impl):
    """One GPU, one micro-batch: the peak activation bytes."""
    s = 2048
    for rc in ("none", "selective"):
        lay = plan.Layout(micro_batch=2, recompute=rc)
        want = GPT13.n_layer * plan.layer_activation_bytes(GPT13, lay, s) + _logits(GPT13, lay, s)
        _approx(plan.memory_per_gpu(GPT13, lay, s, 2)["activations"], want,
                f"GPT-3 1.3B, one GPU, micro-batch 2, recompute={rc!r}: activation bytes")


@observes('ex10.C.full_recompute')
def test_full_recompute_adds_one_layer(impl):
    """Full recomputation: the peak activation bytes."""
    s, lay = 2048, plan.Layout(recompute="full")
    per = 2 * s * GPT13.hidden
    rebuilt = cost.recompute_activation_bytes(s, 1, GPT13.hidden, GPT13.n_head)
    want = GPT13.n_layer * per + rebuilt + _logits(GPT13, lay, s)
    _approx(plan.memory_per_gpu(GPT13, lay, s, 1)["activations"], want,
            "GPT-3 1.3B, full recomputation: activation bytes")


@observes('ex10.C.in_flight')
def test_pipeline_in_flight(impl):
    """1F1B, GPipe and interleaved 1F1B: the first stage's activation bytes in flight."""
    s = 2048
    for sched, v, n in (("1f1b", 1, 4), ("gpipe", 1, 16), ("interleaved", 2, (2 * 3 + 4 + 1) / 2)):
        lay = plan.Layout(pp=4, v=v, schedule=sched, recompute="selective", tp=2)
        per = plan.layer_activation_bytes(GPT13, lay, s)
        want = n * math.ceil(GPT13.n_layer / 4) * per
        _approx(plan.memory_per_gpu(GPT13, lay, s, 16)["activations"], want,
                f"GPT-3 1.3B, pp = 4, {sched} (v = {v}), 16 micro-batches: activation bytes of the first stage")


@observes('ex10.C.last_stage', 'ex10.C.logits')
def test_last_stage_with_big_logits(impl):
    """One micro-batch on two stages, big logits: which stage is the busiest, and its bytes."""
    s, lay = 8192, plan.Layout(pp=2, recompute="selective")
    per = plan.layer_activation_bytes(LLAMA, lay, s)
    first, last = 16 * per, 16 * per + _logits(LLAMA, lay, s)
    _approx(plan.memory_per_gpu(LLAMA, lay, s, 1)["activations"], last,
            "Llama 3 8B, pp = 2, one micro-batch: activation bytes")
    lay = plan.Layout(pp=2, tp=2, cp=2, recompute="selective")             # logits: s/cp tokens, V/tp each
    per = plan.layer_activation_bytes(LLAMA, lay, s)
    _approx(plan.memory_per_gpu(LLAMA, lay, s, 1)["activations"], 16 * per + _logits(LLAMA, lay, s),
            "Llama 3 8B, pp = 2, tp = 2, cp = 2, one micro-batch: activation bytes")
    lay = plan.Layout(pp=2, recompute="selective", schedule="gpipe")      # 4 micro-batches in flight
    _approx(plan.memory_per_gpu(LLAMA, lay, s, 4)["activations"], 4 * first,
            "Llama 3 8B, pp = 2, GPipe, 4 micro-batches: activation bytes")
    lay = plan.Layout(pp=2, recompute="selective")                        # 1F1B: the last stage holds one
    _approx(plan.memory_per_gpu(LLAMA, lay, 1024, 8)["activations"],
            max(2 * 16, 16) * plan.layer_activation_bytes(LLAMA, lay, 1024),
            "Llama 3 8B, s = 1024, pp = 2, 1F1B, 8 micro-batches: activation bytes")


@observes('ex10.C.bucket', 'ex10.C.sp_input', 'ex10.C.boundary', 'ex10.C.zero3_layer')
def test_buffers(impl):
    """The communication buffers of each kind of parallelism, and their total."""
    s, sbh, psi = 8192, 8192 * 4096, LLAMA.num_params()
    cases = ((plan.Layout(), 0.0, "one GPU: no buffer"),
             (plan.Layout(dp=2), 25e6, "dp = 2"),
             (plan.Layout(cp=2), 25e6, "cp = 2"),
             (plan.Layout(tp=2), 2 * sbh, "tp = 2"),
             (plan.Layout(pp=2), 2 * 2 * sbh, "pp = 2"),
             (plan.Layout(pp=2, tp=2), 2 * sbh + 2 * 2 * sbh / 2,
              "pp = 2, tp = 2"),
             (plan.Layout(pp=2, tp=2, cp=2), 25e6 + sbh + 2 * sbh / 2,
              "pp = 2, tp = 2, cp = 2"),
             (plan.Layout(dp=8, zero=3), 25e6 + 2 * psi / LLAMA.n_layer, "dp = 8, ZeRO-3"),
             (plan.Layout(dp=4, tp=2, zero=3), 25e6 + 2 * sbh + 2 * psi / LLAMA.n_layer / 2,
              "dp = 4, tp = 2, ZeRO-3"))
    for lay, want, what in cases:
        _approx(comm_buffer_bytes(LLAMA, lay, s), want, f"Llama 3 8B, s = {s}, {what}: buffer bytes")
    m = plan.memory_per_gpu(LLAMA, plan.Layout(dp=4, tp=2, zero=3, recompute="selective"), s, 4)
    _approx(m["buffers"], 25e6 + 2 * sbh + 2 * psi / LLAMA.n_layer / 2,
            "Llama 3 8B, dp = 4, tp = 2, ZeRO-3: memory_per_gpu's buffers")
    _approx(m["total"], sum(v for k, v in m.items() if k != "total"), "memory_per_gpu's total")
