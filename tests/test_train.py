"""``python -m minipar.train``: checked before launching, trains like one process under
minipar.runtime.launch, resumes on another mesh, and runs the same under two torchrun agents
(``--nnodes 2`` on one machine over loopback)."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from minipar.production import checkpoint, train
from minipar.data import batches, corpus_tokens
from minipar.models.gpt import GPT
from minipar.reference import adamw, train_reference

# AdamW magnifies the last-bit differences of reordered sums (see tests/test_zero.py)
RTOL, ATOL = 1e-4, 5e-5
COMMON = ["--steps", "6", "--batch-size", "8", "--no-progress"]


def _reference(steps: int, dtype=None, recompute="none", device=None) -> dict:
    """The single-process run the script must reproduce (same model, batches, AdamW), on
    ``device`` (default: where ``MINIPAR_DEVICE`` puts the ranks)."""
    args = train.parser().parse_args(COMMON)
    data = batches(corpus_tokens()[0], steps, args.batch_size, args.block_size, seed=args.data_seed)
    model = GPT(train.model_config(args), seed=args.seed).set_recompute(recompute)
    return train_reference(model, data, adamw(args.lr, args.weight_decay), dtype=dtype, device=device)


def _assert_matches(losses, ckpt, want):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=RTOL, atol=ATOL)
    got = checkpoint.load_full_state_dict(ckpt)
    assert set(got) == set(want["params"])
    for k, v in want["params"].items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("argv, message", [
    (["--dp", "3", "--tp", "2"], "cannot be split into dp=3 shards"),
    (["--tp", "3"], "not divisible by t=3"),
    (["--pp", "8"], "stages"),
    (["--resume"], "--resume needs --checkpoint-dir"),
])
def test_bad_configuration_is_a_plain_error_before_any_process(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_trains_like_one_process_and_resumes_on_another_mesh(tmp_path):
    """3D (dp=2, pp=2, tp=2) for 4 steps with checkpoints, then resumed at pp=2, dp=2 with
    ZeRO-1 for the last 2: the 6 losses and the final weights are the single process's."""
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "a.json", tmp_path / "b.json"
    base = COMMON + ["--checkpoint-dir", str(ckpt), "--microbatches", "2"]
    assert train.main(base + ["--dp", "2", "--pp", "2", "--tp", "2", "--steps", "4",
                              "--save-every", "2", "--out", str(first)]) == 0
    assert [p.name for p in checkpoint.committed(ckpt)] == ["step_00000002", "step_00000004"]
    assert train.main(base + ["--dp", "2", "--pp", "2", "--zero", "1", "--resume", "--out", str(second)]) == 0
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert (a["first_step"], b["first_step"]) == (0, 4)
    assert b["resumed_from"] == {"pp": 2, "dp": 2, "tp": 2}
    _assert_matches(a["losses"] + b["losses"], ckpt, _reference(6))
    assert [p.name for p in checkpoint.committed(ckpt)] == ["step_00000004", "step_00000006"]


def test_bf16_with_recomputation_trains_like_one_process_in_bf16(tmp_path):
    """``--dtype bf16 --recompute full`` on dp=2 x pp=2: the losses and final weights of the
    single process in the same precision (bf16 autocast, fp32 master weights; losses to rtol
    1e-3, atol 2e-3 as tests/test_precision.py), and not those of fp32 training. AdamW moves
    an element by about lr per step whatever its gradient's size, so bf16 rounding of a tiny
    gradient can flip an update: weights are bounded by steps x lr (as tests/test_zero.py)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    assert train.main(COMMON + ["--dp", "2", "--pp", "2", "--microbatches", "2", "--dtype", "bf16",
                                "--recompute", "full", "--checkpoint-dir", str(ckpt), "--out", str(out)]) == 0
    losses = json.loads(out.read_text())["losses"]
    want, fp32 = _reference(6, dtype=torch.bfloat16, recompute="full"), _reference(6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=1e-3, atol=2e-3)
    got = checkpoint.load_full_state_dict(ckpt)
    for k, v in want["params"].items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=6 * 1e-2, msg=lambda m, k=k: f"{k}: {m}")
    assert abs(losses[-1] - fp32["losses"][-1]) > abs(losses[-1] - want["losses"][-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow   # torchrun agents
def test_two_torchrun_agents_run_the_same_as_minipar_launch(tmp_path):
    """``torchrun --nnodes 2 --nproc_per_node 2`` (two agents, c10d rendezvous on
    127.0.0.1) trains dp=2, tp=2: it completes, shows the progress bar, gives exactly the
    losses of the same command under minipar.runtime.launch, and matches one process."""
    out, ckpt = tmp_path / "torchrun.json", tmp_path / "ckpt"
    # two "nodes" on one machine: on the CPU (each agent would put its ranks on cuda:0, cuda:1)
    run = ["--dp", "2", "--tp", "2", "--steps", "6", "--batch-size", "8", "--device", "cpu"]
    script = ["-m", "minipar.production.train", *run, "--checkpoint-dir", str(ckpt), "--out", str(out)]
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "minipar-test"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    agents = [subprocess.Popen(cmd + script, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, cwd=tmp_path) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate()
    report = "\n".join(f"--- agent {i} (exit {a.returncode})\n{o[-1500:]}\n{e[-2500:]}"
                       for i, (a, (o, e)) in enumerate(zip(agents, outputs)))
    assert all(a.returncode == 0 for a in agents), report
    assert "torchrun, gloo" in "".join(o for o, _ in outputs), report
    assert "6/6" in "".join(e for _, e in outputs), report  # rank 0's progress bar
    got = json.loads(out.read_text())
    assert got["launcher"] == "torchrun" and got["world_size"] == 4

    local = tmp_path / "launch.json"
    assert train.main(run + ["--no-progress", "--out", str(local)]) == 0
    assert json.loads(local.read_text())["losses"] == got["losses"]
    _assert_matches(got["losses"], ckpt, _reference(6, device="cpu"))
