"""Exercise 10: where the memory of one GPU goes, for one parallel layout.

``memory_per_gpu(model, layout, seq_len, global_batch)`` returns the bytes on the busiest
GPU by component; the planner (``minipar.analysis.plan.predict`` and ``search``) rejects every layout
whose total does not fit. You write its heart: ``params``, ``grads``, ``optimizer`` and
``activations``. The pieces exist already: ``model_state_bytes(model, layout)`` (the ZeRO
formulas on this GPU's share), ``layer_activation_bytes(model, layout, seq_len)`` (one layer,
one micro-batch, under the layout's recomputation), ``peak_activations(schedule, p, m, rank,
v)`` (micro-batches a pipeline rank holds at its peak), ``stage_layers(l, p)`` (each stage's
layers) and ``layout.microbatches(global_batch)``.

Contract: the model states are ``model_state_bytes``' as they are. ``activations`` is what the
busiest pipeline stage holds at its peak: stage r holds its ``stage_layers`` for the micro-batches
in flight on it, the last stage (with pp > 1) one; full recomputation also rebuilds one layer's
full activations during backward; the last stage also holds one micro-batch's fp32 logits
(sharded over tp, on the GPU's s/cp tokens); with one stage, the first stage is the last.

Derived in notebook 10, "Where the memory goes" (ZeRO, Rajbhandari et al. 2020, §3.1;
Korthikanti et al. 2022, §4-5 and Table 2; Narayanan et al. 2021, §2.2 for the micro-batches
in flight). The tests compare with the formulas on Llama 3 8B and GPT-3 1.3B. Stuck?
``minipar.hint("ex10", "")``. Grade it with ``python -m minipar.grade ex10``.
"""
import math

import pytest

from minipar.analysis import cost, plan
from minipar.course.grading import expect_equal

EXERCISE = "ex10_planning"
HINTS = {
    "": ("Start from the model states, then ask: how many micro-batches of how many layers does "
         "the first stage hold at once, and what does the last stage hold besides its layers?",
         "m = global_batch / (dp·b) micro-batches; stage r holds peak_activations(schedule, "
         "pp, m, r, v) / v of them, each of its stage_layers(l, pp)[r] layers of layer_activation_bytes; "
         "full recomputation adds one layer with recompute=\"none\"; the logits are 4·(s/cp)·b·V/tp "
         "bytes. With pp > 1 the last stage holds one micro-batch of its layers (1F1B's last stage "
         "runs each backward right after its forward).",
         "out = model_state_bytes(model, L); for r, layers in enumerate(stage_layers(l, pp)): in_flight "
         "= 1 on the last of several stages, else peak_activations(L.schedule, L.pp, m, r, L.v) / L.v; "
         "held = in_flight·layers·per_layer (+ the rebuilt layer under full) (+ logits on the last "
         "stage); out[\"activations\"] = the largest held."),
}
LLAMA = plan.MODELS["llama3-8b"]
GPT13 = plan.MODELS["gpt3-1.3b"]


def _approx(got, want, what):
    """Equal within 1e-9 of each other (floating-point sums in another order), else the numbers."""
    if got != pytest.approx(want, rel=1e-9):
        expect_equal(got, want, what)


