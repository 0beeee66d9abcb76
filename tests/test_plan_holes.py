"""The planner's terms checked one at a time against hand counts: MoE model-state memory
under expert parallelism for every ZeRO stage, and each communication term of the step time
at pp = 1 (where the data-parallel overlap window is the last micro-batch's backward).

Everything here is arithmetic on formulas: the hand counts are written out, not computed
with the function under test. Tolerance: rel 1e-12 (the same floating-point operations in a
different order).
"""
import pytest

from minipar import plan
from minipar.plan.step_time import comm_times

MOE = plan.ModelSpec("tiny-moe", n_layer=2, hidden=64, n_head=4, vocab=100, seq_len=128,
                     n_experts=8, top_k=2, tied=True, dropout=False)
DENSE = plan.ModelSpec("tiny", n_layer=4, hidden=256, n_head=8, vocab=1000, seq_len=512,
                       tied=True, dropout=False)
REL = 1e-12


def _moe_hand_count():
    h, f, l, E, V = 64, 256, 2, 8, 100
    experts = l * E * 2 * h * f                       # two h×f matrices per expert
    dense = V * h + l * 4 * h * h                     # tied embedding, Q K V O
    assert dense + experts == MOE.num_params()
    return dense, experts


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp, cp, ep", [(4, 1, 2), (4, 1, 4), (2, 2, 2), (8, 1, 8)])
def test_moe_model_states_per_gpu_by_hand(stage, dp, cp, ep):
    """Dense parameters split over the dp·cp ranks, an expert's over dp·cp/ep (the ranks that
    hold the same experts); bf16 parameters and gradients (2 + 2 bytes) and K = 12."""
    dense, experts = _moe_hand_count()
    mine = experts / ep                                # this GPU's experts
    n_dense, n_exp = dp * cp, dp * cp // ep            # ZeRO's divisor for each
    want = {
        "params": 2 * (dense / n_dense + mine / n_exp if stage == 3 else dense + mine),
        "grads": 2 * (dense / n_dense + mine / n_exp if stage >= 2 else dense + mine),
        "optimizer": 12 * (dense / n_dense + mine / n_exp if stage >= 1 else dense + mine),
    }
    lay = plan.Layout(dp=dp, cp=cp, ep=ep, zero=stage)
    assert plan.problems(MOE, lay, 8 * dp, 128) == []
    got = plan.memory_per_gpu(MOE, lay, 128, 8 * dp)
    for c, v in want.items():
        assert got[c] == pytest.approx(v, rel=REL), (c, stage, dp, cp, ep)


def _step(layout, model=DENSE, global_batch=64, cluster="selene"):
    cl = plan.get_cluster(cluster)
    t = plan.step_time(model, layout, cl, model.seq_len, global_batch, efficiency=0.5)
    return t, cl


def test_dp_overlap_window_at_pp1_is_the_last_microbatch_backward():
    """pp = 1, dp alone: the gradients are reduced in buckets as the *last* micro-batch's
    backward produces them (the earlier micro-batches only accumulate), so the exposed time is
    the same whatever the number of micro-batches; partly hidden here; overlap_dp=False: all."""
    mid = plan.ModelSpec("mid", n_layer=8, hidden=1024, n_head=16, vocab=1000, seq_len=2048,
                         tied=True, dropout=False)                # 381 MB of gradients: 8 buckets
    lay = plan.Layout(dp=16, micro_batch=1, zero=0)            # 16 ranks: two nodes, the network
    four, _ = _step(lay, model=mid, global_batch=64)
    one, _ = _step(lay, model=mid, global_batch=16)
    assert lay.microbatches(64) == 4 and set(four["comm"]) == {"dp"} and four["bubble"] == 0
    dp4, dp1 = four["comm"]["dp"], one["comm"]["dp"]
    assert dp4["bytes"] == dp1["bytes"] and dp4["seconds"] == pytest.approx(dp1["seconds"], rel=REL)
    assert four["compute"] > 3.5 * one["compute"]              # four micro-batches of compute ...
    assert 0 < dp4["exposed"] < 0.6 * dp4["seconds"]           # partly hidden: the window matters
    assert dp4["exposed"] == pytest.approx(dp1["exposed"], rel=REL)   # ... one micro-batch's window
    off, _ = _step(lay.replace(overlap_dp=False), model=mid, global_batch=64)
    assert off["comm"]["dp"]["exposed"] == off["comm"]["dp"]["seconds"]


