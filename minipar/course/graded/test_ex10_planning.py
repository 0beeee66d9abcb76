"""Exercise 10: where the memory of one GPU goes, for one parallel layout.

``memory_per_gpu(model, layout, seq_len, global_batch)`` returns the bytes on the busiest GPU
by component, and the planner (``minipar.plan.predict`` and ``search``) rejects every
layout whose total does not fit. You write all of it but the final sum. The formulas you need
from earlier chapters are there already: ``cost.activation_terms`` (Korthikanti et al.'s terms
of one layer), ``cost.zero_bytes_per_rank`` (the ZeRO stages) and ``cost.peak_activations``
(the micro-batches a pipeline rank holds at its peak).

A. ``layer_activation_bytes(model, layout, seq_len)``: the bytes one layer keeps per
   micro-batch on one GPU.
B. ``model_state_bytes(model, layout)``: parameters, gradients and optimizer state.
C. ``stage_layers(n_layer, pp)``, ``comm_buffer_bytes(model, layout, seq_len)`` and the
   ``activations`` of ``memory_per_gpu``.

Each function's docstring below is its contract: clauses ``ex10.P.word`` that must hold (the
grader names the clause a failure breaks). Derived in notebook 10, "Where the memory goes"
(ZeRO, Rajbhandari et al. 2020, §3.1; Korthikanti et al. 2022, §4-5 and Table 2; Narayanan et
al. 2021, §2.2 for the micro-batches in flight; the Llama 3 report, §3.3.2, for the uneven
cut). The tests compare with the formulas on GPT-3 1.3B, Llama 3 8B and Mixtral 8x7B. Stuck?
``minipar.hint("ex10", "A")`` (or "B", "C") gives a nudge, then the idea, then the
pseudo-code. Grade it with ``python -m minipar.grade ex10``.
"""
import math

import pytest

from minipar import cost, plan
from minipar.plan.memory import comm_buffer_bytes, stage_layers
from minipar.course.grading import expect_equal, observes

EXERCISE = "ex10_planning"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNo1i7EOAjEMQ3/FGwu6X2BkYEFCiDlcc0p1bXNqIp34LT6BLyNUYrFl+/nm1B1L14qLdpe8UvMMd'
        'lCZDgbnXg3a4MI4X+9R6R5JV2424SF5FujymysSb9zSn66auARvQhvjyS+NTUChdBy2j7doSeNgnzds1s52+'
        'gLEuTVq',
        'sealed:eNpdkL1OxDAQhF9ldA2JiHL8NlBRHAgBh4BAGxln72LFsYN3c1KehEehhxdjw3UUljz2eNbfVKYj2'
        'MhSGituZ8TFUAulnhEDeGkHSOwoMDIZCrCu90mIMVACeeopSIEmxSGOAsOQltDHhjxaVU7yS7A1nrB4KnBX4'
        'G2hAchaHOLk+6vb1Y3r82V22uYwocHihu5f4cIwp6nWVN3u32w2YXmmvuznE8flObZGqMmhSuJQdyUqnc02J'
        'sKeILuqqtW6un1c19Xq+eFFR+jdH9THSMkphtkaF1jA6GjiiznMKmNMOMIYGoVkpZyrISSysdff/JU0Wzbec'
        'AsjoiXoUYnr0ft/to5omLv0E8jYFt5MlA54j1j+Au2ZhIs=',
        'sealed:eNpVkLFOxDAQRH9lukvASjg4motSIgpoKKBBKPIlm3N0jm3Zm0N8CZ+SPvwYTnISotsZza72TTtov'
        'YcnHrwBTWMS8tql03iYRoUcCTt0LYID6UDYphke5oHJ9wElZM3dWXJnTbVYy7rAQUAJSAGOIszGF1OoHPmKN'
        'PVkuCSBxltnBy5725DOLiot1uPvmxeBJ4G3zQeuSiQK17idxtM5zZM79Zd6pOdXdMYNDGkaxAtxXHfa1uTJT'
        'kWaZJvdzxxHydREzdZVpwKt9SBZK4Ta+hVqj5sFOL45oxFipNUyqLWAn2/UrsBnx+piy6bB7l9vMucYuVTKi'
        'hCGPvsFLX1+Pg==',
    ),
    'B': (
        'sealed:eNoNysEJgEAMBMBWtgB78OlTEUTwF81qAudFzkOwe533zOab4ZIiJyvLDQ3eiEx0wwSLpJAKSanBy'
        'j0KsXDsof64/lHyW83z0X6nCBme',
        'sealed:eNptjjEKwkAQRa/yOxVixAgiiKWViKBWNrJxJ7iQ7A67oxhP5A3S5wCeyTUWWti9mT9v+DsujeD5g'
        'LHiIGcC3Zi8hB769liqmnzbLNvmsz2y8qoKCQrnoSzWbonKaSoHcdKd7ilIin0kTTYQoiEwAaeLIK8h3DbM3'
        'fWBtpthOCuvScNdyUPH8MTz3xpfJ3b4eH+UEXGKFRYYZ3AspjL3mOW1UEB8g642SSRjkRfjaYLZGwueZOkLE'
        'adf/w==',
        'sealed:eNptz8EKwjAMBuBX+Y8rlg53EkavvoTIqDbTMdeVphP1xXbfk5kJ4sVL+CHhS9LDYluha0GwFhXox'
        'oRdjehSZmkeXpTG5vTMxE2k1CQX+sJTYCqLHJc5RqXhJZyjxjqr0WuQFsB78nbvBFRHFBv8k+ghMfPXWmb6e'
        'WVJYhpjlKqRKE8pIF8JPA2MsV1PdANrXJLzDBc8xpi7oZM9GO9S1uHPH+YNRD1SJQ==',
    ),
    'C': (
        'sealed:eNpNjdEJwzAMRFe5AdIF+pMhOoFiKZWpbYElCNk+dik0n3fvcfcK6oG9W0WooBpLgQeF+DKbBvLPE'
        '2oHKrUTNaduj40iqThs/5NCp3QH2+iFks6VtwxeGBSwlmQBNcahI361+VjI465u4pkHy+G/yfUCBeE7Bg==',
        'sealed:eNpNUEtqwzAQvcojm9qg2HXpzqSLLnKEbkoJsizbIrIlpHFCbtBC7pN9jpKTVJYSCGijN/N+M2KDX'
        'puG613DSQwokbX2emlyjEo4s46o9DU88V7CYTC69bCS73dckDpwUmbymQ9b7awlg7UMI4NjOORB7gDTgQYZI'
        'MmDQfgp8klup/lJOp/phZV/ux8koMZR0RAwfKBayAH3dI+QAphJPid8yCY+smpbfb74Z5qbJ58SNFzsj9y1c'
        'KofCLwj6SK5M27B8xrdrDWcFGa0M8WG4O3dNVqkgI8NuVlNYbSqU1bTL2rcSbxfL5kvhc3DRa+Xr5IsmhNJX'
        '2BrXFwWMzHczr+6tLfzXwzIlsEE4nsZDTtnxlTC4zVcal0xhPfGUBQF5omUjlJ+HqFC5+IfXJ2kqw==',
        'sealed:eNpVj0FqwzAQRa/yyUomrk3aXUKzSOmqgUJpNy3FOPE4FlEsIY0CuVFv4L0P0DN1bENIV0J//p//x'
        'kbGI062IlMELpmK3YUpqFFJsU1WqK2HT2HKC/kA3YLaeCIvXiWJAxXTRInduSRZiqWojT40w+YFbAtuSOKBY'
        'WsEOkvWYIyGFGQCwVF5LMo963PJ2rZBbbOwb6iKhoQhcy7FKR0gttk5QT48KzRkKmm4tvXdBNJ3jvwEhTk87'
        'aI2DDWHsQfN4R/QSCE32shfsxuA2bdsnlxeMHksy7CJdS0NS2w+nl6e36FrVK7v9g5rLFbSRn0Xds2g81W77'
        '7tJzpWIMgpuunqRDD93G/79yU0urthWQv9Jb693D1DDSqEOuRSxPVIbkuwP++yYcg==',
    ),
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
@observes("ex10.A.gpt")
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


