"""The GPU run's machinery, checked on the CPU with mocked placements, GPU counts and
allocators: torchrun agents sharing GPUs, the reference where the ranks run, the benchmarks'
device check, ``course.py test --gpu`` (its width and ``--dry-run``), the peak memory reported."""
import types

import pytest
import torch


def _post_identities(identities, here="cuda:0"):
    """Run :func:`refuse_shared_gpus` for every rank (threads sharing one store)."""
    import threading
    import torch.distributed as dist
    from minipar.runtime.backend import BackendError, refuse_shared_gpus
    store, errors = dist.HashStore(), {}

    def rank(r):
        try:
            refuse_shared_gpus(store, r, len(identities), identities[r], here)
        except BackendError as e:
            errors[r] = str(e)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(identities))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_two_torchrun_agents_on_one_host_sharing_gpus_are_refused_plainly():
    """Two agents on one machine, each placing its 2 ranks by LOCAL_RANK: ranks 0 and 2 land
    on one GPU, 1 and 3 on another; each rank is told which ranks share and what to do.
    Agents with their own GPUs (other uuids) or on other hosts pass."""
    same_host = ["h GPU-a", "h GPU-b", "h GPU-a", "h GPU-b"]
    errors = _post_identities(same_host)
    assert sorted(errors) == [0, 1, 2, 3]
    assert "ranks [0, 2]" in errors[0] and "ranks [1, 3]" in errors[3]
    assert "CUDA_VISIBLE_DEVICES" in errors[0] and "--device cpu" in errors[0]
    assert _post_identities(["h GPU-a", "h GPU-b", "h GPU-c", "h GPU-d"]) == {}
    assert _post_identities(["h1 GPU-a", "h1 GPU-b", "h2 GPU-a", "h2 GPU-b"]) == {}


def test_gpu_identity_names_the_host_and_the_physical_gpu(monkeypatch):
    """Agents with CUDA_VISIBLE_DEVICES=0 and =1 both see cuda:0, yet two GPUs."""
    from minipar.runtime.backend import gpu_identity
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="GPU-x"))
    assert gpu_identity("cuda:0").endswith(" GPU-x")
    assert gpu_identity("cpu") != gpu_identity("cuda:0")


def test_the_reference_runs_where_the_ranks_run_and_the_floor_follows_the_placement(monkeypatch):
    """On a machine with a GPU (mocked) a notebook's driver is on the CPU but its ranks on the
    GPU: the reference defaults to the GPU, and a result whose placement says CUDA is compared
    at the CUDA floor (rtol 1e-4, atol 1e-5) even when the driver is on the CPU; a CPU result
    keeps the exact floor."""
    from minipar.runtime import backend
    from minipar import reference
    from minipar.runtime.backend import place
    monkeypatch.delenv("MINIPAR_DEVICE", raising=False)
    monkeypatch.setattr(backend, "gpu_count", lambda: 1)
    assert backend.ranks_device().type == "cuda" and backend.device().type == "cpu"
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    assert backend.ranks_device() == torch.device("cpu")

    want = {"losses": [1.0, 0.5], "params": {"w": torch.ones(3)}, "device": "cpu"}
    near = {"losses": [1.00005, 0.5], "params": {"w": torch.ones(3) + 5e-6}}
    gpu_result = dict(near, placement=place(4, "cuda", gpus=1))
    reference.assert_same_training(gpu_result, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        reference.assert_same_training(dict(near, placement=place(4, "cpu")), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):  # no placement: the driver's device (the CPU)
        reference.assert_same_training(near, want, rtol=1e-5, atol=1e-6)
    reference.assert_same_training(near, dict(want, device="cuda:0"), rtol=1e-5, atol=1e-6)


def test_a_train_result_carries_its_placement_and_the_reference_its_device():
    """``TrainResult.placement`` is the launch's; ``train_reference(device=placement)`` runs there."""
    from minipar import reference
    from minipar.runtime.backend import place
    from minipar.models import MLP
    from minipar.strategy import TrainResult
    results = types.SimpleNamespace(placement=place(2, "cpu"))
    assert TrainResult([], {}, results=results).placement.device == "cpu"
    batches = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(i)), torch.randn(4, 2))
               for i in range(2)]
    model = MLP([3, 2], seed=0)
    want = reference.train_reference(model, batches, device=results.placement)
    assert want["device"] == "cpu" and len(want["losses"]) == 2