def test_tp_term_alone_at_pp1():
    """tp alone: m·l layer passes of the tensor-parallel bytes, all exposed."""
    from minipar import cost
    lay = plan.Layout(tp=4, micro_batch=2, overlap_tp=False)
    t, _ = _step(lay, global_batch=8)
    assert set(t["comm"]) == {"tp"}
    m, per = 4, cost.tp_comm_bytes_per_layer(2, 512, 256, 4, 2, True)
    assert t["comm"]["tp"]["bytes"] == pytest.approx(m * DENSE.n_layer * per, rel=REL)
    assert t["comm"]["tp"]["exposed"] == t["comm"]["tp"]["seconds"] > 0


def test_tp_overlap_by_hand():
    """overlap_tp: each of the layer's 4 forward and 6 backward gathers and scatters (c seconds: t-1
    steps of (t-1)/t of the bf16 (s, b, h) activation) runs behind its GEMM and pays max(0, c - GEMM)
    + c/t; the bytes it hides cost 2 bytes of HBM traffic each. "auto" is on for a GPU, and the
    planner says no to it without sequence parallelism."""
    lay = plan.Layout(tp=4, micro_batch=2, overlap_tp=True)
    t, cl = _step(lay, global_batch=8)
    alpha, beta = cl.link(4)
    c = 3 * alpha + 3 / 4 * 2 * (512 * 2 * 256) * beta
    ops = t["detail"]["ops"]
    windows = ["QKV", "attention out", "MLP up", "MLP down",
               "QKV dX", "QKV dW", "MLP up dX", "MLP up dW", "attention out dX", "MLP down dX"]
    wire = 4 * DENSE.n_layer * sum(max(0.0, c - ops[g]) + c / 4 for g in windows)
    tp = t["comm"]["tp"]
    hidden = tp["bytes"] * (1 - wire / tp["seconds"])
    assert 0 < wire < tp["seconds"]
    assert tp["exposed"] == pytest.approx(wire + 2 * hidden / cl.gpu.hbm_bw, rel=REL)
    off, _ = _step(lay.replace(overlap_tp=False), global_batch=8)
    auto, _ = _step(lay.replace(overlap_tp="auto"), global_batch=8)
    assert auto["comm"]["tp"]["exposed"] == tp["exposed"] < off["comm"]["tp"]["exposed"]
    assert not lay.replace(overlap_tp="auto").tp_overlap_on(None)      # no accelerator named: a CPU's rule
    assert lay.replace(overlap_tp="auto").tp_overlap_on(cl.gpu) and not lay.replace(tp=1).tp_overlap_on(cl.gpu)
    assert any("needs sequence_parallel" in p for p in
               plan.problems(DENSE, lay.replace(sequence_parallel=False), 8, 512))


def test_cp_term_alone_at_pp1():
    """cp alone: 3(cp-1) K, V blocks of 2·(s/cp)·b·kv bytes per layer and micro-batch; each ring
    step hides behind one block's attention, so a long sequence (attention per block longer than
    a transfer) exposes only the contention of the hidden bytes, and a short one nearly all."""
    lay = plan.Layout(cp=4, micro_batch=1)
    t, cl = _step(lay, global_batch=4)
    assert set(t["comm"]) == {"cp", "dp"}                      # gradients are averaged over dp·cp
    m, s = 4, 512 // 4
    per = 3 * 3 * 2 * s * 1 * 256 * 2
    cp = t["comm"]["cp"]
    assert cp["bytes"] == pytest.approx(m * DENSE.n_layer * per, rel=REL)
    assert 0 <= cp["exposed"] <= cp["seconds"] + cp["contention"]
    # s = 128 tokens per rank: one block's attention is far shorter than a K, V transfer, so
    # nearly all of the ring's time is exposed (an overlap assumed perfect would expose none)
    assert cp["exposed"] - cp["contention"] > 0.9 * cp["seconds"] > 0
    long = plan.ModelSpec("long", n_layer=4, hidden=256, n_head=8, vocab=1000, seq_len=65536,
                          tied=True, dropout=False)
    hidden, _ = _step(lay, model=long, global_batch=4)
    c = hidden["comm"]["cp"]
    assert c["exposed"] == pytest.approx(c["contention"], rel=REL)          # all behind attention
    assert c["contention"] == pytest.approx(2 * c["bytes"] / cl.gpu.hbm_bw, rel=REL)