def _logits(model, lay, s):
    return 4 * (s // lay.cp) * lay.micro_batch * model.vocab / lay.tp


def test_model_states(impl):
    """Model states: 2 + 2 + 12 bytes per parameter in bf16, 4 + 4 + 8 in fp32; ZeRO-3 divides all three."""
    psi = LLAMA.num_params()
    for lay, gb, per in ((plan.Layout(recompute="full"), 1, (2, 2, 12)),
                         (plan.Layout(recompute="full", dtype="fp32"), 1, (4, 4, 8)),
                         (plan.Layout(dp=8, zero=3, recompute="full"), 8, (2 / 8, 2 / 8, 12 / 8))):
        m = plan.memory_per_gpu(LLAMA, lay, 4096, gb)
        want = dict(zip(("params", "grads", "optimizer"), (b * psi for b in per)))
        for k in want:
            _approx(m[k], want[k], f"Llama 3 8B, {lay.dtype}, dp = {lay.dp}, ZeRO-{lay.zero}: {k} bytes "
                                   f"({per[list(want).index(k)]:g} per parameter, Ψ = {psi})")


def test_activations_without_pipeline(impl):
    """One GPU, one micro-batch: l layers' activations plus the fp32 logits."""
    s = 2048
    for rc in ("none", "selective"):
        lay = plan.Layout(micro_batch=2, recompute=rc)
        want = GPT13.n_layer * plan.layer_activation_bytes(GPT13, lay, s) + _logits(GPT13, lay, s)
        _approx(plan.memory_per_gpu(GPT13, lay, s, 2)["activations"], want,
                f"GPT-3 1.3B, one GPU, micro-batch 2, recompute={rc!r}: activation bytes "
                f"({GPT13.n_layer} layers + fp32 logits)")


def test_full_recompute_adds_one_layer(impl):
    """Full recomputation: 2sbh per layer kept, plus one layer rebuilt without recomputation."""
    s, lay = 2048, plan.Layout(recompute="full")
    per = 2 * s * GPT13.hidden
    rebuilt = cost.recompute_activation_bytes(s, 1, GPT13.hidden, GPT13.n_head)
    want = GPT13.n_layer * per + rebuilt + _logits(GPT13, lay, s)
    _approx(plan.memory_per_gpu(GPT13, lay, s, 1)["activations"], want,
            "GPT-3 1.3B, full recomputation: activation bytes (2sbh per layer + one layer rebuilt + logits)")


def test_pipeline_in_flight(impl):
    """1F1B's first stage holds min(p, m) micro-batches of ⌈l/p⌉ layers, GPipe m, interleaved more."""
    s = 2048
    for sched, v, n in (("1f1b", 1, 4), ("gpipe", 1, 16), ("interleaved", 2, (2 * 3 + 4 + 1) / 2)):
        lay = plan.Layout(pp=4, v=v, schedule=sched, recompute="selective", tp=2)
        per = plan.layer_activation_bytes(GPT13, lay, s)
        want = n * math.ceil(GPT13.n_layer / 4) * per
        _approx(plan.memory_per_gpu(GPT13, lay, s, 16)["activations"], want,
                f"GPT-3 1.3B, pp = 4, {sched} (v = {v}), 16 micro-batches: activation bytes of the first stage "
                f"({n:g} micro-batches of {math.ceil(GPT13.n_layer / 4)} layers)")


def test_last_stage_with_big_logits(impl):
    """One micro-batch on two stages: the last stage (its layers and the logits) is the busiest."""
    s, lay = 8192, plan.Layout(pp=2, recompute="selective")
    per = plan.layer_activation_bytes(LLAMA, lay, s)
    first, last = 16 * per, 16 * per + _logits(LLAMA, lay, s)
    _approx(plan.memory_per_gpu(LLAMA, lay, s, 1)["activations"], last,
            "Llama 3 8B, pp = 2, one micro-batch: activation bytes (the last stage: 16 layers + the logits)")
    lay = plan.Layout(pp=2, tp=2, cp=2, recompute="selective")             # logits: s/cp tokens, V/tp each
    per = plan.layer_activation_bytes(LLAMA, lay, s)
    _approx(plan.memory_per_gpu(LLAMA, lay, s, 1)["activations"], 16 * per + _logits(LLAMA, lay, s),
            "Llama 3 8B, pp = 2, tp = 2, cp = 2, one micro-batch: activation bytes of the last stage (16 layers "
            "+ the logits of its s/cp = 4096 tokens over V/tp = 64128 columns)")
    lay = plan.Layout(pp=2, recompute="selective", schedule="gpipe")      # 4 micro-batches in flight
    _approx(plan.memory_per_gpu(LLAMA, lay, s, 4)["activations"], 4 * first,
            "Llama 3 8B, pp = 2, GPipe, 4 micro-batches: activation bytes (the first stage: 4 x 16 layers)")
