"""python -m minipar.train survives faults, each injected here: a rank killed mid-step under
two torchrun agents with --max-restarts (the job resumes by itself, same losses), SIGTERM
(checkpoint, exit 75, the rerun continues with the same losses), a rank stuck before a
collective (every rank stops within the hang timeout naming the collectives), NaN losses
(stop at the step, or undo it and count it), a 5,000-step run's flat memory, and every bad
configuration as exit code 2 before any process starts."""
import json
import math
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

import minipar
from minipar.production import checkpoint, faults, train
from minipar.runtime import flight
from minipar.data import batches, corpus_tokens
from minipar.models.gpt import GPT
from minipar.reference import adamw, train_reference

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
        "--batch-size", "4", "--no-progress"]
RTOL, ATOL = 1e-4, 5e-5  # one process vs dp=2 under AdamW (tests/test_train.py)
ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

# Runs minipar.production.train with one fault injected on one rank, only in the first attempt
# (torchrun sets TORCHELASTIC_RESTART_COUNT): argv = FAULT RANK STEP minipar.train-args...
INJECT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from minipar.production import train
    from minipar.hybrid.model import HybridModel
    fault, rank, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    calls = [0]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and int(os.environ["RANK"]) == rank:
        if fault == "kill":  # inside step `at`: gradients averaged, weights not yet updated
            step = torch.optim.AdamW.step
            def dying(self, *a, **k):
                calls[0] += 1
                if calls[0] == at + 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                return step(self, *a, **k)
            torch.optim.AdamW.step = dying
        elif fault == "hang":  # stuck before step `at`'s first collective
            train_step = HybridModel.step    # the step the command runs in strategy.loop
            def stuck(self, x, y):
                calls[0] += 1
                if calls[0] == at + 1:
                    time.sleep(3600)
                return train_step(self, x, y)
            HybridModel.step = stuck
    sys.exit(train.main(sys.argv[4:]))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uninterrupted(tmp_path, argv) -> list[float]:
    out = tmp_path / "uninterrupted.json"
    assert train.main(argv + ["--out", str(out)]) == 0
    return json.loads(out.read_text())["losses"]


def _start(cmd, **kw) -> subprocess.Popen:
    """``cmd`` with its output captured (text), in a session of its own."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun's workers run in sessions of their own, so
    only their parent links find them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and everything below it: a worker left alive would hold the pipes open."""
    for pid in [*_descendants(p.pid), p.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _communicate(procs, timeout):
    """``(stdout, stderr)`` of every process once all ended, within ``timeout`` seconds in all.
    Past it every process and its children are killed and the test fails, naming the ones still
    running and showing what each printed (torchrun's agents log their state: "Waiting ...
    seconds for other agents to finish" is its exit barrier), instead of hanging."""
    deadline, outs = time.monotonic() + timeout, [None] * len(procs)
    try:
        for i, p in enumerate(procs):
            outs[i] = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            _kill_tree(p)
        outs = [o if o is not None else p.communicate() for o, p in zip(outs, procs)]
        pytest.fail(f"process(es) {running} of {len(procs)} still running after {timeout} s; killed\n" + "\n".join(
            f"--- process {i} (exit {p.returncode})\nstdout: {o[-1500:]}\nstderr: {e[-4000:]}"
            for i, (p, (o, e)) in enumerate(zip(procs, outs))), pytrace=False)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)
                p.communicate()
    return outs


def test_a_run_past_its_time_fails_with_what_it_printed_and_leaves_nothing_running():
    """The bound of the torchrun tests: a process that never ends, with a child in a session of
    its own holding the same pipes (as torchrun's workers do), fails the test after the timeout
    with its output, and neither is left running (nor can it hang the read of the pipes)."""
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
            "print('agent up, worker', c.pid, flush=True)\n"
            "time.sleep(600)\n")
    p = _start([sys.executable, "-c", code])
    with pytest.raises(pytest.fail.Exception, match=r"process\(es\) \[0\] of 1 still running after 3 s") as info:
        _communicate([p], 3)
    worker = int(str(info.value).split("agent up, worker ")[1].split()[0])
    assert p.returncode == -signal.SIGKILL
    # a SIGKILL is delivered asynchronously: on a loaded machine the worker may still be
    # scheduled (state R) for a moment after the kill returned, so wait for it to end, within a bound
    deadline, state = time.monotonic() + 30, _state(worker)
    while state not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
        state = _state(worker)
    assert state in ("gone", "Z"), f"the worker {worker} is still running 30 s after the kill ({state})"


