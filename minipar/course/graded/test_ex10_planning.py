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
cut), which measures model states on real ranks. The tests compare your estimate with what
was measured on the course's GPT, and with the planner's bytes on GPT-3 1.3B, Llama 3 8B and
Mixtral 8x7B (numbers, not formulas). Stuck?
``minipar.hint("ex10", "A")`` (or "B", "C") gives a nudge, then the idea, then the
pseudo-code. Grade it with ``python -m minipar.grade ex10``.
"""
from dataclasses import fields, replace as dataclass_replace

from minipar import cost, plan
from minipar.plan.memory import comm_buffer_bytes, stage_layers
from contextlib import nullcontext

from minipar.course.grading import breaks, expect, expect_equal, observes
from minipar.models.gpt import GPTConfig

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
        'sealed:eNpNkEFqwzAQRa/yyaY2KHZdujPpooscoZtSgizLtohsCWmckBu0kPtkn6PkJJWlBALa6M+8P39mx'
        'Aa9Ng3Xu4aTGFAia+310uQYlXBmHVXpa3jivYTDYHTrYSXf77ggdeCkzOQzH7raWUsGaxlGBsdwyIPdAaYDD'
        'TJIkocB4afIJ7ud5ifpfKYXKv92P0hCjaOiIWj4QLXAQfd0j5ACmEk+J3zYJh5Zta0+X/wz5ubJpwQNF/sjd'
        'y2c6gcC70i6CHfGLXpeo5u1hpPCjHamuCF4e58aR6SAjw65WU2htEK22HAiOUVmnsTAp162OQtopFMYMqZOe'
        '5k+Ik7i/XrJfClsHq5/vXyVZNGcSPoCW+Nis5iJ4Xb+1aW9nf/iMmwpTCC+l9G+c2ZMMzxew1XXFUN4bwxFU'
        'YQ8pHS08vMIFe5T/AM5ALRg',
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


def _approx(got, want, what, rel=1e-9, clause=None):
    """Within ``rel`` of each other (1e-9: floating-point sums in another order), else both numbers; a
    failure names ``clause`` (the one the row observes, :func:`grading.breaks`) when given."""
    ok = isinstance(got, (int, float)) and abs(got - want) <= rel * max(abs(want), 1.0)
    if not ok:
        r = got / want if isinstance(got, (int, float)) and want else None
        ratio = "" if r is None else f" ({r:.4g}× the expected)" if abs(r - 1) >= 1e-3 else f" ({r:.7g}× the expected)"
        shown = f"{got:,.0f}" if isinstance(got, (int, float)) else repr(got)
        with breaks(clause) if clause else nullcontext():
            expect(False, f"{what}: estimated {shown} bytes, expected {want:,.0f}{ratio}")


# ----------------------------------------------------------------------------- what was measured
COURSE_GPT = GPTConfig(vocab_size=32, block_size=16, n_layer=8, n_head=2, n_embd=16)


class _CourseGPT(plan.ModelSpec):
    """The course GPT's spec with its real Ψ, 27,552 (``ModelSpec.num_params``, 25,600, leaves out biases,
    norms and position embeddings): the Ψ the measured bytes are of."""

    def num_params(self) -> int:
        return 27552


_BASE = plan.from_gpt_config(COURSE_GPT)
COURSE = _CourseGPT(**{f.name: getattr(_BASE, f.name) for f in fields(_BASE)})
# hybrid.train on 4 CPU ranks, fp32 AdamW, one step of 8 sequences in 2 micro-batches: the mean over
# the ranks of each one's measured["memory"] (params, grads, optimizer), in bytes
MEASURED = [
    (plan.Layout(dp=4, dtype="fp32"), (110208, 110208, 220416)),
    (plan.Layout(dp=4, zero=1, dtype="fp32"), (110208, 110208, 55104)),
    (plan.Layout(dp=4, zero=2, dtype="fp32"), (110208, 27552, 55104)),
    (plan.Layout(dp=4, zero=3, dtype="fp32"), (27552, 27552, 55104)),
    (plan.Layout(dp=2, tp=2, zero=1, dtype="fp32"), (57216, 57216, 57216)),
    (plan.Layout(dp=2, pp=2, dtype="fp32"), (55104, 55104, 110208)),
    (plan.Layout(tp=2, pp=2, dtype="fp32"), (28608, 28608, 57216)),
    (plan.Layout(dp=2, cp=2, zero=2, dtype="fp32"), (110208, 27552, 55104)),
]


@observes("ex10.B.measured")
def test_model_states_against_measured(impl):
    """The course's GPT on 4 ranks under dp, tp, pp, cp and ZeRO 0-3: model states per GPU against
    what hybrid.train measured (the mean over the ranks), each within 5%, the spec's num_params() its
    real Ψ = 27,552."""
    for lay, measured in MEASURED:
        got = plan.model_state_bytes(COURSE, lay)
        for k, m in zip(("params", "grads", "optimizer"), measured):
            _approx(got[k], m, f"the course GPT (Ψ = 27,552), {lay}: {k} bytes, against the {m:,} measured", rel=0.05)


# ----------------------------------------------------------------------------- A: one layer
# one block of GPT(GPTConfig(vocab_size=32, block_size=T, n_layer=1, n_head=a, n_embd=h,
# attention="materialized")), fp32, on one process, a batch of B: the bytes SavedActivations
# measured autograd keep for backward. ((h, a, T, B), recompute, bytes)
MEASURED_LAYER = [
    ((32, 2, 16, 4), 'none', 140544),
    ((32, 2, 16, 4), 'selective', 132096),
    ((32, 2, 16, 4), 'full', 8192),
    ((32, 4, 64, 2), 'none', 399360),
    ((32, 4, 64, 2), 'selective', 264192),
    ((32, 4, 64, 2), 'full', 16384),
    ((64, 4, 32, 2), 'none', 296960),
    ((64, 4, 32, 2), 'selective', 263168),
    ((64, 4, 32, 2), 'full', 16384),
]


@observes("ex10.A.measured")
def test_layer_activations_against_measured(impl):
    """The course's GPT block on one process, fp32, materialized attention, every recomputation:
    one layer's bytes against what SavedActivations measured, each within 3%."""
    for (h, a, T, B), mode, measured in MEASURED_LAYER:
        spec = plan.from_gpt_config(GPTConfig(vocab_size=32, block_size=T, n_layer=1, n_head=a, n_embd=h))
        lay = plan.Layout(dtype="fp32", attention="materialized", recompute=mode, micro_batch=B)
        _approx(plan.layer_activation_bytes(spec, lay, T), measured,
                f"the course GPT's block (h = {h}, a = {a}), s = {T}, {lay}: bytes of one layer, against the "
                f"{measured:,} measured", rel=0.03)


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
    without and with dropout, selective recomputation: one layer's bytes."""
    sbh = 8192 * 4096
    lay = plan.Layout(recompute="selective", attention="materialized")
    _approx(plan.layer_activation_bytes(LLAMA, lay, 8192), 34 * sbh,
            "Llama 3 8B, s = 8192, selective: bytes of one layer", clause="ex10.A.shapes")
    _approx(plan.layer_activation_bytes(MIXTRAL, lay, 8192), 55 * sbh,
            "Mixtral 8x7B, s = 8192, selective: bytes of one layer", clause="ex10.A.experts")
    _approx(plan.layer_activation_bytes(dataclass_replace(MIXTRAL, dropout=0.1), lay, 8192), 57 * sbh,
            "Mixtral 8x7B with dropout 0.1, s = 8192, selective: bytes of one layer", clause="ex10.A.experts")


