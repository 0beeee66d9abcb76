"""Exercise 10: where the memory of one GPU goes, for one parallel layout.

Write the heart of ``memory_per_gpu(model, layout, seq_len, global_batch)`` in
``minipar/plan/memory.py``: the bytes on the busiest GPU, by component, that the planner
(``minipar.plan.predict`` and ``search``) uses to reject layouts that do not fit.

* Model states: ``model_state_bytes(model, layout)`` already gives ``params``, ``grads`` and
  ``optimizer`` (ZeRO's 2Ψ + 2Ψ + 12Ψ in mixed precision, divided by tp·pp, and by the
  data-parallel ranks for what the ZeRO stage shards). Start ``out`` from it.
* Activations (Korthikanti et al. 2022; Narayanan et al. 2021 for the pipeline): with m =
  global_batch / (dp·b) micro-batches, the first pipeline stage holds
  ``peak_activations(schedule, pp, m, 0, v) / v`` micro-batches of its ⌈l/pp⌉ layers, each
  ``layer_activation_bytes(model, layout, seq_len)``. Full recomputation rebuilds one layer
  at a time in backward: add one layer's activations without recomputation
  (``layout.replace(recompute="none")``). The last stage also holds one micro-batch's fp32
  logits, ``4·(s/cp)·b·V/tp`` bytes (all of its micro-batches' when pp = 1, where the first
  stage is the last). ``out["activations"]`` is the larger of the first stage's and the
  last stage's total.

The tests compare with the formulas on Llama 3 8B and GPT-3 1.3B. Grade it with
``python -m minipar.grade ex10``.
"""
import math

import pytest

from minipar import cost, plan
from minipar.grading import expect_equal

EXERCISE = "ex10_planning"
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
    lay = plan.Layout(pp=2, recompute="selective", schedule="gpipe")      # 4 micro-batches in flight
    _approx(plan.memory_per_gpu(LLAMA, lay, s, 4)["activations"], 4 * first,
            "Llama 3 8B, pp = 2, GPipe, 4 micro-batches: activation bytes (the first stage: 4 x 16 layers)")