@pytest.fixture
def course(monkeypatch):
    """``course.py`` as a module, with the caller's ``MINIPAR_GPU_JOBS`` and ``MINIPAR_TORCH``
    removed: what these tests see never depends on the shell that runs them."""
    import importlib.util
    for name in ("MINIPAR_GPU_JOBS", "MINIPAR_TORCH"):
        monkeypatch.delenv(name, raising=False)
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("course", Path(__file__).parents[1] / "course.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_run_takes_one_job_at_a_time_on_one_gpu(course, monkeypatch):
    """Each job's warm ranks hold CUDA contexts: one GPU runs one job; MINIPAR_GPU_JOBS wins."""
    monkeypatch.delenv("MINIPAR_GPU_JOBS", raising=False)
    assert (course.gpu_width(1), course.gpu_width(2), course.gpu_width(8)) == (1, 4, 4)
    monkeypatch.setenv("MINIPAR_GPU_JOBS", "2")
    assert course.gpu_width(1) == 2


def test_the_dry_run_lists_the_jobs_and_checks_every_test_file(course, monkeypatch, capsys):
    """``test --gpu --dry-run`` prints each job's command and hands every test file of the
    jobs to ``minipar.runtime.devices_check`` (as on one GPU where there is none)."""
    calls = []
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    assert course.gpu_dry_run(0, []) == 0
    out = capsys.readouterr().out
    assert "1 at a time" in out and "notebook 11" in out and "tests/test_comm.py" in out
    (cmd,) = calls
    assert cmd[1:5] == ["-m", "minipar.runtime.devices_check", "--gpus", "1"]
    files = {f for _, args in course.gpu_jobs() for f in args if f.startswith("tests/")}
    assert set(cmd[5:]) == files and "tests/test_launch.py" in files


def test_the_dry_run_says_when_minipar_gpu_jobs_sets_the_width(course, monkeypatch, capsys):
    """``MINIPAR_GPU_JOBS`` set by the caller is honoured and named in the dry run; the other
    tests of this file never see it (the ``course`` fixture removes it)."""
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: 0)
    monkeypatch.setenv("MINIPAR_GPU_JOBS", "3")
    assert course.gpu_dry_run(0, []) == 0
    assert "3 at a time" in capsys.readouterr().out


CPU_BOUND = '''
import minipar, torch
def test_backend():
    assert minipar.launch(lambda: 0, 2).backend == "gloo"
def test_driver():
    assert str(minipar.device()) == "cpu"
def test_pinned():
    assert minipar.launch(lambda: 0, 2, device="cpu").backend == "gloo"
def test_asked():
    from minipar.runtime.backend import default_device, place
    assert minipar.launch(lambda: 0, 2).backend == place(2, default_device()).backend
'''