CP = [  # (clause, model, layout, s, bytes)
    ("ex10.A.cp", LLAMA, plan.Layout(cp=1, attention='materialized'), 8192, 5435817984.0),
    ("ex10.A.flash", LLAMA, plan.Layout(cp=1, attention='flash'), 8192, 1141899264.0),
    ("ex10.A.cp", LLAMA, plan.Layout(cp=2, attention='materialized'), 8192, 2717908992.0),
    ("ex10.A.flash", LLAMA, plan.Layout(cp=2, attention='flash'), 8192, 570949632.0),
    ("ex10.A.flash", LLAMA, plan.Layout(tp=2, attention='flash'), 8192, 570949632.0),
    ("ex10.A.flash", LLAMA, plan.Layout(recompute='selective', attention='flash'), 8192, 1141899264.0),
    ("ex10.A.cp", LLAMA, plan.Layout(cp=2, recompute='full'), 8192, 33554432.0),
    ("ex10.A.flash", LLAMA, plan.Layout(recompute='full', attention='flash'), 8192, 67108864.0),
    ("ex10.A.flash", GPT13, plan.Layout(attention='flash'), 2048, 142802944.0),     # with dropout
]


@observes("ex10.A.cp", "ex10.A.flash")
def test_layer_activations_with_cp(impl):
    """Llama 3 8B, cp = 1 and 2, materialized and flash attention (with tp, selective and full
    recomputation too), and GPT-3 1.3B (with dropout) under flash attention: one layer's bytes."""
    for clause, model, lay, s, want in CP:
        _approx(plan.layer_activation_bytes(model, lay, s), want, f"{_name(model)}, s = {s}, {lay}: bytes of one layer",
                clause=clause)


