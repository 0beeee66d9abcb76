"""Naive model parallelism: the LSTM language model split embedding+LSTM | head on two
ranks, and the small GPT cut by layers on three, train exactly like one process
(rtol 1e-5, atol 1e-6); the ranks take turns (never compute at the same time); each rank
holds only its own parameters, gradients and optimizer state."""
import pytest
import torch

from minipar import data, reference
from minipar import model_parallel as mpar
from minipar.models import GPT, LSTMLM, GPTConfig

TOKENS = data.synthetic_tokens(2000)
RTOL, ATOL = reference.tolerance(kind="sgd").values()   # fp32 on the ranks' device (minipar.reference.TOLERANCES)
GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def _lstm():
    return LSTMLM(vocab_size=32, n_embd=32, hidden=96, seed=0)


def _lstm_batches():
    return data.batches(TOKENS, 4, 16, 32)


def _gpt_batches():
    return data.batches(TOKENS, 3, 8, 8)


def _busy_overlap(trace):
    """Seconds during which two ranks computed at once, and the total compute."""
    iv = [(e["start"], e["end"], e["rank"]) for e in trace.events(kind="compute")]
    both = sum(max(0.0, min(a1, b1) - max(a0, b0))
               for a0, a1, ra in iv for b0, b1, rb in iv if ra < rb)
    return both, sum(b - a for a, b, _ in iv)


def test_lstm_split_matches_single_process():
    """Embedding+LSTM on rank 0, head on rank 1: same losses and parameters (AdamW); the
    ranks take turns; memory per rank is that rank's own parameters."""
    res = mpar.run(_lstm(), _lstm_batches(), 2, optimizer=reference.adamw(1e-2), stages=mpar.lstm_stages)
    want = reference.train_reference(_lstm(), _lstm_batches(), reference.adamw(1e-2))
    reference.assert_same_training(res, want, rtol=RTOL, atol=ATOL)
    assert res.results[0]["losses"] is None and len(res.losses) == 4
    model = _lstm()
    body, head = mpar.lstm_stages(model)
    for rank, stage in enumerate((body, head)):
        mem = res.measured[rank]["memory"]
        n_bytes = 4 * sum(q.numel() for q in stage.parameters())
        assert mem["params"] == mem["grads"] == n_bytes
        assert mem["optimizer"] >= 2 * n_bytes   # AdamW: two moments per parameter
        assert mem["activations"] > 0
    assert set(res.results[0]["params"]) == {n for n, _ in model.named_parameters() if not n.startswith("head")}
    overlap, busy = _busy_overlap(res.trace)
    assert overlap < 0.2 * busy, f"ranks computed at the same time for {overlap:.4f} s of {busy:.4f} s"


def test_gpt_three_way_split_matches_single_process():
    """The GPT cut by parameter count into 3 stages: same training as one process."""
    res = mpar.run(GPT(GPT_CFG, seed=0), _gpt_batches(), 3, optimizer=reference.sgd(0.5))
    want = reference.train_reference(GPT(GPT_CFG, seed=0), _gpt_batches(), reference.sgd(0.5))
    reference.assert_same_training(res, want, rtol=RTOL, atol=ATOL)
    per_rank = [m["memory"]["params"] for m in res.measured]
    assert sum(per_rank) == 4 * sum(q.numel() for q in GPT(GPT_CFG).parameters())
    for rank in range(3):
        names = [e["name"] for e in res.trace.ranks[rank] if e["kind"] == "comm"]
        assert names.count("recv_activation") == (3 if rank else 0)
        assert names.count("send_grad") == (3 if rank else 0)


def test_bad_split_fails_before_launch():
    """One stage per rank, checked in the driver."""
    with pytest.raises(ValueError, match="one stage per rank"):
        mpar.run(_lstm(), _lstm_batches(), 3, stages=mpar.lstm_stages)
    with pytest.raises(ValueError, match="cannot make"):
        mpar.run(GPT(GPT_CFG), _gpt_batches(), 7)


@pytest.mark.parametrize("model", ["lstm", "gpt"])
def test_bfloat16_split_matches_one_bfloat16_process(model):
    """Under bf16 autocast the LSTM's output is bf16 while the GPT's residual stream stays fp32:
    either way what crosses a boundary travels in the one dtype both sides read
    (``stage_comm.message_dtype``: the parameters'), so the split trains as one bf16 process."""
    bf16 = torch.bfloat16
    if model == "lstm":
        res = mpar.run(_lstm(), _lstm_batches(), 2, optimizer=reference.sgd(0.5), stages=mpar.lstm_stages,
                       dtype=bf16)
        want = reference.train_reference(_lstm(), _lstm_batches(), reference.sgd(0.5), dtype=bf16)
    else:
        res = mpar.run(GPT(GPT_CFG, seed=0), _gpt_batches(), 3, optimizer=reference.sgd(0.5), dtype=bf16)
        want = reference.train_reference(GPT(GPT_CFG, seed=0), _gpt_batches(), reference.sgd(0.5), dtype=bf16)
    print(model, "losses", res.losses, "one process", want["losses"])
    # bf16 rounding: the same products, but one bf16 ulp of a logit (2^-8) moves with the GEMM's
    # blocking (rtol 1e-3, atol 2e-3 in the table); sent in bf16 and received as fp32 (the bug this
    # holds off), losses go wrong by 1e-2 at once and to 1e14 under AdamW
    reference.assert_same_training(res, want, kind="sgd", dtype=bf16)


def _meta_default_step(model, batches, stages):
    torch.set_default_device("meta")      # a buffer allocated without device= lands on meta
    try:
        return mpar.train(model, batches, stages=stages)["losses"]
    finally:
        torch.set_default_device(None)


def test_receives_land_on_the_stage_device():
    """Every receive buffer is allocated where its stage computes (not on the default device:
    on a GPU that was the CPU), checked as tests/test_devices.py does, with ``meta`` as the
    default device in every rank."""
    import minipar
    for model, stages, n in ((_lstm(), mpar.lstm_stages, 2), (GPT(GPT_CFG, seed=0), None, 3)):
        batches = _lstm_batches()[:1] if stages else _gpt_batches()[:1]
        got = minipar.launch(_meta_default_step, n, args=(model, batches, stages), timeout=60)
        assert got[-1] is not None and len(got[-1]) == 1