def test_the_device_check_finds_tests_that_assume_the_cpu(tmp_path, capsys):
    """An assertion on Gloo or the CPU is flagged unless its test pins the CPU or asks the
    placement; the driver's device is flagged even when the ranks are pinned; the files
    collect as on a GPU machine."""
    from minipar.runtime import devices_check
    bad = tmp_path / "test_bound.py"
    bad.write_text(CPU_BOUND)
    found = devices_check.cpu_assumptions(str(bad))
    assert [f.split()[1] for f in found] == ["test_backend:", "test_driver:"]
    assert devices_check.main(["--gpus", "1", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "4 tests collected" in out and "test_driver" in out
    good = tmp_path / "test_fine.py"
    good.write_text(CPU_BOUND.split("def test_backend")[0] + "def test_pinned" + CPU_BOUND.split("def test_pinned")[1])
    assert devices_check.main(["--gpus", "1", str(good)]) == 0
    assert "no test assumes the CPU" in capsys.readouterr().out


@pytest.mark.parametrize("bench", ["pipeline", "collectives"])
def test_a_cuda_benchmark_with_fewer_gpus_than_ranks_is_a_plain_error(bench, monkeypatch, capsys):
    """``--device cuda`` is NCCL with one GPU per rank (PyTorch's pipelining baseline has no
    CUDA path over Gloo): with 1 GPU and 2 ranks, exit code 2 and why, before any launch."""
    import importlib
    from minipar.runtime import backend
    module = importlib.import_module(f"minipar.bench.{bench}")
    monkeypatch.setattr(backend, "gpu_count", lambda: 1)
    monkeypatch.setattr(module, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit) as info:
        module.main(["--device", "cuda", "--ranks", "2", "--quick"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "one GPU per rank over NCCL: 2 ranks need 2 GPUs, this machine has 1" in err


def test_the_reported_peak_memory_is_a_running_maximum(monkeypatch):
    """A strategy's ``peak_memory()`` block resets the allocator's peak counter; the job's
    peak (``max_allocated``, what ``course.py test --gpu`` reports) still counts what came
    before: 100 MiB, then a block peaking at 30 MiB."""
    from minipar.runtime import gpu
    alloc = {"peak": 0}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: alloc.update(peak=0))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: alloc["peak"])
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda d=None: alloc["peak"] + 1)
    mib = 2**20  # placement-free: the allocator is faked
    gpu.reset_max_allocated("cuda:0")
    alloc["peak"] = 100 * mib
    with gpu.peak_memory("cuda:0") as m:
        alloc["peak"] = 30 * mib
    assert m.bytes == 30 * mib
    assert gpu.max_allocated("cuda:0") == 100 * mib
    with gpu.peak_memory("cuda:0") as m:
        alloc["peak"] = 120 * mib
    assert m.bytes == 120 * mib and gpu.max_allocated("cuda:0") == 120 * mib
    gpu.reset_max_allocated("cuda:0")  # a new job
    assert gpu.max_allocated("cuda:0") == 0 and gpu.max_allocated("cpu") is None


def test_no_test_of_the_gpu_run_assumes_the_cpu(course):
    """The static half of ``--dry-run`` on this repository's jobs: every assertion on the CPU
    or Gloo is pinned, reads the placement or says why it holds anywhere."""
    from pathlib import Path
    from minipar.runtime import devices_check
    root = Path(course.__file__).parent
    files = sorted({f for _, args in course.gpu_jobs() for f in args if f.endswith(".py")})
    assert [f for path in files for f in devices_check.cpu_assumptions(str(root / path))] == []


def test_the_dry_run_lists_every_test_file_in_a_job_or_left_out_with_why(course, monkeypatch, capsys):
    """Every ``tests/test_*.py`` is in a job or left out with its reason (none unclassified);
    the attention, 5-D mesh, async DP, faults and training-command tests are in; the run says
    that its jobs check their ranks' device."""
    from pathlib import Path
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: 0)
    assert course.gpu_dry_run(0, []) == 0
    out = capsys.readouterr().out
    files = sorted(p.name for p in (Path(course.__file__).parent / "tests").glob("test_*.py"))
    for name in files:
        (line,) = [s for s in out.splitlines() if s.strip().startswith(f"tests/{name} ")]
        assert " in " in line or "left out: " in line, line
    classified = course.gpu.classify(Path(course.__file__).parent)
    assert len(classified) == len(files) and not [f for f, _, why in classified if why == course.gpu.UNCLASSIFIED]
    jobs = {f: job for f, job, _ in classified}
    assert jobs["tests/test_attention.py"] and jobs["tests/test_mesh5d.py"] and jobs["tests/test_faults.py"]
    assert jobs["tests/test_data_parallel_async.py"] and jobs["tests/test_train_options.py"]
    assert "fails if one of its ranks trained on the CPU" in out


def test_k_is_one_expression_per_job_and_nothing_selected_is_skipped(course):
    """``-k X`` reaches each chapter job once, and a notebook job as ``NN and (X)`` (one ``-k``:
    pytest keeps only the last); pytest's exit 5 (nothing selected) is "skipped", not a failure."""
    jobs = dict(course.gpu_jobs(["-k", "zero or attention"]))
    assert jobs["06 zero"].count("-k") == 1 and jobs["06 zero"][-2:] == ["-k", "zero or attention"]
    assert jobs["notebook 06"].count("-k") == 1 and jobs["notebook 06"][-1] == "06 and (zero or attention)"
    assert dict(course.gpu_jobs())["notebook 06"][-2:] == ["-k", "06"]
    assert course.gpu.split_k(["-x", "-k", "a", "-kb"]) == ("(a) and (b)", ["-x"])
    assert course.gpu.job_result("06 zero", 5, []) == ("skipped (none selected)", [])
    assert course.gpu.job_result("06 zero", 1, [])[0] == "FAIL (1)"