# ----------------------------------------------------------------------------- B: model states
STATES = [
    (LLAMA, plan.Layout(recompute='full'), 'params', 16059990016.0),
    (LLAMA, plan.Layout(recompute='full'), 'grads', 16059990016.0),
    (LLAMA, plan.Layout(recompute='full'), 'optimizer', 96359940096.0),
    (LLAMA, plan.Layout(recompute='full', dtype='fp32'), 'params', 32119980032.0),
    (LLAMA, plan.Layout(recompute='full', dtype='fp32'), 'grads', 32119980032.0),
    (LLAMA, plan.Layout(recompute='full', dtype='fp32'), 'optimizer', 64239960064.0),
    (LLAMA, plan.Layout(dp=8, zero=1), 'params', 16059990016.0),
    (LLAMA, plan.Layout(dp=8, zero=1), 'grads', 16059990016.0),
    (LLAMA, plan.Layout(dp=8, zero=1), 'optimizer', 12044992512.0),
    (LLAMA, plan.Layout(dp=4, cp=2, zero=2), 'params', 16059990016.0),
    (LLAMA, plan.Layout(dp=4, cp=2, zero=2), 'grads', 2007498752.0),
    (LLAMA, plan.Layout(dp=4, cp=2, zero=2), 'optimizer', 12044992512.0),
    (LLAMA, plan.Layout(dp=8, zero=3), 'params', 2007498752.0),
    (LLAMA, plan.Layout(dp=8, zero=3), 'grads', 2007498752.0),
    (LLAMA, plan.Layout(dp=8, zero=3), 'optimizer', 12044992512.0),
    (LLAMA, plan.Layout(dp=2, tp=2, pp=2, zero=1), 'params', 4014997504.0),
    (LLAMA, plan.Layout(dp=2, tp=2, pp=2, zero=1), 'grads', 4014997504.0),
    (LLAMA, plan.Layout(dp=2, tp=2, pp=2, zero=1), 'optimizer', 12044992512.0),
]
EXPERTS = [
    (MIXTRAL, plan.Layout(dp=8, ep=8, zero=1), 'params', 14482931712.0),
    (MIXTRAL, plan.Layout(dp=8, ep=8, zero=1), 'grads', 14482931712.0),
    (MIXTRAL, plan.Layout(dp=8, ep=8, zero=1), 'optimizer', 70052216832.0),
    (MIXTRAL, plan.Layout(dp=8, ep=4, tp=2, zero=1), 'params', 12878610432.0),
    (MIXTRAL, plan.Layout(dp=8, ep=4, tp=2, zero=1), 'grads', 12878610432.0),
    (MIXTRAL, plan.Layout(dp=8, ep=4, tp=2, zero=1), 'optimizer', 35026108416.0),
    (MIXTRAL, plan.Layout(dp=4, cp=2, ep=2, zero=3), 'params', 11675369472.0),
    (MIXTRAL, plan.Layout(dp=4, cp=2, ep=2, zero=3), 'grads', 11675369472.0),
    (MIXTRAL, plan.Layout(dp=4, cp=2, ep=2, zero=3), 'optimizer', 70052216832.0),
]


def _clause(lay):
    """The clause a row of STATES observes: the bytes per element, the ZeRO group, or the local share."""
    return "ex10.B.local" if lay.tp * lay.pp > 1 else "ex10.B.zero" if lay.zero else "ex10.B.bytes"


@observes("ex10.B.bytes", "ex10.B.zero", "ex10.B.local")
def test_model_states(impl):
    """Model-state bytes per GPU in bf16 and fp32, under ZeRO 0 to 3, tensor, pipeline, data and context
    parallelism (and the course's GPT on 5 ranks, whose Ψ they do not divide)."""
    for model, lay, k, want in STATES:
        _approx(plan.model_state_bytes(model, lay)[k], want, f"Llama 3 8B, {lay}: {k} bytes", clause=_clause(lay))
    lay = plan.Layout(dp=5, zero=3, dtype="fp32")
    for k, want in (("params", 4 * 27552 / 5), ("grads", 4 * 27552 / 5), ("optimizer", 8 * 27552 / 5)):
        _approx(plan.model_state_bytes(COURSE, lay)[k], want, f"the course GPT (Ψ = 27,552), {lay}: {k} bytes",
                clause="ex10.B.zero")


