"""minipar.runtime.launch: results, failures, hangs, backends, the pool, torchrun."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar.runtime.backend import BackendError, default_device, gpu_count, pick_backend, place


def _backend(n: int) -> str:
    """The backend ``launch`` picks for ``n`` ranks here (Gloo on a CPU machine; NCCL with a
    GPU per rank, and ``MINIPAR_DEVICE=cuda`` under ``course.py test --gpu``)."""
    return place(n, default_device()).backend


def _whoami(tag):
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "tag": tag, "pid": os.getpid(),
            "addr": os.environ["MASTER_ADDR"], "threads": torch.get_num_threads()}


def test_results_in_rank_order_with_trace():
    res = minipar.launch(_whoami, 3, args=("x",))
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(r["world"] == 3 and r["tag"] == "x" and r["threads"] == 1 for r in res)
    assert res.backend == _backend(3) and res.trace.world_size == 3


def _boom():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def test_raising_rank_is_reported_and_next_launch_works():
    with pytest.raises(minipar.RankError) as info:   # ended by the error, not by the timeout (LaunchTimeout)
        minipar.launch(_boom, 4, timeout=60)
    err = info.value
    assert err.rank == 1
    assert "ValueError: rank one is unhappy" in str(err)
    assert "in _boom" in err.remote_traceback  # the remote traceback, not just the message
    assert [r["rank"] for r in minipar.launch(_whoami, 2, args=(0,))] == [0, 1]


def _pids():
    return os.getpid()


def _mismatched_collective():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins: a hang
    return os.getpid()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_hanging_rank_times_out_naming_it_and_leaves_nothing_running():
    pids = list(minipar.launch(_pids, 2))
    with pytest.raises(minipar.LaunchTimeout) as info:
        minipar.launch(_mismatched_collective, 2, timeout=3)
    assert info.value.running == [0]
    assert "rank(s) [0] of 2 still running" in str(info.value)
    assert not any(_alive(p) for p in pids), "ranks of a timed-out launch are still alive"
    assert [r["rank"] for r in minipar.launch(_whoami, 2, args=(0,))] == [0, 1]


def _one_sleeps(seconds):
    """Rank 1 sleeps without communicating (so no backend timeout can fire); rank 0 returns."""
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def test_the_launchs_own_timeout_stops_a_rank_that_sleeps():
    """Nothing but the launch's timeout can end this run before the 30 s sleep is over: it
    raises LaunchTimeout naming rank 1, kills it, and the next launch runs."""
    pids = list(minipar.launch(_pids, 2))
    with pytest.raises(minipar.LaunchTimeout) as info:
        minipar.launch(_one_sleeps, 2, args=(30,), timeout=2)
    assert info.value.running == [1]
    assert not _alive(pids[1]), "the sleeping rank of a timed-out launch is still alive"
    assert list(minipar.launch(_one_sleeps, 2, args=(0,))) == [0, 1]


def _sleep_then(seconds):
    time.sleep(seconds)
    return seconds


class _SlowToLoad:
    """An argument whose loading in the rank takes ``seconds`` (before the rank joins its group)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        return _sleep_then, (self.seconds,)


def _rank_and(x):
    return dist.get_rank(), x


def test_the_timeout_counts_from_when_every_rank_has_started():
    """A rank slow to start (here its argument takes 8 s to load, as a loaded machine takes to fork
    and import) does not count against a run's timeout of 5 s: the run itself is instant. A rank
    that never starts is reported as not started, after launch.STARTUP."""
    assert list(minipar.launch(_rank_and, 2, args=(_SlowToLoad(8),), timeout=5)) == [(0, 8), (1, 8)]
    from minipar.runtime.launch import STARTUP, LaunchTimeout
    text = str(LaunchTimeout(5, [0, 1], 2, starting=[1]))
    assert f"rank(s) [1] of 2 had not started after {STARTUP:g} s" in text and "still running" not in text


def _die():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_rank_that_dies_is_reported_with_its_exit_code():
    with pytest.raises(minipar.RankError) as info:
        minipar.launch(_die, 2, timeout=60)
    assert info.value.rank == 1 and "exit code 3" in str(info.value)


def test_pool_is_reused_unless_asked_otherwise():
    a, b = minipar.launch(_pids, 2), minipar.launch(_pids, 2)
    assert list(a) == list(b)
    c = minipar.launch(_pids, 2, reuse=False)
    d = minipar.launch(_pids, 2, reuse=False)
    assert set(c).isdisjoint(d)