@observes("ex10.A.shapes", "ex10.A.experts")
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


@observes("ex10.A.cp", "ex10.A.flash")
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
@observes("ex10.B.bytes", "ex10.B.zero")
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


@observes("ex10.B.experts")
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
@observes("ex10.C.even", "ex10.C.uneven")
def test_stage_layers(impl):
    """stage_layers: the layers per stage when p divides l and when it does not (Llama 3 405B among the
    cases)."""
    for (l, p), want in (((32, 4), [8, 8, 8, 8]), ((32, 1), [32]), ((126, 16), [7] + [8] * 14 + [7]),
                         ((32, 3), [10, 11, 11]), ((12, 5), [2, 2, 3, 3, 2]), ((10, 4), [2, 3, 3, 2])):
        expect_equal(list(stage_layers(l, p)), want, f"stage_layers({l}, {p}): layers per stage", keys="stage")


@observes("ex10.C.logits", "ex10.C.one_stage")
def test_activations_without_pipeline(impl):
    """One GPU, one micro-batch: the peak activation bytes."""
    s = 2048
    for rc in ("none", "selective"):
        lay = plan.Layout(micro_batch=2, recompute=rc)
        want = GPT13.n_layer * plan.layer_activation_bytes(GPT13, lay, s) + _logits(GPT13, lay, s)
        _approx(plan.memory_per_gpu(GPT13, lay, s, 2)["activations"], want,
                f"GPT-3 1.3B, one GPU, micro-batch 2, recompute={rc!r}: activation bytes")


@observes("ex10.C.recompute")
def test_full_recompute_adds_one_layer(impl):
    """Full recomputation: the peak activation bytes."""
    s, lay = 2048, plan.Layout(recompute="full")
    per = 2 * s * GPT13.hidden
    rebuilt = cost.recompute_activation_bytes(s, 1, GPT13.hidden, GPT13.n_head)
    want = GPT13.n_layer * per + rebuilt + _logits(GPT13, lay, s)
    _approx(plan.memory_per_gpu(GPT13, lay, s, 1)["activations"], want,
            "GPT-3 1.3B, full recomputation: activation bytes")


@observes("ex10.C.in_flight")
def test_pipeline_in_flight(impl):
    """1F1B, GPipe and interleaved 1F1B: the first stage's activation bytes in flight."""
    s = 2048
    for sched, v, n in (("1f1b", 1, 4), ("gpipe", 1, 16), ("interleaved", 2, (2 * 3 + 4 + 1) / 2)):
        lay = plan.Layout(pp=4, v=v, schedule=sched, recompute="selective", tp=2)
        per = plan.layer_activation_bytes(GPT13, lay, s)
        want = n * math.ceil(GPT13.n_layer / 4) * per
        _approx(plan.memory_per_gpu(GPT13, lay, s, 16)["activations"], want,
                f"GPT-3 1.3B, pp = 4, {sched} (v = {v}), 16 micro-batches: activation bytes of the first stage")


@observes("ex10.C.last_stage", "ex10.C.logits")
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


@observes("ex10.C.bucket", "ex10.C.sp_input", "ex10.C.boundary", "ex10.C.zero3")
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
