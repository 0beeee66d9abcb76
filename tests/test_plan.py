"""The planner (minipar.plan) against published results and its own formulas.

Tolerances:
* Narayanan et al. 2021, Table 1 (the fitting set): the roofline's two numbers (f_max, x_half)
  are fitted on rows 1, 5 and 10 and every row is reported; each within 10%, the mean absolute
  error under 5% (the issue's goal; one constant efficiency gave 15.1% / 8.2%). Table 1 alone
  hardly tells the terms apart, so test_step_time_terms and test_roofline_counts_every_operation
  check each term against its formula.
* Korthikanti et al. 2022, Table 5 (not fitted; same A100s, selective recomputation and SP):
  MFU within 10% per row.
* Llama Team 2024, Table 4 (not fitted; H100, Llama 3 405B, flash attention, CP at 128K):
  MFU within 15% per row (the schedule is not published; see the test).
* NVIDIA DGX Cloud Benchmarking 25.02.01 (not fitted; H100 BF16, NeMo, six models from Llama 3.1 8B
  to 405B, GPT-3 175B and Nemotron-4 15B/340B, 32 measured step times from 16 to 2,304 GPUs): each
  within 10%, the mean under 5% (the fitting set's own bar: a measured step time, not a derived
  rate, and the configuration published with it). The planner errs low on 31 of the 32 (it models no
  kernel-launch gaps, stragglers or clock throttling), so the test also bounds the bias.
  The search puts NVIDIA's tuned layout within 2% of its fastest (a near-tie) for 5 of the 6
  jobs, and within 8% for all.
* Korthikanti et al. 2022: the activation formulas exactly (to rounding, rel 1e-12), their 5x saving.
* ZeRO (Rajbhandari et al. 2020, Figure 1): 120, 31.4, 16.6, 1.9 GB for 7.5B on 64 GPUs.
"""

import pytest

from minipar import cost, plan
from minipar.plan import roofline
from minipar.plan.calibrate import fit_roofline
from minipar.plan.overlap import bucketed
from minipar.plan.published import (DGXC_H100_BF16, KORTHIKANTI_SP_SELECTIVE_MEMORY, KORTHIKANTI_TABLE5,
                                             LLAMA3_TABLE4, TABLE1, TABLE1_FIT_ROWS, dgxc_against_search, dgxc_run,
                                             korthikanti_run, llama3_run, table1_layout, table1_model)
from minipar.plan.roofline import ATTENTION, TABLE1_FIT


def _table1(efficiency, rows=TABLE1):
    out = []
    for r in rows:
        lay, B = table1_layout(r)
        out.append(plan.predict(table1_model(r), "selene", lay, B, efficiency=efficiency).tflops_per_gpu)
    return out


def test_table1_roofline_fit_within_10_percent():
    """Narayanan et al. Table 1: two roofline numbers fitted on rows 1, 5, 10; every row within 10%, mean 5%."""
    fit_rows = [TABLE1[i] for i in TABLE1_FIT_ROWS]
    eff = fit_roofline(lambda e: _table1(e, fit_rows), [r[-1] for r in fit_rows], steps=9, rounds=3)
    assert eff.f_max == pytest.approx(TABLE1_FIT.f_max, abs=0.01) and eff.x_half == pytest.approx(TABLE1_FIT.x_half, abs=0.02)
    errors = [p / r[-1] - 1 for p, r in zip(_table1(None), TABLE1)]   # None: the stored fit
    assert max(abs(x) for x in errors) < 0.10, errors
    assert sum(abs(x) for x in errors) / len(errors) < 0.05, errors
    for r in TABLE1:   # the parameter counts of the table, within 5%
        assert table1_model(r).num_params() / 1e9 == pytest.approx(r[0], rel=0.05)


def test_korthikanti_table5_mfu_within_10_percent():
    """Korthikanti et al. Table 5 (not fitted): SP + selective recomputation, MFU 41.5-56.3%, each within 10%.
    Why 10%: the same chip as the fit but another method (no full recomputation); the MFU the paper
    reports counts FLOPs as Table 1 does, so what is left is the model's error on another mix of work."""
    for row in KORTHIKANTI_TABLE5:
        spec, lay, B = korthikanti_run(row)
        p = plan.predict(spec, "selene", lay, B)
        assert p.fits, row
        assert p.mfu == pytest.approx(row[-1], rel=0.10), (row[0], p.mfu)