def test_pool_restarts_when_an_imported_source_file_changes(tmp_path, monkeypatch):
    mod = tmp_path / "learner_code_mod.py"
    mod.write_text("def answer():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import learner_code_mod
    assert list(minipar.launch(learner_code_mod.answer, 2)) == [1, 1]
    mod.write_text("def answer():\n    return 2\n")
    os.utime(mod, (time.time() + 5, time.time() + 5))
    assert list(minipar.launch(learner_code_mod.answer, 2)) == [2, 2]


def _listening_on_loopback_only():
    port = int(os.environ["MASTER_PORT"])
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            rows += [line.split() for line in f.readlines()[1:]]
    listen = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]
    return listen


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_rendezvous_listens_on_loopback_only():
    listen = minipar.launch(_listening_on_loopback_only, 2)[0]
    assert listen == ["0100007F:" + listen[0].split(":")[1]], listen  # 127.0.0.1 only


def test_bad_configuration_fails_before_any_process_starts():
    for ws in (0, -2, "2", 1.5):
        with pytest.raises(ValueError, match="world_size"):
            minipar.launch(_whoami, ws)
    with pytest.raises(BackendError, match="backend must be one of"):
        minipar.launch(_whoami, 2, backend="mpi")


@pytest.mark.skipif(gpu_count() >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_nccl_without_enough_gpus_is_a_clear_error():
    with pytest.raises(BackendError, match="one GPU per rank|no NCCL"):
        minipar.launch(_whoami, 2, backend="nccl")


def test_auto_backend_explains_its_choice():
    backend, why = pick_backend("auto", 4)
    if gpu_count() >= 4:
        assert backend == "nccl"
    elif gpu_count():
        assert backend == "gloo" and "share" in why and "through host memory" in why
    else:
        assert backend == "gloo" and "Gloo on CPU" in why


def test_rendezvous_falls_back_where_libuv_refuses_a_listening_socket(monkeypatch):
    """torch releases whose libuv store takes no listen fd (2.6, for one) get the classic store."""
    import minipar.runtime.rendezvous as L
    real, calls = dist.TCPStore, []

    def store(*a, use_libuv=True, **kw):
        calls.append(use_libuv)
        if use_libuv:
            raise NotImplementedError("The libuv TCPStore backend does not support initialization "
                                      "with an listen fd.")
        return real(*a, use_libuv=use_libuv, **kw)
    monkeypatch.setattr(L.dist, "TCPStore", store)
    monkeypatch.setattr(L, "_libuv_takes_fd", True)
    assert [r["rank"] for r in minipar.launch(_whoami, 2, args=(0,))] == [0, 1]
    assert [r["rank"] for r in minipar.launch(_whoami, 2, args=(0,))] == [0, 1]
    assert calls == [True, False, False]  # refused once, then straight to the classic store


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, minipar
    def total():
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return (dist.get_rank(), t.item())
    res = minipar.launch(total, 2)         # no __main__ guard, as in a notebook cell
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("RESULT", list(res), res.backend)
    if dist.is_initialized():
        dist.destroy_process_group()
""")


@pytest.mark.slow   # torchrun
@pytest.mark.parametrize("runner", ["python", "torchrun"])
def test_the_same_script_runs_as_a_plain_script_and_under_torchrun(tmp_path, runner):
    """Plain: ``fn`` from ``__main__`` travels by value to 2 new ranks. torchrun: the
    script's own 2 processes are the ranks and ``launch`` gathers their results."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, str(script)] if runner == "python" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    want = f"RESULT [(0, 3.0), (1, 3.0)] {_backend(2)}"
    assert want in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_launch_inside_a_rank_is_refused():
    def nested():
        return minipar.launch(_whoami, 2)
    with pytest.raises(minipar.RankError, match="inside a rank"):
        minipar.launch(nested, 2)


def _chatty():
    print(f"hello from {dist.get_rank()}")
    if dist.get_rank() == 1:
        print("about to fail")
        raise KeyError("missing")
    dist.barrier()


def test_what_ranks_print_comes_back_prefixed(capsys):
    minipar.launch(lambda: print("hi", dist.get_rank()), 2)
    assert capsys.readouterr().out.splitlines()[-2:] == ["[rank 0] hi 0", "[rank 1] hi 1"]
    with pytest.raises(minipar.RankError) as info:
        minipar.launch(_chatty, 2)
    assert "--- rank 1 printed ---\nhello from 1\nabout to fail" in str(info.value)
    assert "KeyError: 'missing'" in str(info.value).splitlines()[0]


def test_nccl_groups_keep_gloo_for_cpu_tensors():
    from minipar.runtime.backend import process_group_backend
    assert process_group_backend("nccl") == "cpu:gloo,cuda:nccl"  # CPU tensors still work on GPUs
    assert process_group_backend("gloo") == "gloo"