def test_the_device_findings_name_a_cpu_rank_and_a_test_that_never_used_the_gpu(course):
    """From the ranks' logged peaks: a rank at 0 MiB beside one that used the GPU is named with
    its test; a test whose ranks all stayed at 0 is named; CPU-placed ranks are not counted; the
    devices job is not checked."""
    mib = 2**20
    log = [{"rank": 0, "device": "cuda:0", "peak": 5 * mib, "launch": "a", "test": "t.py::ok"},
           {"rank": 1, "device": "cuda:1", "peak": 7 * mib, "launch": "a", "test": "t.py::ok"},
           {"rank": 0, "device": "cuda:0", "peak": 3 * mib, "launch": "b", "test": "t.py::planted"},
           {"rank": 1, "device": "cuda:1", "peak": 0, "launch": "b", "test": "t.py::planted"},
           {"rank": 0, "device": "cuda:0", "peak": 0, "launch": "c", "test": "t.py::cpu"},
           {"rank": 1, "device": "cuda:1", "peak": 0, "launch": "c", "test": "t.py::cpu"},
           {"rank": 0, "device": "cpu", "peak": None, "launch": "d", "test": "t.py::pinned"}]
    found = course.gpu.device_findings(log)
    assert found == ["t.py::planted: rank 1 computed on the CPU (no GPU memory allocated; rank 0 allocated 3.0 MiB)",
                     "t.py::cpu: no rank computed on the GPU (no rank allocated GPU memory)"]
    assert course.gpu.device_findings(log[:2]) == []
    assert course.gpu.job_result("06 zero", 0, log)[0] == "FAIL (CPU ranks)"
    assert course.gpu.job_result("devices", 0, log) == ("pass", [])


def test_memory_a_warm_worker_still_holds_is_not_credited_to_the_next_launch(course):
    """A warm worker keeps what earlier jobs left on its GPU (cuBLAS's workspace: 65 MiB on the
    H200); the peak of a rank that then computes on the CPU equals that ``start``: it is named,
    as is a test whose every rank only held such leftovers (the GPU run's chapter 02 case)."""
    mib = 2**20
    log = [{"rank": 0, "device": "cuda:0", "peak": 90 * mib, "start": 65 * mib, "launch": "a", "test": "t::ok"},
           {"rank": 1, "device": "cuda:0", "peak": 65 * mib, "start": 65 * mib, "launch": "a", "test": "t::ok"},
           {"rank": 2, "device": "cuda:0", "peak": 0, "start": 0, "launch": "a", "test": "t::ok"},
           {"rank": 0, "device": "cuda:0", "peak": 65 * mib, "start": 65 * mib, "launch": "b", "test": "t::cpu"},
           {"rank": 1, "device": "cuda:0", "peak": 0, "start": 0, "launch": "b", "test": "t::cpu"}]
    assert course.gpu.device_findings(log) == [
        "t::ok: rank 1 computed on the CPU (no GPU memory allocated; rank 0 allocated 25.0 MiB)",
        "t::ok: rank 2 computed on the CPU (no GPU memory allocated; rank 0 allocated 25.0 MiB)",
        "t::cpu: no rank computed on the GPU (no rank allocated GPU memory)"]
    assert course.gpu.peaks(log[:3]) == {0: 90 * mib, 1: 65 * mib, 2: 0}   # the report shows the peaks


def _planted_rank(log_path):
    """In a rank: the GPU played by the meta device, whose allocator counts what the rank put on
    it; rank 1 plants a model built on the CPU, in a worker that still holds 2 KiB from an
    earlier job. Each rank logs its peak as under --gpu."""
    import torch.distributed as dist
    from minipar.models import MLP
    from minipar.runtime import pool
    r = dist.get_rank()
    model = MLP([8, 16, 4], seed=0).to("cpu" if r == 1 else "meta")
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "meta")
    left = 2048 if r == 1 else 0
    pool._allocated_at_start = left
    pool.max_allocated = lambda where: held + left  # placement-free: the allocator is played
    import os
    os.environ["MINIPAR_MEMORY_LOG"] = log_path
    pool.log_peak_memory(r, f"cuda:{r}")
    return held


