"""Grow and shrink a running job without restarting the ranks that stay (:mod:`minipar.adapt.membership`).

The test hosts the job's store (as a scheduler or an etcd would) and starts each rank as its own
``python -m minipar.adapt.grow`` process. Grow: 3 ranks train; a 4th process joins after step 4
(rank 0 waits for it there: the change happens at that step whatever the machine's load) and
the job trains on 4. Shrink: 4 ranks train; rank 1 leaves cleanly after step 5, the others
become ranks 0..2 and go on. Every world trains :func:`minipar.adapt.fit`'s layout (dp=3 or dp=4,
ZeRO-1: the optimizer state is sharded, so the joiner must be given its shard, and the leaver's
shard must be handed off before it goes).

Checked: each process that started is the one that finished (the pid it reports at its start
and end is the pid the test started), the losses of every step equal one process's, and so do
the final parameters, within the table's AdamW tolerance on the CPU (rtol 1e-4, atol 5e-5:
the state moves bit for bit, but dp=3 and dp=4 average the gradients in other orders, and
Adam's division by sqrt(v) amplifies those last bits in the early steps). One-line mutants
tried, each red here: the stayers describing their parameters without the optimizer state (the
moments start over: step 5 differs); no hand-off, or handed-off pieces at the wrong offset (the
plan refuses: elements held by no rank); handed-off pieces read from the wrong place of the
received buffer (step 6 differs); the joiner admitted one step late (the members disagree on
the step they finished: a plain error at once, not a hang)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from minipar.adapt import grow
from minipar.data import batches, corpus_tokens
from minipar.models.gpt import GPT
from minipar.reference import adamw, assert_same_training, train_reference
from minipar.runtime.rendezvous import serve_store

STEPS = 10
ROOT = Path(__file__).resolve().parents[1]


def start_job(tmp_path, ranks: list[list[str]], bound: float = 300.0) -> tuple[list, list[dict]]:
    """Start one process per argument list on a store hosted here; wait (at most ``bound`` s)
    for all to end; return their Popen objects and their saved records."""
    store, port = serve_store(len(ranks), bound)   # noqa: F841 (kept alive: the job's store)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MINIPAR_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs, logs = [], []
    for i, extra in enumerate(ranks):
        logs.append(open(tmp_path / f"rank{i}.log", "w"))
        cmd = [sys.executable, "-m", "minipar.adapt.grow", "--store", f"127.0.0.1:{port}", "--steps", str(STEPS),
               "--timeout", str(bound / 2), "--out", str(tmp_path / f"rank{i}.pt"), *extra]
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=logs[i], stderr=subprocess.STDOUT))
    deadline = time.monotonic() + bound
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    report = "\n".join(f"--- process {i} (exit {p.returncode})\n" + (tmp_path / f"rank{i}.log").read_text()[-3000:]
                       for i, p in enumerate(procs))
    assert [p.returncode for p in procs] == [0] * len(procs), report
    return procs, [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(len(procs))]


def one_process() -> dict:
    args = grow.parser().parse_args(["--store", "x:1", "--join"])
    data = batches(corpus_tokens()[0], STEPS, args.batch_size, args.block_size, seed=args.data_seed)
    return train_reference(GPT(grow.model_config(args), seed=args.seed), data, adamw(args.lr, args.weight_decay))


def same_processes(procs, outs) -> None:
    for p, out in zip(procs, outs):
        assert out["pid_at_start"] == out["pid_at_end"] == p.pid, (p.pid, out["pid_at_start"], out["pid_at_end"])


def equal_to_one_process(outs, want) -> None:
    final = next(o for o in outs if not o["left"] and o["rank"] == 0)
    for o in outs:
        for step, loss in o["losses"].items():   # every rank's every step: the global mean loss
            torch.testing.assert_close(loss, want["losses"][step], rtol=1e-4, atol=5e-5, msg=f"step {step}")
    got = {"losses": [final["losses"][s] for s in range(STEPS)], "params": final["params"]}
    assert_same_training(got, want, kind="adamw")


def test_a_3_rank_job_grows_to_4_keeping_its_processes(tmp_path):
    originals = [["--rank", str(r), "--world", "3", "--grow-at", "4"] for r in range(3)]
    procs, outs = start_job(tmp_path, originals + [["--join"]])
    same_processes(procs, outs)
    assert [sorted(o["losses"]) for o in outs] == [list(range(STEPS))] * 3 + [list(range(4, STEPS))]
    assert [(o["rank"], o["world"], o["generation"]) for o in outs] == [(0, 4, 1), (1, 4, 1), (2, 4, 1), (3, 4, 1)]
    for o in outs:
        (rec,) = o["records"]
        assert (rec["step"], rec["generation"], rec["from_world"], rec["to_world"], rec["joined"]) == (4, 1, 3, 4, 1)
        assert (rec["from_layout"], rec["to_layout"]) == ("dp=3,zero=1", "dp=4,zero=1")
        assert rec["seconds"] > 0 and set(rec["phases"]) >= {"build", "reshard"}
    assert outs[3]["records"][0]["bytes_received"] > 0       # the joiner was given its parameters and shard
    equal_to_one_process(outs, one_process())


def test_a_4_rank_job_shrinks_to_3_when_a_rank_leaves_cleanly(tmp_path):
    ranks = [["--rank", str(r), "--world", "4"] + (["--leave-at", "5"] if r == 1 else []) for r in range(4)]
    procs, outs = start_job(tmp_path, ranks)
    same_processes(procs, outs)
    assert [o["left"] for o in outs] == [False, True, False, False]
    assert sorted(outs[1]["losses"]) == list(range(5))
    assert [(o["rank"], o["world"]) for o in outs if not o["left"]] == [(0, 3), (1, 3), (2, 3)]  # 2, 3 renumbered
    for o in outs:
        (rec,) = o["records"]
        assert (rec["step"], rec["from_world"], rec["to_world"], rec["left"]) == (5, 4, 3, [1])
        assert rec["handoff_bytes"] > 0         # rank 1's ZeRO-1 shard: held by no other rank
    equal_to_one_process(outs, one_process())


def test_bad_input_is_refused_before_joining_anything():
    for argv, said in ((["--join", "--rank", "0"], "not both"), (["--rank", "3", "--world", "3"], "is not one of"),
                       (["--rank", "0", "--world", "3", "--grow-at", "12"], "before the last"),
                       (["--rank", "0", "--world", "5"], "no layout of 5 ranks"), (["--join", "--store", "nohost"], "HOST:PORT")):
        with pytest.raises(ValueError, match=said):
            grow.check(grow.parser().parse_args(["--store", "127.0.0.1:1", *argv]))


def test_the_runs_only_leavers_hold_and_their_even_split():
    """``difference``: the elements of runs a in no run of b (b's runs may overlap), cut at the keys'
    offsets; ``split``: consecutive parts whose sizes differ by at most one, together the whole."""
    from minipar.adapt.membership import difference, split
    a = np.array([[0, 10], [20, 5]])                 # elements 0..9 and 20..24
    b = np.array([[2, 3], [3, 4], [22, 10]])         # 2..6 (twice over), 22..31
    got = difference(a, b, np.array([0, 8, 40]))     # a key starts at 8
    assert got.tolist() == [[0, 2], [7, 1], [8, 2], [20, 2]]
    parts = split(got, 3)
    assert [int(p[:, 1].sum()) for p in parts] == [2, 2, 3]
    assert np.concatenate([np.arange(s, s + n) for p in parts for s, n in p]).tolist() == [0, 1, 7, 8, 9, 20, 21]
    assert difference(np.zeros((0, 2), np.int64), b, np.array([0])).shape == (0, 2)
