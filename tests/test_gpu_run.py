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


@pytest.mark.parametrize("cores, gib, jobs, want", [
    (16, 139, 27, 4),    # the H200 of the first run: the cores decide
    (2, 15, 27, 1),      # Colab's T4
    (64, 15, 27, 3),     # many cores, a small GPU: its memory decides
    (4, 80, 27, 1),
    (64, 1000, 3, 3),    # never more than the jobs
])
def test_the_width_is_the_smaller_of_the_cores_and_the_gpu_memory_rule(course, cores, gib, jobs, want):
    """Jobs at once = min(cores // 4 per job, GPU GiB // 4 per job, jobs), at least 1, on
    simulated machines; ``MINIPAR_GPU_JOBS`` overrides and says so."""
    w, rule = course.gpu.width(cores, gib, jobs)
    assert w == want and f"{cores} cores // 4 per job" in rule and f"{gib} GiB of GPU memory // 4 GiB" in rule
    assert course.gpu.width(cores, gib, jobs, "2") == (2, "MINIPAR_GPU_JOBS=2")
    assert course.gpu_width(1, cores=cores, gpu_gib=gib, n_jobs=jobs) == want


def test_jobs_start_longest_first_and_the_expected_run_fits_the_h200(course, tmp_path, monkeypatch):
    """The order is the last run's seconds (kept for passes only), else the first H200 run's;
    on the H200 (16 cores, 139 GiB) the chapter jobs and notebooks are expected under 8 minutes,
    and ``--first``'s checks and quick jobs within 4 (estimates: the first run's own times are
    floors; the proof is a GPU run, which writes the times the next one orders by)."""
    gpu = course.gpu
    names = ["notebook 02", "01 collectives", "11 train, checkpoints", "06 zero"]
    assert [names[i] for i in gpu.longest_first(names, {})] == ["11 train, checkpoints", "06 zero",
                                                               "notebook 02", "01 collectives"]
    assert gpu.longest_first(["benchmark mesh5d", "benchmark tp"], {}, True) == [0, 1]   # seconds x ranks
    assert [names[i] for i in gpu.longest_first(names, {"01 collectives": 500})][0] == "01 collectives"
    assert gpu.makespan([(5, 4), (4, 4), (3, 4), (3, 4), (3, 4)], 8, 100) == 10
    assert gpu.makespan([(5, 4), (4, 2), (3, 2)], 8, 100) == 5    # two light jobs beside a heavy one
    assert gpu.makespan([(5, 4), (4, 4)], 8, 6) == 9              # GPU memory: one at a time
    assert gpu.makespan([(5, 8), (4, 2)], 4, 100) == 9 and gpu.makespan([], 4, 4) == 0   # too big: alone
    assert gpu.makespan([(5, 4), (4, 8), (3, 2)], 8, 100) == 9    # the narrow job does not wait behind the wide
    assert gpu.next_job([1, 2], {1: 8, 2: 2}, [4], 8, 100) == 2 and gpu.next_job([1], {1: 8}, [4], 8, 100) is None
    gpu.write_times(tmp_path, [("06 zero", "pass", 12.34, {}), ("01 collectives", "FAIL (1)", 3.0, {})])
    gpu.write_times(tmp_path, [("06 zero", "pass", 5.0, {})], quick=True)
    assert gpu.read_times(tmp_path) == {"06 zero": 12.3, "06 zero (quick)": 5.0}
    assert gpu.expected("06 zero", gpu.read_times(tmp_path), quick=True) == 5.0
    every = [n for n, _ in course.gpu_jobs()]
    chapters = [n for n in every if not n.startswith("notebook")]
    run = [(gpu.expected(every[i], {}), gpu.ranks_of(every[i])) for i in gpu.longest_first(every, {})]
    assert gpu.makespan(run, 16, 139) < 8 * 60
    first = [n for n, *_ in gpu.first_checks(course.ROOT)] + chapters
    run = [(gpu.expected(first[i], {}, True), gpu.ranks_of(first[i])) for i in gpu.longest_first(first, {}, True)]
    assert gpu.makespan(run, 16, 139) <= 4 * 60


def test_the_dry_run_lists_the_jobs_and_checks_every_test_file(course, monkeypatch, capsys):
    """``test --gpu --dry-run`` prints each job's command and hands every test file of the
    jobs to ``minipar.runtime.devices_check`` (as on one GPU where there is none)."""
    calls = []
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    assert course.gpu_dry_run(0, [], cores=2) == 0
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
    assert course.gpu_dry_run(0, [], cores=2) == 0
    out = capsys.readouterr().out
    assert "3 at a time" in out and "width: 3 = MINIPAR_GPU_JOBS=3" in out


def test_the_dry_run_says_the_width_it_chose_on_a_simulated_h200(course, monkeypatch, capsys):
    """On a 16-core machine with one 139 GiB GPU: 4 at a time, the rule with its numbers, and
    the order with the run's expected seconds."""
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: 0)
    monkeypatch.setattr(course.gpu, "read_times", lambda root: {})
    assert course.gpu_dry_run(1, [], cores=16, gpu_gib=139.0) == 0
    out = capsys.readouterr().out
    assert "4 at a time" in out
    assert "width: 4 = min(16 cores // 4 per job = 4, 139 GiB of GPU memory // 4 GiB per job = 34, 27 jobs)" in out
    assert "order: most work first (seconds x ranks: the first H200 run's seconds), about 370 s expected" in out


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


