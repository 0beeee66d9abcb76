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

EXERCISE = "ex10_planning"
LLAMA = plan.MODELS["llama3-8b"]
GPT13 = plan.MODELS["gpt3-1.3b"]


def _logits(model, lay, s):
    return 4 * (s // lay.cp) * lay.micro_batch * model.vocab / lay.tp


def test_model_states(impl):
    """Model states: 2 + 2 + 12 bytes per parameter in bf16, 4 + 4 + 8 in fp32; ZeRO-3 divides all three.
    Hint: out = model_state_bytes(model, layout), then add out["activations"]."""
    psi = LLAMA.num_params()
    m = plan.memory_per_gpu(LLAMA, plan.Layout(recompute="full"), 4096, 1)
    assert (m["params"], m["grads"], m["optimizer"]) == (2 * psi, 2 * psi, 12 * psi)
    m = plan.memory_per_gpu(LLAMA, plan.Layout(recompute="full", dtype="fp32"), 4096, 1)
    assert (m["params"], m["grads"], m["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    m = plan.memory_per_gpu(LLAMA, plan.Layout(dp=8, zero=3, recompute="full"), 4096, 8)
    assert m["params"] == pytest.approx(2 * psi / 8) and m["optimizer"] == pytest.approx(12 * psi / 8)


def test_activations_without_pipeline(impl):
    """One GPU, one micro-batch: l layers' activations plus the fp32 logits.
    Hint: with pp = 1 the only stage is first and last: in-flight layers' activations + logits."""
    s = 2048
    for rc in ("none", "selective"):
        lay = plan.Layout(micro_batch=2, recompute=rc)
        want = GPT13.n_layer * plan.layer_activation_bytes(GPT13, lay, s) + _logits(GPT13, lay, s)
        assert plan.memory_per_gpu(GPT13, lay, s, 2)["activations"] == pytest.approx(want)


def test_full_recompute_adds_one_layer(impl):
    """Full recomputation: 2sbh per layer kept, plus one layer rebuilt without recomputation.
    Hint: act += layer_activation_bytes(model, layout.replace(recompute="none"), seq_len)."""
    s, lay = 2048, plan.Layout(recompute="full")
    per = 2 * s * GPT13.hidden
    rebuilt = cost.recompute_activation_bytes(s, 1, GPT13.hidden, GPT13.n_head)
    want = GPT13.n_layer * per + rebuilt + _logits(GPT13, lay, s)
    assert plan.memory_per_gpu(GPT13, lay, s, 1)["activations"] == pytest.approx(want)


def test_pipeline_in_flight(impl):
    """1F1B's first stage holds min(p, m) micro-batches of ⌈l/p⌉ layers, GPipe m, interleaved more.
    Hint: in_flight = peak_activations(schedule, pp, m, 0, v) / v, m = global_batch // (dp * b)."""
    s = 2048
    for sched, v, n in (("1f1b", 1, 4), ("gpipe", 1, 16), ("interleaved", 2, (2 * 3 + 4 + 1) / 2)):
        lay = plan.Layout(pp=4, v=v, schedule=sched, recompute="selective", tp=2)
        per = plan.layer_activation_bytes(GPT13, lay, s)
        want = n * math.ceil(GPT13.n_layer / 4) * per
        assert plan.memory_per_gpu(GPT13, lay, s, 16)["activations"] == pytest.approx(want), sched


def test_last_stage_with_big_logits(impl):
    """One micro-batch on two stages: the last stage (its layers and the logits) is the busiest.
    Hint: last = (1 if pp > 1 else in_flight) * layers * per_layer + logits; take the max with the first stage."""
    s, lay = 8192, plan.Layout(pp=2, recompute="selective")
    per = plan.layer_activation_bytes(LLAMA, lay, s)
    first, last = 16 * per, 16 * per + _logits(LLAMA, lay, s)
    assert plan.memory_per_gpu(LLAMA, lay, s, 1)["activations"] == pytest.approx(last)
    lay = plan.Layout(pp=2, recompute="selective", schedule="gpipe")      # 4 micro-batches in flight
    assert plan.memory_per_gpu(LLAMA, lay, s, 4)["activations"] == pytest.approx(4 * first)