def test_llama3_table4_mfu_within_15_percent():
    """Llama 3 405B, Table 4 (not fitted: H100, GQA + SwiGLU, flash attention): MFU 43/41/38% within 15%.
    Why 15%: the schedule is not published (interleaved 1F1B, tuned; the planner runs v = 2, b = 1),
    and v moves the bubble, a third of these steps, by half; nor is how Meta counts attention FLOPs.
    Megatron's interleaving with v = 2 would not fit these layouts here (at m = p every stage starts all 16
    micro-batches: 81.6 GB of 81.2 usable at 16K GPUs); the time, not the memory, is what is checked."""
    for row in LLAMA3_TABLE4:
        lay, B, s = llama3_run(row)
        p = plan.predict("llama3-405b", "llama3-h100", lay.replace(v=2, schedule="interleaved"), B, s)
        assert p.mfu == pytest.approx(row[-1], rel=0.15), (row, p.mfu)
        assert p.time["comm"].get("cp", {"exposed": 0})["exposed"] < 0.05 * p.step_time


def test_nvidia_dgx_cloud_h100_step_times_within_10_percent():
    """NVIDIA DGX Cloud Benchmarking, H100 BF16 (not fitted): 32 measured step times of 6 models, each
    within 10%, mean under 5%, bias under 8%; every published layout fits in memory as the planner counts it."""
    errors = {}
    for row in DGXC_H100_BF16:
        for k, (gpus, _batch, seconds) in enumerate(row[-1]):
            model, lay, B, s, nodes = dgxc_run(row, k)
            p = plan.predict(model, "dgx-h100", lay, B, s, nodes=nodes)
            assert p.fits and lay.world == gpus, (row[0], gpus, p.reason)
            errors[row[0], gpus] = p.step_time / seconds - 1
    assert len(errors) == 32 and max(map(abs, errors.values())) < 0.10, errors
    assert sum(map(abs, errors.values())) / len(errors) < 0.05, errors
    assert abs(sum(errors.values()) / len(errors)) < 0.08, errors


@pytest.mark.slow   # a full search
def test_search_ranks_nvidias_tuned_layouts_at_the_top():
    """Asked for the fastest layout of each NVIDIA job (its cluster, batch and sequence; the framework's
    TP overlap: "auto" on a GPU; its v among the virtual stages tried), the search puts the tuned
    layout within 2% of its fastest, a near-tie it cannot rank, for 5 of the 6, and within 8% for all."""
    gaps = {}
    for row in DGXC_H100_BF16:
        _tuned, fastest, same = dgxc_against_search(row)
        gaps[row[0]] = same.step_time / fastest.step_time - 1
    assert max(gaps.values()) < 0.08 and sum(g <= plan.search_module.NEAR_TIE for g in gaps.values()) >= 5, gaps


def test_the_busiest_stage_sets_the_pace():
    """A pipeline runs at its busiest stage's pace: the last holds the head and the loss (a 32K
    vocabulary here, more than a layer), the first the embedding; spreading them over the stages
    would predict a faster step."""
    spec = plan.ModelSpec("head-heavy", n_layer=8, hidden=1024, n_head=16, vocab=32768, seq_len=1024, dropout=False)
    lay = plan.Layout(pp=4, micro_batch=1)
    t = plan.step_time(spec, lay, plan.get_cluster("dgx-h100"), 1024, 8)["detail"]
    from minipar.plan import roofline
    gpu = plan.get_accelerator("H100")
    head = roofline.head_ops(spec, lay, 1024)
    last = 2 * (t["layer_fwd"] + t["layer_bwd"]) + roofline.ops_time(head + roofline.backward(head), gpu)
    assert roofline.ops_time(head, gpu) > t["layer_fwd"]                 # the head outweighs a layer
    assert t["microbatches"] == pytest.approx(8 * last, rel=1e-12)
    assert t["stage_bwd"] == pytest.approx(2 * t["layer_bwd"] + roofline.ops_time(roofline.backward(head), gpu),
                                           rel=1e-12)