def _state(pid):
    """A process's state letter from /proc (R, S, Z, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


@pytest.mark.slow   # torchrun agents, two runs
def test_a_rank_killed_mid_step_under_two_torchrun_agents_resumes_with_the_same_losses(tmp_path):
    """Two agents (c10d rendezvous on 127.0.0.1, one rank each, --max-restarts 1); rank 1 is
    SIGKILLed inside step 5. The agents restart the job, minipar.production.train continues from the
    step-4 checkpoint without --resume, and the 8 losses equal the uninterrupted run's."""
    run = TINY + ["--dp", "2", "--steps", "8", "--device", "cpu"]  # two "nodes", one machine
    script = tmp_path / "inject.py"
    script.write_text(INJECT)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--max-restarts", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
           f"127.0.0.1:{_free_port()}", "--rdzv_id", "minipar-faults", str(script), "kill", "1", "5",
           *run, "--checkpoint-dir", str(ckpt), "--save-every", "2", "--out", str(out)]
    env = dict(ENV, LOGLEVEL="INFO")   # the agents say where they stand (rendezvous, restarts, exit barrier)
    agents = [_start(cmd, env=env, cwd=tmp_path) for _ in range(2)]
    outputs = _communicate(agents, 240)
    report = "\n".join(f"--- agent {i} (exit {a.returncode})\n{o[-1500:]}\n{e[-3000:]}"
                       for i, (a, (o, e)) in enumerate(zip(agents, outputs)))
    assert all(a.returncode == 0 for a in agents), report
    got = json.loads(out.read_text())
    assert got["first_step"] == 4, report  # the restarted job continued from step 4's checkpoint
    assert got["history"] == _uninterrupted(tmp_path, run), report


@pytest.mark.slow   # two runs of the training command
def test_sigterm_checkpoints_exits_75_and_the_rerun_continues_with_the_same_losses(tmp_path):
    """SIGTERM to the driver mid-run (as Slurm preempts): the ranks finish the step, save,
    and the command exits 75; the same command again continues at the next step, and every
    loss equals an uninterrupted run's."""
    run = TINY + ["--dp", "2", "--steps", "150"]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    cmd = [sys.executable, "-m", "minipar.production.train", *run, "--checkpoint-dir", str(ckpt),
           "--save-every", "5", "--out", str(out)]
    p = _start(cmd, env=ENV)
    deadline = time.monotonic() + 120
    while not (ckpt / "latest").exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    o, e = _communicate([p], 120)[0]
    assert p.returncode == faults.EXIT_PREEMPTED, o + e
    first = json.loads(out.read_text())
    stop = first["stopped"]
    assert stop["reason"] == "preempted" and stop["signal"] == "SIGTERM" and stop["step"] < 149, first
    assert checkpoint.resolve(ckpt).name == f"step_{stop['step'] + 1:08d}"  # saved at the stop
    assert f"stopped by SIGTERM after step {stop['step']}" in e
    again = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    second = json.loads(out.read_text())
    assert second["first_step"] == stop["step"] + 1
    assert second["history"] == _uninterrupted(tmp_path, run)


@pytest.mark.slow   # torchrun
def test_a_rank_stuck_before_a_collective_stops_every_rank_naming_the_collectives(tmp_path):
    """torchrun, 2 ranks, --hang-timeout 3: rank 1 sleeps before step 3. Both ranks stop
    (exit 124, the watchdog's: rank 1 would sleep for an hour); the report names each rank's last
    collective: rank 0 inside an all_reduce on dp, rank 1 done with the one before."""
    script = tmp_path / "inject.py"
    script.write_text(INJECT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), "hang", "1", "3", *TINY, "--dp", "2", "--steps", "6", "--hang-timeout", "3"]
    p = _start(cmd, env=ENV)
    o, e = _communicate([p], 120)[0]   # rank 1 sleeps for an hour: only the watchdog ends this run
    assert p.returncode != 0 and "exitcode  : 124" in e, e[-3000:]
    lines = [line for line in e.splitlines() if "  rank " in line and "(seq " in line]
    r0 = [line for line in lines if "rank 0:" in line]
    r1 = [line for line in lines if "rank 1:" in line]
    assert r0 and r1, e[-3000:]
    assert "all_reduce" in r0[0] and "on dp (seq" in r0[0] and "waiting inside it" in r0[0], r0
    assert "finished" in r1[0] and "not in a collective" in r1[0], r1
    dp_seq = lambda line: int(line.split("dp seq ")[1].split()[0])  # noqa: E731
    assert dp_seq(r0[0]) == dp_seq(r1[0]) + 1, lines  # rank 1 never started the one rank 0 waits in