@observes("ex10.B.experts")
def test_model_states_of_experts(impl):
    """Mixtral 8x7B: model-state bytes per GPU, expert and dense parameters, with expert parallelism."""
    for model, lay, k, want in EXPERTS:
        _approx(plan.model_state_bytes(model, lay)[k], want, f"Mixtral 8x7B, {lay}: {k} bytes")


# ----------------------------------------------------------------------------- C: the busiest stage
@observes("ex10.C.even", "ex10.C.uneven")
def test_stage_layers(impl):
    """stage_layers: the layers per stage when p divides l and when it does not (Llama 3 405B among the
    cases, and cuts with up to four shorter stages)."""
    for (l, p), want in (((32, 4), [8, 8, 8, 8]), ((32, 1), [32]), ((126, 16), [7] + [8] * 14 + [7]),
                         ((32, 3), [10, 11, 11]), ((12, 5), [2, 2, 3, 3, 2]), ((10, 4), [2, 3, 3, 2]),
                         ((12, 8), [1, 1, 1, 2, 2, 2, 2, 1]), ((20, 8), [2, 2, 2, 3, 3, 3, 3, 2])):
        clause = "ex10.C.even" if l % p == 0 else "ex10.C.uneven"
        with breaks(clause):
            expect_equal(list(stage_layers(l, p)), want, f"stage_layers({l}, {p}): layers per stage", keys="stage")


LLAMA4 = dataclass_replace(LLAMA, n_layer=4)   # Llama 3 8B's layers, four of them: the logits weigh
NOPIPE = [  # (clause, model, layout, s, global batch, bytes)
    ("ex10.C.one_stage", GPT13, plan.Layout(micro_batch=2, recompute='none'), 2048, 2, 31827705856.0),
    ("ex10.C.one_stage", GPT13, plan.Layout(micro_batch=2, recompute='selective'), 2048, 2, 7668514816.0),
    ("ex10.C.one_stage", GPT13, plan.Layout(schedule='gpipe'), 2048, 4, 62420295680.0),
]
FULL = [
    # the first stage the busiest, whatever the logits: a failure here is the rebuilt layer's
    ("ex10.C.recompute", COURSE, plan.Layout(pp=4, recompute='full'), 16, 16, 13312.0),
    # flash attention: the rebuilt layer keeps no s² scores, on one stage and on two
    ("ex10.C.recompute", LLAMA, plan.Layout(recompute='full', attention='flash'), 8192, 1, 7492075520.0),
    ("ex10.C.recompute", LLAMA, plan.Layout(pp=2, recompute='full', attention='flash'), 8192, 4, 6418333696.0),
]
INFLIGHT = [
    ("ex10.C.in_flight", GPT13, plan.Layout(pp=4, v=1, schedule='1f1b', recompute='selective', tp=2), 2048, 16, 1711276032.0),
    ("ex10.C.in_flight", GPT13, plan.Layout(pp=4, v=1, schedule='gpipe', recompute='selective', tp=2), 2048, 16, 6845104128.0),
    ("ex10.C.in_flight", GPT13, plan.Layout(pp=4, v=2, schedule='interleaved', recompute='selective', tp=2), 2048, 16, 2353004544.0),
    ("ex10.C.in_flight", GPT13, plan.Layout(pp=4, dp=2, schedule='gpipe', recompute='selective', tp=2), 2048, 32, 6845104128.0),
    ("ex10.C.in_flight", GPT13, plan.Layout(pp=5, recompute='selective', tp=2), 2048, 16, 1426063360.0),
]
LAST = [
    ("ex10.C.logits", LLAMA, plan.Layout(pp=2, recompute='selective'), 8192, 1, 22456303616.0),
    ("ex10.C.logits", LLAMA, plan.Layout(pp=2, tp=2, cp=2, recompute='selective'), 8192, 1, 5614075904.0),
    ("ex10.C.last_stage", LLAMA, plan.Layout(pp=2, recompute='selective', schedule='gpipe'), 8192, 4, 73014444032.0),
    ("ex10.C.logits", LLAMA, plan.Layout(pp=2, recompute='selective'), 1024, 8, 4563402752.0),
    ("ex10.C.last_stage", LLAMA4, plan.Layout(pp=2, v=2, schedule='interleaved', recompute='selective'), 8192, 4,
     6484393984.0),
    ("ex10.C.last_stage", LLAMA4, plan.Layout(pp=2, schedule='zb-h1', recompute='selective'), 8192, 4, 6484393984.0),
]
BUF = [  # (the clause the row adds a buffer for, model, layout, s, bytes)
    ("ex10.C.bucket", LLAMA, plan.Layout(), 8192, 0.0),
    ("ex10.C.bucket", LLAMA, plan.Layout(dp=2), 8192, 25000000.0),
    ("ex10.C.bucket", LLAMA, plan.Layout(cp=2), 8192, 25000000.0),
    ("ex10.C.sp_input", LLAMA, plan.Layout(tp=2), 8192, 67108864.0),
    ("ex10.C.sp_input", LLAMA, plan.Layout(tp=2, sequence_parallel=False), 8192, 67108864.0),
    ("ex10.C.boundary", LLAMA, plan.Layout(pp=2), 8192, 134217728.0),
    ("ex10.C.boundary", LLAMA, plan.Layout(pp=2, tp=2), 8192, 134217728.0),
    ("ex10.C.boundary", LLAMA, plan.Layout(pp=2, tp=2, sequence_parallel=False), 8192, 201326592.0),
    ("ex10.C.boundary", LLAMA, plan.Layout(pp=2, tp=2, cp=2), 8192, 92108864.0),
    ("ex10.C.zero3", LLAMA, plan.Layout(dp=8, zero=3), 8192, 526874688.0),
    ("ex10.C.zero3", LLAMA, plan.Layout(dp=4, tp=2, zero=3), 8192, 343046208.0),
    ("ex10.C.zero3", MIXTRAL, plan.Layout(dp=8, ep=8, zero=3), 8192, 2943842368.0),
]