@pytest.mark.parametrize("bench, refused", [("pipeline", True), ("collectives", False)])
def test_a_cuda_benchmark_on_one_gpu_shares_it_or_says_what_it_needs(bench, refused, monkeypatch, capsys):
    """With 1 GPU and 2 ranks: PyTorch's pipelining baseline has no CUDA path over Gloo, so the
    pipeline benchmark stops (exit code 2, why, before any launch); the collectives share the GPU."""
    import importlib
    from minipar.runtime import backend
    module = importlib.import_module(f"minipar.bench.{bench}")
    monkeypatch.setattr(backend, "gpu_count", lambda: 1)
    monkeypatch.setattr(module, "launch", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit if refused else KeyboardInterrupt) as info:
        module.main(["--device", "cuda", "--ranks", "2", "--quick"])
    if refused:
        assert info.value.code == 2
        assert "needs one GPU per rank (NCCL): 2 ranks need 2 GPUs" in capsys.readouterr().err


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
    import os
    saved = pool.max_allocated, os.environ.get("MINIPAR_MEMORY_LOG")
    pool._allocated_at_start = left
    pool.max_allocated = lambda where: held + left  # placement-free: the allocator is played
    os.environ["MINIPAR_MEMORY_LOG"] = log_path
    try:
        pool.log_peak_memory(r, f"cuda:{r}")
    finally:   # this warm worker serves the next tests as it was
        pool._allocated_at_start, pool.max_allocated = 0, saved[0]
        os.environ.pop("MINIPAR_MEMORY_LOG") if saved[1] is None else os.environ.update(MINIPAR_MEMORY_LOG=saved[1])
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


def _h200(course, python="/usr/bin/python3", torch_version="2.11.0+cu130"):
    """The first run's machine, as :func:`course.genv.probe` would see it."""
    return course.genv.Torch(python=python, torch=torch_version, cuda="13.0", cores=16,
                             gpus=[["NVIDIA H200", 139 * 2**30]])


def test_first_runs_its_checks_and_one_quick_job_per_chapter_side_by_side(course, monkeypatch, capsys):
    """``--gpu --first`` (processes played, on a simulated H200): the fused-attention and
    training checks, each benchmark on its own and each chapter's job with ``-m "not slow"``
    (no notebook), started most work first (seconds x ranks), 4 chapter jobs at a time; a failed check fails the run and shows
    in the report with its seconds."""
    import types
    started, live = [], []

    def popen(cmd, **kw):
        started.append(cmd[1:])
        live.append(1)
        bad = "bf16" in cmd
        return types.SimpleNamespace(poll=lambda: 0, returncode=1 if bad else 0, pid=-1)
    monkeypatch.setattr(course, "gpu_python", lambda args: ("/usr/bin/python3", _h200(course)))
    monkeypatch.setattr(course.gpu, "read_times", lambda root: {})
    monkeypatch.setattr(course.gpu, "write_times", lambda root, rows, quick=False: None)
    monkeypatch.setattr(course.subprocess, "Popen", popen)
    monkeypatch.setattr(course.time, "sleep", lambda s: None)
    monkeypatch.setattr(course.runner, "open", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(course.Path, "read_text", lambda self: "fp32 causal ok\n")
    written = []
    monkeypatch.setattr(course.Path, "write_text", lambda self, text: written.append(str(self)))
    assert course.test_gpu(["--first"]) == 1
    checks = [cmd for _, cmd, _ in course.gpu.first_checks(course.ROOT)]
    assert sorted(map(tuple, (c for c in started if c[:2] != ["-m", "pytest"]))) == sorted(map(tuple, checks))
    assert ["-m", "minipar.course.first_gpu", "bench", "ddp"] in started
    jobs = [c for c in started if c[:2] == ["-m", "pytest"]]
    assert len(jobs) == len([n for n, _ in course.gpu_jobs() if not n.startswith("notebook")])
    assert all(a[-4:] == ["-m", "not slow", "--maxfail", "3"] for a in jobs)
    assert started[0][-1] == "mesh5d" and "tests/test_train.py" in started[2]   # most work (seconds x ranks) first
    out = capsys.readouterr().out
    assert "4 chapter jobs at a time: min(16 cores" in out and "; most work first" in out and "minipar.train cp2 bf16" in out and "FAIL (1)" in out
    assert "--gpu --first: 1 GPU(s) (torch 2.11.0+cu130 (CUDA 13.0; 1 GPU(s): NVIDIA H200 139 GiB) of " \
        "/usr/bin/python3), 16 cores, 4 chapter jobs at a time" in out
    assert "peak GPU memory per rank (MiB)" in out and written[0].endswith("gpu-run-report.txt")


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


def test_the_runner_runs_jobs_side_by_side_and_stops_one_over_its_time(course, tmp_path, capsys):
    """Real processes: a check that passes, one that fails, and one past its time limit, which is
    stopped with its process group (a child it started goes too) and reported as over its time."""
    import os
    import sys
    pid_file = tmp_path / "child"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    tasks = [("benchmark ok", ["-c", "print('ran')"], 30, False), ("benchmark bad", ["-c", "raise SystemExit(3)"], 30, False),
             ("benchmark hang", ["-c", hang], 3, False)]
    env = lambda **extra: dict(os.environ, **extra)   # noqa: E731
    rows = course.runner.run(course.gpu, sys.executable, tasks, tmp_path, env, 16, 64, {}, True)
    assert [(n, r) for n, r, *_ in rows] == [("benchmark ok", "pass"), ("benchmark bad", "FAIL (3)"),
                                             ("benchmark hang", "FAIL (over 3 s)")]
    child = int(pid_file.read_text())
    import time
    for _ in range(50):   # the kill is asynchronous
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.1)
    else:
        pytest.fail("the stopped job's child still runs")
    out = capsys.readouterr().out
    assert "finished benchmark ok: pass" in out and "  ran" in out
    assert course.runner.table(rows, "t")[2].startswith("benchmark ok")
