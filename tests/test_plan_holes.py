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
    """pp = 1, dp alone: the all-reduce overlaps the *last* micro-batch's backward, 2/3 of one
    micro-batch's compute (T_compute/m); what exceeds it is exposed. overlap_dp=False: all."""
    lay = plan.Layout(dp=16, micro_batch=1, zero=0)            # 16 ranks: two nodes, the network
    t, _ = _step(lay, global_batch=64)
    m = lay.microbatches(64)
    assert m == 4 and set(t["comm"]) == {"dp"} and t["bubble"] == 0
    dp = t["comm"]["dp"]
    window = (2 / 3) * t["compute"] / m
    assert 0 < window < dp["seconds"]                          # partly hidden: the window matters
    assert dp["exposed"] == pytest.approx(dp["seconds"] - window, rel=REL)
    off, _ = _step(lay.replace(overlap_dp=False), global_batch=64)
    assert off["comm"]["dp"]["exposed"] == off["comm"]["dp"]["seconds"]
    # one micro-batch: the window is the whole backward
    one, _ = _step(lay, global_batch=16)
    assert one["comm"]["dp"]["exposed"] == pytest.approx(
        one["comm"]["dp"]["seconds"] - (2 / 3) * one["compute"], rel=REL)


def test_tp_term_alone_at_pp1():
    """tp alone: m·l layer passes of the tensor-parallel bytes, all exposed."""
    from minipar import cost
    lay = plan.Layout(tp=4, micro_batch=2)
    t, _ = _step(lay, global_batch=8)
    assert set(t["comm"]) == {"tp"}
    m, per = 4, cost.tp_comm_bytes_per_layer(2, 512, 256, 4, 2, True)
    assert t["comm"]["tp"]["bytes"] == pytest.approx(m * DENSE.n_layer * per, rel=REL)
    assert t["comm"]["tp"]["exposed"] == t["comm"]["tp"]["seconds"] > 0


def test_cp_term_alone_at_pp1():
    """cp alone: 3(cp-1) K, V blocks of 2·(s/cp)·b·kv bytes per layer and micro-batch; exposed
    what exceeds the attention compute (its share of T_compute)."""
    lay = plan.Layout(cp=4, micro_batch=1)
    t, _ = _step(lay, global_batch=4)
    assert set(t["comm"]) == {"cp", "dp"}                      # gradients are averaged over dp·cp
    m, s = 4, 512 // 4
    per = 3 * 3 * 2 * s * 1 * 256 * 2
    assert t["comm"]["cp"]["bytes"] == pytest.approx(m * DENSE.n_layer * per, rel=REL)
    attn = t["compute"] * DENSE.attention_core_flops_per_token() / DENSE.forward_flops_per_token()
    assert t["comm"]["cp"]["exposed"] == pytest.approx(max(0.0, t["comm"]["cp"]["seconds"] - attn), rel=REL)


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