def test_a_rank_that_trained_on_the_cpu_fails_its_job_by_name(course, tmp_path):
    """Two ranks log their GPU peaks with the launch's labels (the launch id and the test);
    the one that built its model on the CPU is named, with this test, and the job fails."""
    import minipar
    log = tmp_path / "peaks.jsonl"
    held = minipar.launch(_planted_rank, 2, device="cpu", args=(str(log),), timeout=60)
    assert held[0] > 0 and held[1] == 0
    result, findings = course.gpu.job_result("06 zero", 0, course.gpu.read_log(log))
    assert result == "FAIL (CPU ranks)"
    assert findings == [f"tests/test_gpu_run.py::{test_a_rank_that_trained_on_the_cpu_fails_its_job_by_name.__name__}: "
                        f"rank 1 computed on the CPU (no GPU memory allocated; rank 0 allocated {held[0] / 2**20:.1f} MiB)"]


def test_first_runs_the_checks_then_one_quick_job_per_chapter_and_reports(course, monkeypatch, capsys):
    """``--gpu --first`` (subprocesses played): the fused-attention, training and refusal checks
    in order, then each chapter's job with ``-m "not slow"`` and no notebook; a failed check
    fails the run and shows in the report."""
    import types
    ran, started = [], []

    def run(cmd, **kw):
        if cmd[1] == "-c":  # the GPU probe
            return types.SimpleNamespace(stdout="1 2.13.0", returncode=0)
        ran.append(cmd[1:])
        bad = "bf16" in cmd
        return types.SimpleNamespace(stdout="fp32 causal ok\n", stderr="", returncode=1 if bad else 0)

    def popen(cmd, **kw):
        started.append(cmd[3:])
        return types.SimpleNamespace(poll=lambda: 0, returncode=0)
    monkeypatch.setattr(course.subprocess, "run", run)
    monkeypatch.setattr(course.subprocess, "Popen", popen)
    monkeypatch.setattr(course.time, "sleep", lambda s: None)
    monkeypatch.setattr(course, "open", lambda *a, **k: None, raising=False)
    assert course.test_gpu(["--first"]) == 1
    assert ran == [cmd for _, cmd, _ in course.gpu.FIRST]
    assert len(started) == len([n for n, _ in course.gpu_jobs() if not n.startswith("notebook")])
    assert all(a[-4:] == ["-m", "not slow", "--maxfail", "3"] for a in started)
    out = capsys.readouterr().out
    assert "minipar.train cp2 bf16" in out and "FAIL (1)" in out and "--gpu --first: 1 GPU(s)" in out


def _with_meta_default(fn, *args):
    """In a rank: ``fn(*args)`` with ``torch.set_default_device("meta")``, so a tensor made
    without naming a device lands on ``meta`` and the first collective given it fails by name."""
    torch.set_default_device("meta")
    try:
        return fn(*args)
    finally:
        torch.set_default_device(None)


def test_the_ranks_the_gpu_check_named_build_on_the_ranks_device():
    """The GPU run named four tests whose ranks never touched the GPU; they built their tensors
    and models on the CPU (``torch.ones(N)``, a model from the driver or ``GPT(...)`` unmoved). Their
    rank functions now make every tensor on ``minipar.device()``: run with the default device
    ``meta`` in every rank, a tensor made without a device would end in an error naming it.
    (A model built on the CPU on purpose and not moved is seen only on a GPU, by the run's own
    check: :func:`minipar.course.gpu_run.device_findings`.)"""
    import minipar
    import test_comm
    import test_data_parallel
    import test_data_parallel_async as ps_test
    from minipar.models import MLP
    minipar.launch(_with_meta_default, 3, device="cpu", timeout=60,
                   args=(test_comm._native_bytes_under, test_comm.cost.collective_bytes))
    assert list(minipar.launch(_with_meta_default, 4, device="cpu", timeout=60, args=(test_comm._in_subgroups,))) \
        == [(2.0, 2.0), (4.0, 3.0), (2.0, 2.0), (4.0, 3.0)]
    minipar.launch(_with_meta_default, 3, device="cpu", timeout=60, args=(test_data_parallel._wrap_different_replicas,))
    server = minipar.launch(_with_meta_default, 3, device="cpu", timeout=120, args=(ps_test._ps_runs, MLP(seed=2)))[0]
    assert server["sync"]["params"] and server["train async"]["losses"]
