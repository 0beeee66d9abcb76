"""ex10's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""
from minipar.course.graded import test_ex10_planning as g
from tests.planted import contract_tests, more_tests

FLIGHT = "        in_flight = 1 if (r == L.pp - 1 and r > 0) else peak_activations(L.schedule, L.pp, m, r, L.v) / L.v"
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex10.A.measured": (   # selective recomputation that keeps the scores
        [('terms[k] = 0.0 if L.recompute == "selective" or flash else terms[k] * L.cp',
          'terms[k] = 0.0 if flash else terms[k] * L.cp')],
        g.test_layer_activations_against_measured,
        r"the course GPT's block \(h = 32, a = 2\), s = 16, 1 GPU \(b=4, fp32, selective recompute, materialized attention\): bytes of one "
        r"layer, against the 132,096 measured"),
    "ex10.B.measured": (   # the dense share not divided by tp: twice what a tp rank holds
        [("zero_bytes_per_rank(dense / (L.tp * L.pp), L.dp * L.cp", "zero_bytes_per_rank(dense / L.pp, L.dp * L.cp")],
        g.test_model_states_against_measured,
        r"the course GPT \(Ψ = 27,552\), dp2·tp2 \(b=1, fp32, ZeRO-1\): params bytes, against the 57,216 measured: "
        r"estimated 110,208 bytes, expected 57,216 \(1\.926× the expected\)"),
    "ex10.A.gpt": (
        [("        return e * s * L.micro_batch * h / (t if L.sp else 1)", "        return e * s * L.micro_batch * h")],
        g.test_layer_activations_of_a_gpt, r"tp = 4, sequence parallel True, recompute='full': bytes of one layer"),
    "ex10.A.shapes": (
        [('    terms["Q, K, V"] *= (h + 2 * model.kv_dim) / (3 * h)\n', "")],
        g.test_layer_activations_of_other_shapes, r"Llama 3 8B, s = 8192, selective: bytes of one layer"),
    "ex10.A.experts": (
        [(" * (1.5 if model.gated else 1.0) * model.top_k", " * (1.5 if model.gated else 1.0)")],
        g.test_layer_activations_of_other_shapes, r"Mixtral 8x7B, s = 8192, selective: bytes of one layer"),
    "ex10.A.cp": (
        [("else terms[k] * L.cp", "else terms[k]")],
        g.test_layer_activations_with_cp, r"Llama 3 8B, s = 8192, cp2 \(b=1, bf16, materialized attention\): bytes of one layer(?s:.*)breaks ex10\.A\.cp"),
    "ex10.A.flash": (
        [('        terms["log-sum-exp"] = 4 * s * L.micro_batch * model.n_head / t', '        pass')],
        g.test_layer_activations_with_cp, r"Llama 3 8B, s = 8192, 1 GPU \(b=1, bf16, flash attention\): bytes of one layer(?s:.*)breaks ex10\.A\.flash"),
    "ex10.B.local": (     # the pipeline stages each hold every dense parameter
        [("zero_bytes_per_rank(dense / (L.tp * L.pp), L.dp * L.cp", "zero_bytes_per_rank(dense / L.tp, L.dp * L.cp")],
        g.test_model_states, r"Llama 3 8B, dp2·tp2·pp2 \(b=1, bf16, ZeRO-1\): params bytes(?s:.*)breaks ex10\.B\.local"),
    "ex10.B.bytes": (
        [("    k = 12 if e == 2 else 8", "    k = 12")],
        g.test_model_states, r"Llama 3 8B, 1 GPU \(b=1, fp32, full recompute\): optimizer bytes"),
    "ex10.B.zero": (
        [("    parts = [zero_bytes_per_rank(dense / (L.tp * L.pp), L.dp * L.cp, L.zero",
          "    parts = [zero_bytes_per_rank(dense / (L.tp * L.pp), L.dp, L.zero")],
        g.test_model_states, r"Llama 3 8B, dp4·cp2 \(b=1, bf16, ZeRO-2\): grads bytes"),
    "ex10.B.experts": (
        [("experts / (L.tp * L.pp * L.ep), L.dp * L.cp // L.ep", "experts / (L.tp * L.pp), L.dp * L.cp")],
        g.test_model_states_of_experts, r"Mixtral 8x7B, dp8·ep8 \(b=1, bf16, ZeRO-1\): params bytes"),
    "ex10.C.even": (
        [("    for r in ([0, pp - 1] + list(range(1, pp - 1)))[:fewer]:",
          "    for r in ([0, pp - 1] + list(range(1, pp - 1)))[:max(fewer, 2 * (pp > 2))]:")],
        g.test_stage_layers, r"stage_layers\(32, 4\): layers per stage"),
    "ex10.C.uneven": (
        [("    for r in ([0, pp - 1] + list(range(1, pp - 1)))[:fewer]:", "    for r in list(range(pp))[:fewer]:")],
        g.test_stage_layers, r"stage_layers\(126, 16\): layers per stage"),
    "ex10.C.in_flight": (
        [(FLIGHT, "        in_flight = 1 if (r == L.pp - 1 and r > 0) else min(L.pp, m)")],
        g.test_pipeline_in_flight, r"GPT-3 1.3B, s = 2048, tp2·pp4 \(b=1, bf16, GPipe, selective recompute\), global batch 16: activation bytes"),
    "ex10.C.last_stage": (
        [(FLIGHT, "        in_flight = peak_activations(L.schedule, L.pp, m, r, L.v) / L.v")],
        g.test_last_stage_with_big_logits, r"Llama 3 8B, s = 8192, pp2 \(b=1, bf16, GPipe, selective recompute\), global batch 4: activation bytes"),
    "ex10.C.recompute": (
        [('    rebuilt = layer_activation_bytes(model, L.replace(recompute="none"), seq_len) if L.recompute == "full" else 0.0',
          "    rebuilt = 0.0")],
        g.test_full_recompute_adds_one_layer, r"the course GPT, s = 16, pp4 \(b=1, bf16, full recompute\), global batch 16: activation bytes(?s:.*)breaks ex10\.C\.recompute"),
    "ex10.C.logits": (
        [("    logits = 4 * (seq_len // L.cp) * L.micro_batch * model.vocab / L.tp",
          "    logits = 4 * seq_len * L.micro_batch * model.vocab")],
        g.test_last_stage_with_big_logits, r"Llama 3 8B, s = 8192, tp2·pp2·cp2 \(b=1, bf16, selective recompute\), global batch 1: activation bytes"),
    "ex10.C.one_stage": (
        [("(logits if r == L.pp - 1 else 0.0)", "(logits if r == L.pp - 1 and r > 0 else 0.0)")],
        g.test_activations_without_pipeline, r"GPT-3 1.3B, s = 2048, 1 GPU \(b=2, bf16\), global batch 2: activation bytes"),
    "ex10.C.bucket": (
        [("    out = BUCKET if L.dp * L.cp > 1 else 0.0", "    out = BUCKET if L.dp > 1 else 0.0")],
        g.test_buffers, r"s = 8192, cp2 \(b=1, bf16\): buffer bytes"),
    "ex10.C.sp_input": (
        [("    if L.tp > 1:\n        out += e * sbh\n", "")],
        g.test_buffers, r"s = 8192, tp2 \(b=1, bf16\): buffer bytes"),
    "ex10.C.boundary": (
        [("        out += 2 * e * sbh / (L.tp if L.sp else 1)", "        out += 2 * e * sbh")],
        g.test_buffers, r"s = 8192, tp2·pp2 \(b=1, bf16\): buffer bytes"),
    "ex10.C.zero3": (
        [("        out += e * (model.num_params() / model.n_layer) / L.tp", "        out += e * model.num_params() / L.tp")],
        g.test_buffers, r"dp8 \(b=1, bf16, ZeRO-3\): buffer bytes"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex10", g, PLANTS)

FULL = "        return e * s * L.micro_batch * h / (t if L.sp else 1)"
LSE = '        terms["log-sum-exp"] = 4 * s * L.micro_batch * model.n_head / t'
REBUILT = '    rebuilt = layer_activation_bytes(model, L.replace(recompute="none"), seq_len) if L.recompute == "full" else 0.0'
GELU = ('    terms["GeLU input and output"] *= (model.ffn_width / (4 * h)) * (1.5 if model.gated else 1.0) * model.top_k\n')
MORE = [  # further wrong answers: (clause, edits, graded test, what the message must name)
    # the shorter stages taken from both ends in turn: first, last, second, second-to-last
    ("ex10.C.uneven", [("    for r in ([0, pp - 1] + list(range(1, pp - 1)))[:fewer]:",
                        "    for r in sorted(range(pp), key=lambda r: 2 * min(r, pp - 1 - r) + (r > pp - 1 - r))[:fewer]:")],
     g.test_stage_layers, r"stage_layers\(12, 8\): layers per stage(?s:.*)breaks ex10\.C\.uneven"),
    ("ex10.A.flash", [(LSE, LSE[:-4])],                                     # the log-sum-exp not split over tp
     g.test_layer_activations_with_cp, r"Llama 3 8B, s = 8192, tp2 \(b=1, bf16, flash attention\)(?s:.*)breaks ex10\.A\.flash"),
    ("ex10.A.flash", [("    if flash:  ", '    if flash and L.recompute != "selective":  ')],   # dropped by selective
     g.test_layer_activations_with_cp, r"Llama 3 8B, s = 8192, 1 GPU \(b=1, bf16, selective recompute, flash attention\)(?s:.*)breaks ex10\.A\.flash"),
    ("ex10.C.in_flight", [("    m = L.microbatches(global_batch)", "    m = global_batch // L.micro_batch")],  # dp ignored
     g.test_pipeline_in_flight, r"GPT-3 1.3B, s = 2048, dp2·tp2·pp4 .*global batch 32(?s:.*)breaks ex10\.C\.in_flight"),
    ("ex10.C.in_flight", [("enumerate(stage_layers(model.n_layer, L.pp))", "enumerate([model.n_layer / L.pp] * L.pp)")],
     g.test_pipeline_in_flight, r"GPT-3 1.3B, s = 2048, tp2·pp5 (?s:.*)breaks ex10\.C\.in_flight"),      # every stage l/p layers
    ("ex10.C.recompute", [("in_flight * layers * per_layer + rebuilt + (logits if r == L.pp - 1 else 0.0)",
                           "in_flight * layers * per_layer + (rebuilt + logits if r == L.pp - 1 else 0.0)")],
     g.test_full_recompute_adds_one_layer, r"the course GPT, s = 16, pp4 (?s:.*)breaks ex10\.C\.recompute"),  # rebuilt on the last stage only
    ("ex10.C.boundary", [("        out += 2 * e * sbh / (L.tp if L.sp else 1)", "        out += 2 * e * sbh / L.tp")],
     g.test_buffers, r"Llama 3 8B, s = 8192, tp2·pp2 \(b=1, bf16\) without sequence parallelism(?s:.*)breaks ex10\.C\.boundary"),   # split without SP
    ("ex10.C.last_stage", [(FLIGHT, FLIGHT.replace("(r == L.pp - 1 and r > 0)", "(r == L.pp - 1 and r > 0 and L.v == 1)"))],
     g.test_last_stage_with_big_logits, r"Llama 3 8B cut to 4 layers(?s:.*)breaks ex10\.C\.last_stage"),   # interleaved: peak/v
    ("ex10.C.one_stage", [(FLIGHT, FLIGHT.replace("(r == L.pp - 1 and r > 0)", "(r == L.pp - 1)"))],
     g.test_activations_without_pipeline, r"GPT-3 1.3B, s = 2048, 1 GPU \(b=1, bf16, GPipe\), global batch 4(?s:.*)breaks ex10\.C\.one_stage"),
    ("ex10.B.zero", [("L.dp * L.cp, L.zero, k, e, padded=False)]", "L.dp * L.cp, L.zero, k, e, padded=True)]")],
     g.test_model_states, r"the course GPT \(Ψ = 27,552\), dp5 (?s:.*)breaks ex10\.B\.zero"),            # ZeRO's padding counted
    ("ex10.A.cp", [("else terms[k] * L.cp", "else terms[k] / L.cp")],      # the scores split like the tokens
     g.test_layer_activations_with_cp, r"Llama 3 8B, s = 8192, cp2 .*: bytes of one layer: estimated .* \(0\.\d+× the expected\)(?s:.*)breaks ex10\.A\.cp"),
    ("ex10.A.gpt", [("    terms = activation_terms(s, L.micro_batch, h, model.n_head, t, L.sp,",     # tp forgotten
                     "    terms = activation_terms(s, L.micro_batch, h, model.n_head, 1, L.sp,")],
     g.test_layer_activations_of_a_gpt, r"tp = 2, sequence parallel False, recompute='none': bytes of one layer"),
    ("ex10.B.experts", [("L.dp * L.cp // L.ep,", "L.dp * L.cp,")],          # experts sharded over all dp·cp
     g.test_model_states_of_experts, r"Mixtral 8x7B, dp8·ep8 \(b=1, bf16, ZeRO-1\): optimizer bytes"),
    ("ex10.A.cp", [(FULL, FULL.replace("e * s *", "e * seq_len *"))],      # full recomputation: the whole sequence
     g.test_layer_activations_with_cp, r"Llama 3 8B, s = 8192, cp2 \(b=1, bf16, full recompute\): bytes of one layer(?s:.*)breaks ex10\.A\.cp"),
    ("ex10.A.flash", [(FULL, FULL + ' + (4 * s * L.micro_batch * model.n_head / t if L.attention_on() == "flash" else 0)')],
     g.test_layer_activations_with_cp,                                      # the log-sum-exp kept under full too
     r"Llama 3 8B, s = 8192, 1 GPU \(b=1, bf16, full recompute, flash attention\)(?s:.*)breaks ex10\.A\.flash"),
    ("ex10.A.flash", [("dropout=model.dropout)", 'dropout=model.dropout and L.attention_on() != "flash")')],
     g.test_layer_activations_with_cp,                                      # every dropout mask dropped under flash
     r"GPT-3 1\.3B, s = 2048, 1 GPU \(b=1, bf16, flash attention\): bytes of one layer(?s:.*)breaks ex10\.A\.flash"),
    ("ex10.C.zero3", [("        out += e * (model.num_params() / model.n_layer) / L.tp",      # the gathered layer over ep
                       "        out += e * (model.num_params() / model.n_layer) / (L.tp * L.ep)")],
     g.test_buffers, r"Mixtral 8x7B, s = 8192, dp8·ep8 \(b=1, bf16, ZeRO-3\): buffer bytes(?s:.*)breaks ex10\.C\.zero3"),
    ("ex10.C.sp_input", [("    if L.tp > 1:\n        out += e * sbh", "    if L.sp:\n        out += e * sbh")],  # only with SP
     g.test_buffers, r"Llama 3 8B, s = 8192, tp2 \(b=1, bf16\) without sequence parallelism: buffer bytes(?s:.*)breaks ex10\.C\.sp_input"),
    ("ex10.C.recompute", [(REBUILT, REBUILT.replace('recompute="none"', 'recompute="none", attention="materialized"'))],
     g.test_full_recompute_adds_one_layer,                                  # the rebuilt layer with s² scores under flash
     r"Llama 3 8B, s = 8192, .*flash attention(?s:.*)breaks ex10\.C\.recompute"),
    ("ex10.C.recompute", [(REBUILT, REBUILT.replace('if L.recompute == "full"', 'if L.recompute == "full" and L.pp > 1'))],
     g.test_full_recompute_adds_one_layer,                                  # no rebuilt layer on one stage
     r"Llama 3 8B, s = 8192, 1 GPU .*global batch 1: activation bytes(?s:.*)breaks ex10\.C\.recompute"),
    ("ex10.C.last_stage", [(FLIGHT, FLIGHT.replace("(r == L.pp - 1 and r > 0)", '(r == L.pp - 1 and r > 0 and L.schedule != "zb-h1")'))],
     g.test_last_stage_with_big_logits, r"Llama 3 8B cut to 4 layers, s = 8192, pp2 \(b=1, bf16, ZB-H1, selective recompute\)(?s:.*)breaks ex10\.C\.last_stage"),
    ("ex10.A.experts", [(GELU, GELU + '    if "dropout masks (attention, MLP)" in terms:\n'             # the MLP's mask per expert
                               '        terms["dropout masks (attention, MLP)"] *= (1 + model.top_k) / 2\n')],
     g.test_layer_activations_of_other_shapes, r"Mixtral 8x7B with dropout 0\.1, s = 8192(?s:.*)breaks ex10\.A\.experts"),
]


test_more_wrong_answers_fail = more_tests("ex10", g, MORE, name_clause=True)