def test_flight_recorder_names_operation_group_and_sequence():
    flight.reset()
    a = flight.started("all_reduce", "grads", "dp")
    flight.completed(a)
    b = flight.started("all_reduce", "loss", "dp")
    c = flight.started("send", "activation", "pp")
    assert (a["seq"], b["seq"], c["seq"]) == (1, 2, 1)
    assert flight.describe(b).startswith("all_reduce 'loss' on dp (seq 2), waiting inside it for")
    assert "finished" in flight.describe(a) and "not in a collective" in flight.describe(a)
    assert [e["name"] for e in flight.entries()] == ["grads", "loss", "activation"]
    for _ in range(flight.RING + 10):
        flight.started("all_reduce", None, "tp")
    assert len(flight.entries()) == flight.RING  # bounded
    flight.reset()


def test_a_nan_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    """AdamW with lr 1e30 makes step 1's forward overflow: minipar.production.train stops there (exit 3)
    naming step 1, and `latest` is step 0's checkpoint, finite."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    argv = TINY + ["--steps", "6", "--lr", "1e30", "--save-every", "1", "--checkpoint-dir", str(ckpt),
                   "--out", str(out)]
    assert train.main(argv) == faults.EXIT_NONFINITE
    assert "the loss of step 1 is nan on every rank: stopped" in capsys.readouterr().err
    got = json.loads(out.read_text())
    assert got["stopped"]["step"] == 1 and len(got["losses"]) == 1
    assert checkpoint.resolve(ckpt).name == "step_00000001"
    assert all(torch.isfinite(v).all() for v in checkpoint.load_full_state_dict(ckpt).values())


def _poisoned(args, bad_step: int, bad_rank: int, how: str):
    """train.rank_main with step ``bad_step`` poisoned on ``bad_rank``: a NaN weight before the
    step ("weight": the real computation turns NaN), or only a NaN loss reported ("report": the
    rank's record of the step's loss, what the command's callback gets, is NaN)."""
    from minipar import strategy
    from minipar.hybrid.model import HybridModel
    originals, calls = (HybridModel.step, strategy.record_loss), [0, 0]

    def step(self, x, y):
        calls[0] += 1
        if how == "weight" and calls[0] == bad_step + 1 and dist.get_rank() == bad_rank:
            with torch.no_grad():
                next(iter(self.params.values())).fill_(float("nan"))
        return originals[0](self, x, y)

    def record(loss, *a, **k):
        calls[1] += 1
        out = originals[1](loss, *a, **k)
        if how == "report" and calls[1] == bad_step + 1 and dist.get_rank() == bad_rank:
            return torch.full_like(out, float("nan"))
        return out
    HybridModel.step, strategy.record_loss = step, record
    try:
        return train.rank_main(args)
    finally:
        HybridModel.step, strategy.record_loss = originals


def test_nonfinite_skip_undoes_the_step_and_a_lone_nan_names_its_rank(tmp_path):
    """dp=2, a NaN weight on rank 1 before step 2, --nonfinite skip: step 2 is undone and
    counted, and the run equals one process trained on the batches without step 2's. Then a
    NaN that only rank 1 reports: the run stops at step 3 naming rank 1."""
    ckpt = tmp_path / "ckpt"
    args = train.parser().parse_args(TINY + ["--dp", "2", "--steps", "5", "--nonfinite", "skip",
                                             "--checkpoint-dir", str(ckpt)])
    res = minipar.launch(_poisoned, 2, args=(args, 2, 1, "weight"), timeout=60)
    got = res[0]
    assert got["skipped"] == [2] and math.isnan(got["losses"][2]) and got["stopped"] is None
    data = batches(corpus_tokens()[0], 5, args.batch_size, args.block_size, seed=args.data_seed)
    want = train_reference(GPT(train.model_config(args), seed=args.seed), data[:2] + data[3:],
                           adamw(args.lr, args.weight_decay))
    kept = got["losses"][:2] + got["losses"][3:]
    torch.testing.assert_close(torch.tensor(kept), torch.tensor(want["losses"]), rtol=RTOL, atol=ATOL)
    params = checkpoint.load_full_state_dict(ckpt)
    for k, v in want["params"].items():
        torch.testing.assert_close(params[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")

    args = train.parser().parse_args(TINY + ["--dp", "2", "--steps", "5"])
    res = minipar.launch(_poisoned, 2, args=(args, 3, 1, "report"), timeout=60)
    assert [r["stopped"] for r in res] == [{"reason": "nonfinite", "step": 3, "value": "nan",
                                            "ranks": [1]}] * 2
    assert "on rank(s) [1] only" in train._stop_message(res[0]["stopped"])


MEMORY_BOUND = 3 * 2**20  # bytes: a recorder that keeps every event grows ~15 MB here


@pytest.mark.slow
def test_a_5000_step_run_holds_its_memory_flat(tmp_path):
    """dp=2, 5,000 steps of a tiny GPT: each rank's resident memory after step 5,000 is
    within 3 MiB of what it was after step 500 (the trace recorder is off in minipar.production.train)."""
    out = tmp_path / "out.json"
    argv = ["--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--block-size", "8",
            "--batch-size", "2", "--no-progress", "--dp", "2", "--steps", "5000", "--out", str(out)]
    assert train.main(argv) == 0
    for rank, samples in enumerate(json.loads(out.read_text())["rss_by_rank"]):
        rss = dict(samples)
        growth = rss[5000] - rss[500]
        print(f"rank {rank}: RSS {rss[500] / 2**20:.1f} MiB after step 500, "
              f"{rss[5000] / 2**20:.1f} MiB after step 5000 ({growth / 2**20:+.2f} MiB)")
        assert growth < MEMORY_BOUND, (rank, rss)


def test_every_bad_configuration_is_exit_code_2_before_any_process(tmp_path, capsys):
    """An unwritable checkpoint directory, --resume without a checkpoint, a batch that dp ×
    microbatches does not divide, a corrupt checkpoint, one of another model or other batches
    (and today's errors): each a plain error, exit code 2, no rank started."""
    good = tmp_path / "good"
    assert train.main(TINY + ["--steps", "2", "--checkpoint-dir", str(good)]) == 0
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in good.rglob("*"):
        if f.is_file():
            (corrupt / f.relative_to(good)).parent.mkdir(parents=True, exist_ok=True)
            (corrupt / f.relative_to(good)).write_bytes(f.read_bytes())
    rank_file = checkpoint.resolve(corrupt) / "rank_00000.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x10
    rank_file.write_bytes(bytes(data))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["--checkpoint-dir", str(a_file / "ckpt")], "is not writable"),
        (["--resume", "--checkpoint-dir", str(tmp_path / "empty")], "--resume: there is no checkpoint"),
        (["--dp", "2", "--microbatches", "3", "--batch-size", "8"], "cannot be split into dp=2 shards of m=3"),
        (["--checkpoint-dir", str(corrupt)], "rank_00000.pt: corrupt: its SHA-256 does not match"),
        (["--checkpoint-dir", str(good), "--n-embd", "32"], "another model configuration: n_embd=16 (this run: 32)"),
        (["--checkpoint-dir", str(good), "--data-seed", "1"], "trained on other batches"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--dp", "3", "--tp", "2"], "cannot be split into dp=3 shards"),
        (["--tp", "3"], "not divisible by t=3"),
        (["--hang-timeout", "-1"], "--hang-timeout must be >= 0"),
    ]
    capsys.readouterr()
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            train.main(TINY + ["--steps", "4"] + argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err, (argv, err)


def test_the_trace_recorder_is_a_bounded_ring_and_records_only_where_asked():
    from minipar.runtime import trace
    trace.start(0, barrier=False)
    try:
        trace.set_limit(100)
        for i in range(1000):
            trace.record("compute", f"e{i}", 0.0, 0.0)
        kept = trace.events()
        assert 100 <= len(kept) <= 100 + 100 // 8 and kept[-1]["name"] == "e999"
        assert trace.dropped() == 1000 - len(kept)
        m = trace.mark()
        with trace.recording(False):
            trace.record("compute", "unseen", 0.0, 0.0)
            with trace.recording():
                trace.record("compute", "seen", 0.0, 0.0)
        assert [e["name"] for e in trace.since(m)] == ["seen"]
    finally:
        trace.set_limit(trace.LIMIT)
        trace.start(0, barrier=False)


def _stuck_rank_1(log):
    from minipar import comm
    with flight.Watchdog(1.0, dist.get_rank(), log=log):
        flight.reset()
        flight.arm()
        t = torch.ones(1)
        comm.all_reduce(t, name="warm-up")
        if dist.get_rank() == 1:
            time.sleep(60)  # never joins the next all-reduce
        comm.all_reduce(t, name="blocked")


def test_the_watchdog_stops_every_rank_of_a_launch_with_one_report(tmp_path):
    """Under minipar.runtime.launch too: both ranks exit 124 within ~1 s of no progress, and rank 0
    reports both ranks' last collectives (shared through the rendezvous store)."""
    log = tmp_path / "hang.log"
    with pytest.raises(minipar.RankError, match="exit code 124"):   # the watchdog's, not LaunchTimeout
        minipar.launch(_stuck_rank_1, 2, args=(str(log),), timeout=30)
    err = log.read_text()
    assert "rank 0: all_reduce 'blocked' on world (seq 2), waiting inside it" in err, err
    assert "rank 1: all_reduce 'warm-up' on world (seq 1), finished" in err, err
