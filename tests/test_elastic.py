"""Elastic: a node leaves for good and the job goes on with fewer ranks; it comes back and the job
grows again, with the losses of one process throughout.

Four torchrun agents, one rank each (``--nnodes 3:4``: the job may run on 3 or 4), rendezvous
over a store this test hosts (``is_host=false``: the rendezvous outlives any node, as an etcd or a
job scheduler's store would). ``python -m minipar.train --elastic`` takes, at every (re)start, the
layout :func:`minipar.adapt.auto.fit` gives the world it finds (here dp=4, then dp=3, then dp=4:
the global batch of 12 splits either way) and continues from the last checkpoint (saved every
step), which loads across layouts. Rank 3's process kills its own agent inside step 6, so that
node is gone; once the 3 survivors have passed step 14, a fifth agent joins and the agents
restart the job on 4 (the workers, told by SIGTERM, checkpoint the step they are in first).

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the agents' shared store a node that joins later
waits for a bootstrap address the existing agents never publish again (torch 2.13's dynamic
rendezvous caches it), and the grow would hang.

The 40 losses equal one process's (AdamW, rtol 1e-4, atol 5e-5), the last start is on 4 ranks
and trains steps after the 3 ranks' (it grew back), and each start's record says how long it took: from the failure to the next finished step, and its parts."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from minipar.data import batches, corpus_tokens
from minipar.models.gpt import GPT
from minipar.production import train
from minipar.reference import adamw, train_reference
from test_faults import _kill_tree

LEAVE = textwrap.dedent("""
    import os, signal, sys, time
    from minipar.production import train
    from minipar.hybrid.model import HybridModel
    rank, at, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    calls, train_step = [0], HybridModel.step        # the step the command runs in strategy.loop
    def step(self, x, y):
        calls[0] += 1
        if not os.path.exists(os.environ["LEFT_AT"]) and int(os.environ["RANK"]) == rank and calls[0] == at + 1:
            with open(os.environ["LEFT_AT"], "w") as f:
                f.write(str(time.time()))
            os.kill(os.getppid(), signal.SIGKILL)      # the agent: this node leaves for good
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(pause)                               # a step long enough to join in the middle
        return train_step(self, x, y)
    HybridModel.step = step
    sys.exit(train.main(sys.argv[4:]))
""")
RUN = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "12",
       "--no-progress", "--dp", "4", "--steps", "40", "--device", "cpu", "--elastic", "--save-every", "1"]


@pytest.mark.slow   # five torchrun agents, three rendezvous
def test_a_node_leaves_and_comes_back_and_the_losses_are_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (kept alive)
    (tmp_path / "leave.py").write_text(LEAVE)
    ckpt, out, left = tmp_path / "ckpt", tmp_path / "out.json", tmp_path / "left"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", LEFT_AT=str(left), LOGLEVEL="INFO",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "3:4", "--nproc_per_node", "1",
           "--max-restarts", "3", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
           "--rdzv_id", "minipar-elastic", "--rdzv_conf", "is_host=false,last_call_timeout=1",
           "--monitor-interval", "0.5", str(tmp_path / "leave.py"), "3", "5", "0.25",
           *RUN, "--checkpoint-dir", str(ckpt), "--out", str(out)]
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(5)]
    start = lambda i: subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=logs[i], stderr=subprocess.STDOUT,
                                       start_new_session=True)
    agents, deadline = [start(i) for i in range(4)], time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            latest = ckpt / "latest"
            step = int(latest.read_text().split()[0].split("_")[-1]) if latest.exists() else 0
            if len(agents) == 4 and left.exists() and step >= 14:
                agents.append(start(4))                 # the node comes back
            if len(agents) == 5 and all(a.poll() is not None for i, a in enumerate(agents) if i != 3):
                break
            time.sleep(0.2)
    finally:
        for a in agents:
            if a.poll() is None:
                _kill_tree(a)
            a.wait()
    report = "\n".join(f"--- agent {i} (exit {a.returncode})\n" + (tmp_path / f"agent{i}.log").read_text()[-2500:]
                       for i, a in enumerate(agents))
    assert len(agents) == 5 and [a.returncode for i, a in enumerate(agents) if i != 3] == [0] * 4, report
    got = json.loads(out.read_text())
    worlds = [r["world"] for r in got["recoveries"]]
    assert worlds[0] == 4 and 3 in worlds and worlds[-1] == 4, (worlds, report)
    args = train.parse(RUN)
    data = batches(corpus_tokens()[0], 40, args.batch_size, args.block_size, seed=args.data_seed)
    want = train_reference(GPT(train.model_config(args), seed=args.seed), data, adamw(args.lr, args.weight_decay))
    torch.testing.assert_close(torch.tensor(got["history"]), torch.tensor(want["losses"]), rtol=1e-4, atol=5e-5)
    shrunk = next(r for r in got["recoveries"] if r["world"] == 3)
    failed_at = float(left.read_text())
    grown = got["recoveries"][-1]                  # the steps after the return ran on 4 ranks again
    assert grown["world"] == 4 and shrunk["step"] < grown["step"] < 40, got["recoveries"]
    recovered = shrunk["first_step_at"] - failed_at
    assert 0 < recovered < 120, recovered
    print(f"failure → next step on 3 ranks: {recovered:.1f} s (start {shrunk['started_at'] - failed_at:.1f} s "
          f"after the failure: detection and rendezvous; build {shrunk['build_s']:.2f} s, load "
          f"{shrunk['load_s']:.3f} s, first step {shrunk['first_step_s']:.3f} s); steps {shrunk['step'] + 1}.."
          f"{grown['step']} on 3 ranks, {grown['step'] + 1}..40 on 4 again")