def _activations(rows, what):
    for clause, model, lay, s, batch, want in rows:
        _approx(plan.memory_per_gpu(model, lay, s, batch)["activations"], want,
                f"{what(model)}, s = {s}, {lay}, global batch {batch}: activation bytes", clause=clause)


def _name(model):
    return {id(GPT13): "GPT-3 1.3B", id(LLAMA): "Llama 3 8B", id(LLAMA4): "Llama 3 8B cut to 4 layers",
            id(COURSE): "the course GPT", id(MIXTRAL): "Mixtral 8x7B"}[id(model)]


@observes("ex10.C.one_stage")
def test_activations_without_pipeline(impl):
    """One GPU: the peak activation bytes, with one micro-batch and with GPipe's four."""
    _activations(NOPIPE, _name)


@observes("ex10.C.recompute")
def test_full_recompute_adds_one_layer(impl):
    """Full recomputation on 4 stages of the course's GPT, and on one and two stages of Llama 3 8B with flash
    attention: the busiest stage's activation bytes."""
    _activations(FULL, _name)


@observes("ex10.C.in_flight")
def test_pipeline_in_flight(impl):
    """1F1B, GPipe and interleaved 1F1B on 4 stages (and 1F1B on 5, an uneven cut), with and without
    data parallelism: the busiest stage's activation bytes."""
    _activations(INFLIGHT, _name)


@observes("ex10.C.last_stage", "ex10.C.logits")
def test_last_stage_with_big_logits(impl):
    """Two stages, big logits, one and several micro-batches, 1F1B, GPipe, interleaved 1F1B and ZB-H1: which
    stage is the busiest, and its bytes."""
    _activations(LAST, _name)


@observes("ex10.C.bucket", "ex10.C.sp_input", "ex10.C.boundary", "ex10.C.zero3")
def test_buffers(impl):
    """The communication buffers of each kind of parallelism, and their total."""
    for clause, model, lay, s, want in BUF:
        sp = "" if lay.sequence_parallel else " without sequence parallelism"
        _approx(comm_buffer_bytes(model, lay, s), want, f"{_name(model)}, s = {s}, {lay}{sp}: buffer bytes", clause=clause)
    lay = plan.Layout(dp=4, tp=2, zero=3, recompute="selective")
    m = plan.memory_per_gpu(LLAMA, lay, 8192, 4)
    _approx(m["buffers"], comm_buffer_bytes(LLAMA, lay, 8192), f"Llama 3 8B, {lay}: memory_per_gpu's buffers")
    _approx(m["total"], sum(v for k, v in m.items() if k != "total"), "memory_per_gpu's total")