def test_ep_term_alone_at_pp1():
    """ep: 4 all-to-alls of top_k·s·b·h per MoE layer and micro-batch, (ep-1)/ep leaving the GPU,
    all exposed (here with dp = ep, the ranks EP needs)."""
    lay = plan.Layout(dp=4, ep=4, micro_batch=1, overlap_dp=False)
    t, _ = _step(lay, model=MOE, global_batch=8)
    assert set(t["comm"]) == {"ep", "dp"}
    m = 2
    per = 4 * (3 / 4) * 2 * 128 * 1 * 64 * 2
    assert t["comm"]["ep"]["bytes"] == pytest.approx(m * MOE.n_layer * per, rel=REL)
    assert t["comm"]["ep"]["exposed"] == t["comm"]["ep"]["seconds"] > 0


def test_uneven_stages_and_the_busiest_one():
    """Layers that p does not divide: one fewer on the first and last stages (Llama 3's 7, 8 × 14, 7), then the
    second, third ...; the activations are the busiest stage's, by hand: 1F1B stage r holds p - r micro-batches."""
    from minipar.plan.memory import stage_layers
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7] and stage_layers(24, 4) == [6] * 4
    assert stage_layers(5, 2) == [2, 3] and stage_layers(7, 4) == [1, 2, 2, 2] and stage_layers(9, 4) == [2, 2, 3, 2]
    spec = plan.ModelSpec("seven", n_layer=7, hidden=256, n_head=8, vocab=1000, seq_len=512, tied=True, dropout=False)
    lay = plan.Layout(pp=4, recompute="selective")
    per = plan.layer_activation_bytes(spec, lay, 512)
    logits = 4 * 512 * 1000
    want = max(4 * 1 * per, 3 * 2 * per, 2 * 2 * per, 1 * 2 * per + logits)   # stages [1, 2, 2, 2]
    assert plan.memory_per_gpu(spec, lay, 512, 8)["activations"] == pytest.approx(want, rel=REL)
    assert want == 3 * 2 * per                                               # the second stage


def test_bubble_is_lent_only_on_a_quiet_machine():
    """Ranks outnumbering the cores lend the bubble to each other; other work (the load before they started)
    takes that share instead: charged min(1, background / cores)."""
    from minipar.plan.step_time import charged
    cpu = plan.Accelerator("cpu", 1e11, 64e9, 1e9, kind="cpu", hbm_bw=1e10)
    for background, share in ((0.0, 0.0), (1.0, 0.5), (8.0, 1.0)):
        cl = plan.Cluster("2 cores", cpu, 4, 1, 1e9, cores=2, background=background)
        assert charged(cl, 4) == share
        lay = plan.Layout(pp=4, micro_batch=1, dtype="fp32")
        t = plan.step_time(DENSE, lay, cl, 64, 8)
        full = plan.step_time(DENSE, lay, plan.Cluster("own", cpu, 4, 1, 1e9), 64, 8)["bubble"]
        assert t["bubble"] == pytest.approx(share * full, rel=REL)
    assert charged(plan.Cluster("gpus", "H100", 8, 1, 50e9), 8) == 1.0


def test_median_of_rounds():
    """Calibration rounds taken between the strategies: every number its median, the rest as in the first round."""
    from minipar.plan.calibrate import median_of_rounds
    rounds = [{"backend": "gloo", "seconds": {"gloo": [3.0, 30.0]}, "rates": {"gemm": {(1, 2, 3): 5.0}}},
              {"backend": "gloo", "seconds": {"gloo": [1.0, 10.0]}, "rates": {"gemm": {(1, 2, 3): 7.0}}},
              {"backend": "gloo", "seconds": {"gloo": [2.0, 90.0]}, "rates": {"gemm": {(1, 2, 3): 6.0}}}]
    assert median_of_rounds(rounds) == {"backend": "gloo", "seconds": {"gloo": [2.0, 30.0]},
                                        "rates": {"gemm": {(1, 2, 3): 6.0}}}