def test_llama3_published_layout_memory_without_full_recomputation():
    """The published 405B layout (TP8 PP16, 8K and CP16 at 128K) fits without recomputation under flash attention
    (Llama 3 §3.3.2), as the planner cuts and counts it: 126 layers as 7, 8 × 14, 7 (one fewer on the first and
    last stages, as Llama 3 did), so the busiest stage is the second, 15 micro-batches in flight of 8 layers; the
    H100's 81,559 MiB (the driver's count), 95% usable. Materialized scores would need 4.5 TB at 128K."""
    from minipar.plan.memory import stage_layers
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]
    for row in LLAMA3_TABLE4[1:]:
        lay, B, s = llama3_run(row)
        flash = plan.predict("llama3-405b", "llama3-h100", lay, B, s)
        mat = plan.predict("llama3-405b", "llama3-h100", lay.replace(attention="materialized"), B, s)
        assert mat.memory["total"] > (4e12 if s > 8192 else 3e11)
        per_layer = plan.layer_activation_bytes(plan.MODELS["llama3-405b"], flash.layout, s)
        assert flash.memory["activations"] == pytest.approx(15 * 8 * per_layer, rel=1e-12)
        assert flash.fits, flash.reason


def test_flash_attention_has_no_s2_term():
    """Flash attention's layer activations grow linearly in s (Q, K, V, O and the log-sum-exp); materialized quadratically."""
    spec = plan.MODELS["llama3-8b"]
    for attn, ratio in (("flash", 2.0), ("materialized", None)):
        lay = plan.Layout(tp=2, attention=attn)
        a, b = (plan.layer_activation_bytes(spec, lay, s) for s in (4096, 8192))
        if ratio:
            assert b / a == pytest.approx(ratio, rel=1e-12)
        else:
            assert b / a > 2.5
    lse = plan.layer_activation_bytes(spec, plan.Layout(attention="flash"), 4096) - \
        plan.layer_activation_bytes(spec, plan.Layout(attention="materialized", recompute="selective"), 4096)
    assert lse == 4 * 4096 * spec.n_head                             # fp32 per row and head
    assert plan.Layout().attention_on(plan.get_accelerator("H100")) == "flash"
    assert plan.Layout().attention_on() == "materialized"


def test_roofline_counts_every_operation():
    """The layer's GEMMs and attention core add up to Narayanan's 24bsh² + 4bs²h; a GEMM's rate is
    min(peak, I·bw) × f × waves; memory-bound ops at HBM bandwidth; the backward doubles GEMMs, flash 2.5×."""
    spec, h, s = table1_model(TABLE1[3]), TABLE1[3][2], 2048
    for attn in ATTENTION:
        ops = roofline.layer_ops(spec, plan.Layout(tp=8, attention=attn), s, attn)
        flops = sum(o.count * o.flops for o in ops)
        assert flops == pytest.approx((24 * s * h * h + 4 * s * s * h) / 8, rel=1e-12)
        back = roofline.backward(ops)
        core = 0 if attn == "materialized" else 4 * s * s * h / 8
        want = 2 * (flops - core) + 2.5 * core                       # flash's backward recomputes the scores
        assert sum(o.count * o.flops for o in back) == pytest.approx(want, rel=1e-12)
    a100, eff = plan.get_accelerator("A100"), roofline.Efficiency(0.7, 0.5)
    sq, skinny = roofline.gemm("sq", 8192, 8192, 8192, 2), roofline.gemm("skinny", 8192, 8192, 16, 2)
    assert skinny.intensity == pytest.approx(1 / (1 / 8192 + 1 / 8192 + 1 / 16))
    x = sq.intensity / (a100.peak_flops / a100.hbm_bw)
    waves = 4096 / (38 * 108)                                      # 64 × 64 tiles of 128 × 128 on 108 SMs
    assert roofline.rate(sq, a100, eff) == pytest.approx(a100.peak_flops * 0.7 * x / (x + 0.5) * waves)
    assert roofline.rate(skinny, a100, eff) < skinny.intensity * a100.hbm_bw
    mem = roofline.memory("norm", 1e9)
    assert roofline.op_time(mem, a100) == pytest.approx(1e9 / a100.hbm_bw)
    assert roofline.waves(roofline.gemm("g", 128 * 109, 128, 64, 2), 108) == pytest.approx(109 / 216)


def test_overlap_is_modelled():
    """DP buckets hide behind the backward except the tail; CP ring steps behind each block's attention; hidden costs HBM."""
    assert bucketed(1.0, 4, 10.0) == pytest.approx(0.25)          # only the last bucket is past the window
    assert bucketed(8.0, 4, 2.0) == pytest.approx(6.5)            # starts after a quarter, runs 8
    spec = plan.MODELS["llama3-8b"]
    one = plan.predict(spec, "dgx-h100", plan.Layout(dp=8), 8, 8192, nodes=1)
    dp = one.time["comm"]["dp"]
    assert 0 < dp["exposed"] < dp["seconds"] and dp["contention"] > 0
    cp = plan.predict(spec, "dgx-h100", plan.Layout(cp=8), 8, 8192, nodes=1).time["comm"]["cp"]
    assert cp["exposed"] < 0.5 * cp["seconds"]                    # 8K tokens: most sends behind their blocks
    slow = plan.get_cluster("dgx-h100").with_nodes(2)
    cp2 = plan.predict(spec, slow, plan.Layout(cp=16), 16, 8192, nodes=2).time["comm"]["cp"]
    assert cp2["link"].endswith("per node") and cp2["exposed"] > cp["exposed"]


def test_no_ties_by_construction():
    """Llama 3 8B on one node: the first twelve layouts do not all tie (they did at 13.64 s); near-ties are named."""
    r = plan.search("llama3-8b", "dgx-h100", global_batch=8, seq_len=8192, nodes=1)
    top = [p.step_time for p in r.ranked[:12]]
    assert len(set(top)) >= 10 and r.best.mfu < 0.65
    text = r.explain()
    assert "bottleneck" in text and ("near-tie" in text) == r.near_tie(r.ranked[0], r.ranked[1])
    group = [p for p in r.ranked if r.near_tie(r.ranked[0], p)]
    assert [p.memory["total"] for p in group] == sorted(p.memory["total"] for p in group)


def test_bottlenecks():
    """Each layout names what bounds it: compute, the bubble, or exposed communication on a link."""
    big = plan.predict("llama3-405b", "llama3-h100", plan.Layout(dp=128, tp=8, pp=16, zero=1), 2048, 8192)
    assert set(big.bottlenecks()) >= {"compute-bound", "memory-bound", "bubble"}
    assert big.bottleneck.startswith("compute-bound")
    bubbly = plan.predict("llama3-70b", "dgx-h100", plan.Layout(dp=1, tp=8, pp=8, recompute="full"), 4, 8192, nodes=8)
    assert bubbly.bottleneck.startswith("bubble")
    slow_link = plan.Layout(tp=8, dp=4, recompute="full", overlap_tp=False)   # PCIe, nothing hidden
    cross = plan.predict("llama3-8b", "cloud-l4", slow_link, 32, 4096)
    assert "exposed tp communication" in cross.bottleneck
    hidden = plan.predict("llama3-8b", "cloud-l4", slow_link.replace(overlap_tp=True), 32, 4096)
    assert hidden.time["comm"]["tp"]["exposed"] < cross.time["comm"]["tp"]["exposed"]


def test_step_time_terms():
    """The 1T row's step: bubble (p-1)/m of the micro-batches, TP bytes of 1.5 × m·l/p layers, DP exposed after the flush."""
    row = TABLE1[-1]
    lay, B = table1_layout(row)
    spec, cl = table1_model(row), plan.get_cluster("selene")
    t = plan.step_time(spec, lay, cl, 2048, B)
    m = lay.microbatches(B)
    assert m == 512 and t["bubble"] == pytest.approx(63 / 512 * t["detail"]["microbatches"])
    assert t["compute"] == pytest.approx(t["detail"]["microbatches"] + t["detail"]["optimizer"])
    per = cost.tp_comm_bytes_per_layer(1, 2048, spec.hidden, 8, 2, True)
    assert t["comm"]["tp"]["bytes"] == pytest.approx(1.5 * m * 2 * per)            # 128 layers / 64 stages
    assert t["comm"]["tp"]["exposed"] == t["comm"]["tp"]["seconds"] > 0
    assert t["comm"]["dp"]["exposed"] == t["comm"]["dp"]["seconds"] > 0
    assert t["total"] == pytest.approx(t["compute"] + t["bubble"] + sum(c["exposed"] for c in t["comm"].values()))


def test_flops_formula_is_narayanans():
    """training_flops with full recomputation equals 96Bslh²(1 + s/6h + V/16lh); the spec's count agrees."""
    for B, s, l, h, V in [(512, 2048, 24, 2304, 51200), (8, 1024, 96, 12288, 50257)]:
        assert cost.training_flops(B, s, l, h, V, "full") == pytest.approx(cost.narayanan_flops(B, s, l, h, V), rel=1e-12)
        spec = plan.ModelSpec("x", l, h, h // 128, V, s)
        got = plan.step_flops(spec, plan.Layout(recompute="full"), s, B)["hardware"]
        assert got == pytest.approx(cost.narayanan_flops(B, s, l, h, V), rel=1e-12)
        no = plan.step_flops(spec, plan.Layout(), s, B)["hardware"]
        assert no == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12)


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 6144, 64, 8), (2048, 4, 12288, 96, 8), (64, 2, 32, 4, 2)])
def test_korthikanti_activation_formulas_exact(s, b, h, a, t):
    """sbh(34 + 5as/h), its TP, TP+SP and selective forms, and 2sbh for full, exactly."""
    sbh = s * b * h
    f = cost.recompute_activation_bytes
    assert f(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    assert f(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert f(s, b, h, a, t, True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert f(s, b, h, a, recompute="selective") == 34 * sbh
    assert f(s, b, h, a, t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    assert f(s, b, h, a, t, True, recompute="selective") == pytest.approx(34 * sbh / t, rel=1e-12)
    assert f(s, b, h, a, recompute="full") == 2 * sbh
    assert f(s, b, h, a, t, True, recompute="full") == 2 * sbh / t
    # the planner's per-layer count is the same formula for a GPT-shaped model
    spec = plan.ModelSpec("g", 2, h, a, 1000, s)
    for rc in ("none", "selective", "full"):
        for tp, sp in ((1, False), (t, False), (t, True)):
            lay = plan.Layout(tp=tp, micro_batch=b, recompute=rc, sequence_parallel=sp)
            assert plan.layer_activation_bytes(spec, lay, s) == pytest.approx(f(s, b, h, a, tp, sp, rc), rel=1e-12)


def test_korthikanti_published_savings():
    """SP + selective recomputation keep about 20% of TP alone's activations (the paper's 5x)."""
    for h, a in [(6144, 64), (12288, 96), (20480, 128), (25600, 160)]:   # 22B, 175B, 530B, 1T; t = 8
        tp_only = cost.recompute_activation_bytes(2048, 1, h, a, 8)
        both = cost.recompute_activation_bytes(2048, 1, h, a, 8, True, "selective")
        assert 0.15 < both / tp_only <= KORTHIKANTI_SP_SELECTIVE_MEMORY + 0.005
    # the FLOPs full recomputation adds on 22B: one more forward of the layers, ~1/3
    extra = cost.recompute_flops(1, 2048, 6144, 48, "full") / cost.training_flops(1, 2048, 48, 6144, 51200, "none")
    assert 0.32 < extra < 0.34


def test_zero_paper_figure1():
    """7.5B parameters on 64 GPUs, K = 12: 120, 31.4, 16.6, 1.9 GB per GPU (ZeRO Figure 1)."""
    want = [120, 31.4, 16.6, 1.9]
    for stage, gb in enumerate(want):
        got = cost.zero_bytes_per_rank(7.5e9, 64, stage, padded=False)["total"] / 1e9
        assert got == pytest.approx(gb, abs=0.06)
    spec = plan.MODELS["gpt3-6.7b"]
    for stage in range(4):
        got = plan.model_state_bytes(spec, plan.Layout(dp=64, zero=stage))
        want = cost.zero_bytes_per_rank(spec.num_params(), 64, stage, padded=False)
        assert sum(got.values()) == pytest.approx(want["total"], rel=1e-12)


def test_catalogues_have_sources_and_shapes():
    """Every catalogue entry names its source; Llama 3 and Mixtral have their published sizes."""
    for table in (plan.MODELS, plan.ACCELERATORS, plan.CLUSTERS):
        assert all(x.source for x in table.values())
    sizes = {"llama3-8b": 8.0, "llama3-70b": 70.6, "llama3-405b": 405.8, "mixtral-8x7b": 46.7, "gpt3-175b": 175.0}
    for k, b in sizes.items():
        assert plan.MODELS[k].num_params() / 1e9 == pytest.approx(b, rel=0.01)
    assert plan.MODELS["mixtral-8x7b"].active_params() / 1e9 == pytest.approx(12.9, rel=0.01)
    assert set(plan.ACCELERATORS) >= {"T4", "L4", "A100", "H100", "H200", "B200"}
    plan.MODELS["mine"] = plan.ModelSpec("mine", 4, 256, 4, 1000, source="a test")
    try:
        assert plan.predict("mine", "colab-t4", plan.Layout(), 8).fits
    finally:
        del plan.MODELS["mine"]


def test_memory_breakdown_llama3_8b():
    """Llama 3 8B on one 80 GB GPU (81,559 MiB as the driver counts): 16 bytes per parameter of model states alone do not fit."""
    p = plan.predict("llama3-8b", "dgx-h100", plan.Layout(recompute="full"), 1, nodes=1)
    Psi = plan.MODELS["llama3-8b"].num_params()
    assert p.memory["params"] == 2 * Psi and p.memory["grads"] == 2 * Psi and p.memory["optimizer"] == 12 * Psi
    assert not p.fits and p.reason.startswith(f"needs {p.memory['total'] / 1e9:.0f} GB per GPU, has 86")
    # each knob shrinks what it should
    base = plan.predict("llama3-8b", "dgx-h100", plan.Layout(dp=8), 8, nodes=1).memory
    sel = plan.predict("llama3-8b", "dgx-h100", plan.Layout(dp=8, recompute="selective"), 8, nodes=1).memory
    assert sel == base                                              # flash attention: no scores to drop
    base, sel = (plan.predict("llama3-8b", "dgx-h100", plan.Layout(dp=8, recompute=rc, attention="materialized"), 8,
                              nodes=1).memory for rc in ("none", "selective"))
    z3 = plan.predict("llama3-8b", "dgx-h100", plan.Layout(dp=8, zero=3), 8, nodes=1).memory
    assert sel["activations"] < base["activations"] and sel["optimizer"] == base["optimizer"]
    assert z3["params"] == base["params"] / 8 and z3["optimizer"] == base["optimizer"] / 8


def test_pipeline_in_flight_microbatches():
    """Activations of the first stage: 1F1B holds min(p, m) micro-batches, GPipe m; interleaved more."""
    spec, s = plan.MODELS["gpt3-1.3b"], 2048
    per_layer = plan.layer_activation_bytes(spec, plan.Layout(pp=4, recompute="selective"), s)
    for sched, n in (("1f1b", 4), ("gpipe", 16)):
        lay = plan.Layout(pp=4, recompute="selective", schedule=sched)
        m = plan.memory_per_gpu(spec, lay, s, 16)
        assert m["activations"] == pytest.approx(n * 6 * per_layer)
    inter = plan.memory_per_gpu(spec, plan.Layout(pp=4, v=2, schedule="interleaved", recompute="selective"), s, 16)
    assert inter["activations"] > 4 * 6 * per_layer


def test_search_rejects_with_reasons_and_ranks():
    """Search: on a node the layouts that fit are ranked and explained, the others rejected with reasons."""
    r = plan.search("llama3-8b", "dgx-h100", global_batch=8, seq_len=4096, nodes=1, micro_batches=(1,))
    times = [p.step_time for p in r.ranked]
    assert len(times) > 1 and all(b >= a / (1 + plan.search_module.NEAR_TIE) for a, b in zip(times, times[1:]))
    assert all(p.fits for p in r.ranked)
    reasons = [why for _, why in r.rejected]
    assert any(why.startswith("needs ") and "GB per GPU, has 86" in why for why in reasons)
    assert any(why.startswith("ZeRO-2 with pipeline parallelism") for why in reasons)
    text = r.explain()
    assert "winner" in text and "runner-up" in text and str(r.best.layout) in text
    single = plan.search("llama3-8b", "colab-t4", global_batch=1, micro_batches=(1,))
    with pytest.raises(ValueError, match="needs .* GB per GPU, has 16"):
        single.best


def test_bad_layout_is_a_plain_error():
    """A layout that cannot run is a ValueError naming the problem."""
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        plan.predict("llama3-8b", "dgx-h100", plan.Layout(tp=3), 8)
    with pytest.raises(ValueError, match="needs 16 GPUs"):
        plan.predict("llama3-8b", "dgx-h100", plan.Layout(dp=16), 16, nodes=1)


def test_405b_needs_four_dimensions():
    """Llama 3 405B on 16K H100: the fastest layout at 8K tokens uses dp, tp and pp; at 128K
    tokens the fastest uses all four, and with materialized attention nothing fits without CP."""
    r = plan.search("llama3-405b", "llama3-h100", global_batch=2048, micro_batches=(1,),
                    recompute=("selective", "full"), zero=(1,), virtual=(1,), max_cp=1)
    assert all(getattr(r.best.layout, d) > 1 for d in ("dp", "tp", "pp"))
    long = plan.search("llama3-405b", "llama3-h100", global_batch=128, seq_len=131072, micro_batches=(1,),
                       recompute=("full",), zero=(1,), virtual=(1,))
    mat = [lay for lay in plan.layouts("llama3-405b", 16384, 8, 128, 131072, micro_batches=(1,), recompute=("full",),
                                       zero=(1,), virtual=(1,), max_cp=1)]
    mat = [lay.replace(attention="materialized") for lay in mat]
    assert not any(plan.predict("llama3-405b", "llama3-h100", lay, 128, 131072).fits for lay in mat
                   if not plan.problems(plan.MODELS["llama3-405b"], lay, 128, 131072))
    assert all(getattr(long.best.layout, d) > 1 for d in ("dp", "tp", "pp", "cp"))


def test_405b_at_8k_on_16k_gpus_keeps_production_tp_and_pp():
    """Llama 3 405B at 8K tokens on 16K H100s, the search as a user runs it: the fastest layouts keep the
    published TP 8 and PP 16 or more (TP's gathers and scatters hidden behind their GEMMs, as current
    frameworks run them) and trade data parallelism for context parallelism: 2048 sequences over DP 128
    leave 16 micro-batches for 16 stages, and a 1F1B bubble of (p-1)/m = 15/16 of the compute. The
    published layout fits without recomputation only under 1F1B; interleaving it needs full recomputation."""
    r = plan.search("llama3-405b", "llama3-h100", global_batch=2048, seq_len=8192)
    assert all(p.layout.tp == 8 and p.layout.pp >= 16 for p in r.ranked[:5])
    assert r.best.layout.cp > 1 and r.best.layout.microbatches(2048) >= 4 * 16
    published = [p for p in r.ranked if (p.layout.dp, p.layout.tp, p.layout.pp, p.layout.cp) == (128, 8, 16, 1)]
    plain = [p for p in published if p.layout.v == 1 and p.layout.recompute == "none"]
    assert plain and plain[0].time["bubble"] == pytest.approx(15 / 16 * plain[0].time["detail"]["microbatches"])
    assert all(p.layout.recompute == "full" for p in published if p.layout.v > 1)
    assert min(p.step_time for p in published) > 1.3 * r.best.step_time


def test_predicts_chapter07_memory_exactly():
    """The model states of chapter 07's strategies on 4 ranks, predicted byte for byte."""
    from minipar import data, study
    from minipar.study import strategies
    from minipar.models import GPTConfig
    from minipar.plan.course import exact_memory
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=6, n_head=8, n_embd=32)
    batches = data.batches(data.synthetic_tokens(2000, cfg.vocab_size), steps=1, batch_size=16,
                           block_size=cfg.block_size)
    specs = {k: v for k, v in strategies(4).items() if k in ("ZeRO-2", "TP", "PP", "2D PP×TP", "3D + ZeRO-1")}
    rows, _ = study.compare(cfg, batches, world_size=4, specs=specs)
    for row in rows:
        assert exact_memory(cfg, specs[row["strategy"]]) == row["memory"], row["strategy"]


def test_spearman_and_timed_block():
    """Spearman's rho on known rankings; the timed block gives a positive rate and overhead."""
    from minipar.models import GPTConfig
    from minipar.plan.calibrate import timed_block
    from minipar.plan.course import spearman
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    got = timed_block(GPTConfig(block_size=16, n_embd=32, n_head=2), repeats=2)
    assert got["rate"] > 0 and got["overhead"] >= 0


def test_fit_call_overhead_reproduces_the_fitted_row():
    """fit_call_overhead makes the fitted strategy's predicted step equal the measured one; calls counted as stated."""
    from minipar.study import strategies
    from minipar.models import GPTConfig
    from minipar.plan.course import fit_call_overhead, predict_compare
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=6, n_head=8, n_embd=32)
    gpu = plan.Accelerator("cpu", 1e10, 64e9, 1e9, layer_overhead=1e-4)
    cl = plan.Cluster("here", gpu, 4, 1, 1e9, alpha_intra=1e-5, alpha_inter=1e-5)
    specs = strategies(4)
    fitted = fit_call_overhead(cfg, 16, specs, cl, 200.0, on="TP")
    rows = {r["strategy"]: r for r in predict_compare(cfg, 16, specs, fitted)}
    assert rows["TP"]["step_ms"] == pytest.approx(200.0, rel=1e-9) and fitted.call_overhead > 0
    t = plan.comm_times(plan.from_gpt_config(cfg), plan.Layout(tp=4, micro_batch=16, sequence_parallel=False), fitted, 16, 16, 0.0)
    assert t["tp"]["calls"] == 6 * 4 + 4          # 4 all-reduces per block, 4 for embedding and loss
    t = plan.comm_times(plan.from_gpt_config(cfg), plan.Layout(dp=4, zero=1, micro_batch=4), fitted, 16, 16, 0.0)
    assert t["dp"]["calls"] == 2 * 8               # reduce-scatter + all-gather per layer


def test_cpu_rates_and_shared_cores():
    """fit_gemm_curve recovers a known x_half from rates on the roofline; ranks sharing fewer cores lend the bubble."""
    from minipar.plan.calibrate import fit_gemm_curve, rates
    cpu = plan.Accelerator("cpu", 1e11, 64e9, 1e9, kind="cpu", hbm_bw=1e10, efficiency=roofline.Efficiency(1.0, 0.8))
    shapes = [(32, 32, 32), (64, 96, 32), (256, 256, 256), (2048, 2048, 2048)]
    gemm = {s: roofline.rate(roofline.gemm("g", *s, 4), cpu, None) for s in shapes}
    peak, eff = fit_gemm_curve(gemm, 1e10)
    assert eff.x_half == pytest.approx(0.8, abs=0.05) and peak == max(gemm.values())
    from minipar.models import GPTConfig
    got = rates(GPTConfig(block_size=16, n_embd=32, n_head=2), micro_batch=2, repeats=1)
    assert got["bandwidth"] > 0 and got["block"] > 0 and all(r > 0 for r in got["gemm"].values())
    spec, lay = plan.from_gpt_config(GPTConfig(n_layer=4)), plan.Layout(pp=4, micro_batch=1, dtype="fp32")
    own = plan.Cluster("own cores", cpu, 4, 1, 1e9)
    shared = plan.Cluster("2 cores", cpu, 4, 1, 1e9, cores=2)
    assert plan.step_time(spec, lay, own, 32, 8)["bubble"] > 0 == plan.step_time(spec, lay, shared, 32, 8)["bubble"]
