"""What ``python3 course.py test --gpu`` runs and how it reads the results (standard library
only: ``course.py`` loads this file before any environment exists).

* :data:`GPU_TESTS`, the jobs: each chapter's tests with the ranks on the GPU(s), then every
  notebook; :data:`LEFT_OUT`, every other test file with the reason it stays off the GPU run;
* :func:`pytest_args`: ``-k EXPR`` becomes one expression per job (a notebook job's own
  selection ``and`` the caller's), and :func:`outcome` reads pytest's exit 5 (nothing
  selected) as skipped, not failed;
* :func:`device_findings`: every rank a job launched on a GPU must have allocated GPU memory
  (the peaks each rank logs, ``$MINIPAR_MEMORY_LOG``, above what its warm worker held when the
  launch began); a rank that allocated nothing beside ranks that did, or a test none of whose
  ranks did, trained on the CPU: the job fails, naming it;
* :data:`FIRST`, ``--gpu --first``: the short run for a GPU machine never tried before
  (:func:`first_checks`: with each benchmark on its own);
* :func:`width`, how many jobs run at once (from the cores and the GPU memory), and
  :func:`longest_first`, the order (the last run's times, :data:`SECONDS` before any).
"""
from __future__ import annotations

import json
from pathlib import Path

GPU_TESTS = [
    ("01 collectives", ["tests/test_comm.py"]),
    ("02 data parallel", ["tests/test_data_parallel.py", "tests/test_data_parallel_async.py"]),
    ("03 model parallel", ["tests/test_model_parallel.py"]),
    ("04 pipeline", ["tests/test_pipeline_equivalence.py", "tests/test_adaptive.py",
                     "tests/test_pipeline_tags.py", "tests/test_stepping.py"]),
    ("05 tensor parallel", ["tests/test_tensor_parallel.py", "tests/test_reference.py"]),
    ("06 zero", ["tests/test_zero.py", "tests/test_zero_per_parameter.py", "tests/test_zero_persist.py",
                 "tests/test_zero_options.py", "tests/test_zero_spans.py", "tests/test_zero_prefetch.py"]),
    ("07 hybrid", ["tests/test_hybrid.py", "tests/test_mesh5d.py", "tests/test_zero_mesh.py",
                   "tests/test_plan_zero3_pp.py", "tests/test_zero_mesh_units.py"]),
    ("08 context parallel", ["tests/test_context_parallel.py", "tests/test_attention.py"]),
    ("09 expert parallel", ["tests/test_expert_parallel.py"]),
    ("10 planning", ["tests/test_plan.py", "tests/test_recompute.py"]),
    ("mixed precision", ["tests/test_precision.py"]),
    ("12 adaptive", ["tests/test_adapt.py", "tests/test_adapt_layouts.py", "tests/test_elastic.py",
                     "tests/test_straggler_costs.py"]),
    ("11 train, checkpoints", ["tests/test_train.py", "tests/test_train_options.py", "tests/test_checkpoint.py",
                               "tests/test_faults.py"]),
    ("devices", ["tests/test_devices.py", "tests/test_launch.py", "tests/test_gpu_paths.py",
                 "tests/test_gpu_run.py", "tests/test_staged_labels.py", "tests/test_staged_mode.py",
                 "tests/test_placement_sites.py", "tests/test_ranks_magic.py"]),
]
# jobs whose tests launch ranks that need not compute (launch, placement, fakes): no peak check
UNCHECKED = {"devices": "its launches test starting ranks, not computing on them"}

_PAPER = "formulas or data structures on paper: no rank computes"
_COURSE = "the course's tooling (exercises, grader, book, packaging): CPU by design"
LEFT_OUT = {
    "tests/test_notebooks.py": "run as one job per notebook (below)",
    "tests/test_bench.py": "the benchmarks' CPU smoke run; --gpu --first runs each on the GPU (or its refusal)",
    "tests/test_nccl_pairing.py": "a CPU model of NCCL's pairing, with torch.distributed faked",
    "tests/test_staged_chapters.py": "the GPU jobs' shared-GPU branches taken on the CPU; a GPU machine runs the jobs themselves",
    "tests/test_cost.py": _PAPER, "tests/test_capacity.py": _PAPER, "tests/test_plan_holes.py": _PAPER,
    "tests/test_pipeline_schedules.py": _PAPER, "tests/test_mesh.py": "the mesh's group layout (CPU ranks)",
    "tests/test_models_data.py": "single-process models and data on the CPU",
    "tests/test_trace_viz.py": "trace bookkeeping and figures from recorded events",
    "tests/test_conformance.py": "the strategies' API shape (their equivalence runs in the chapter jobs)",
    "tests/test_checkpoint_integrity.py": "checkpoint files' integrity chain (no training)",
    "tests/test_faults_snapshot.py": "undoing a step in one process (no device path)",
    "tests/test_colab.py": "notebooks' first cells", "tests/test_colab_runtime.py": "plays a Colab runtime on the CPU",
    "tests/test_course.py": _COURSE, "tests/test_book.py": _COURSE, "tests/test_install.py": _COURSE,
    "tests/test_layers.py": _COURSE, "tests/test_gpu_env.py": _COURSE, "tests/test_project.py": _COURSE, "tests/test_contracts.py": _COURSE,
    "tests/test_contract_clauses.py": _COURSE, "tests/test_hints_sealed.py": _COURSE, "tests/test_key_lines.py": _COURSE, "tests/test_grade_output_no_key_line.py": _COURSE,
    "tests/test_no_hint_unasked.py": _COURSE, "tests/test_notebook_exercises.py": _COURSE,
    "tests/test_parallelize.py": "the composition's order and its one call site, read from the source",
    "tests/test_grow.py": "its ranks are its own processes on Gloo groups over a store it hosts, pinned to the CPU: "
                          "a generation's group is Gloo only (an NCCL generation is not built yet)",
}
_GRADER = "the grader and exercise stubs (graded on the CPU, as learners run them by default)"
_PREFIXES = {"tests/test_grading": _GRADER, "tests/test_planted_": _GRADER, "tests/test_challenge": _GRADER}
UNCLASSIFIED = "not classified: stays off the GPU run until GPU_TESTS or LEFT_OUT names it"


def classify(root: Path) -> list[tuple[str, str | None, str]]:
    """``(file, job or None, reason)`` for every ``tests/test_*.py``: in a job, or left out and why."""
    job_of = {f: name for name, files in GPU_TESTS for f in files}
    out = []
    for path in sorted((root / "tests").glob("test_*.py")):
        f = f"tests/{path.name}"
        reason = LEFT_OUT.get(f) or next((r for p, r in _PREFIXES.items() if f.startswith(p)), UNCLASSIFIED)
        out.append((f, job_of.get(f), "" if f in job_of else reason))
    return out


def split_k(args: list[str]) -> tuple[str | None, list[str]]:
    """The caller's ``-k EXPR`` (several are joined with ``and``) and the other arguments."""
    exprs, rest, it = [], [], iter(args)
    for a in it:
        if a == "-k":
            exprs.append(next(it, ""))
        elif a.startswith("-k") and len(a) > 2:
            exprs.append(a[2:])
        else:
            rest.append(a)
    return (None if not exprs else exprs[0] if len(exprs) == 1 else " and ".join(f"({e})" for e in exprs)), rest


def pytest_args(files: list[str], own_k: str | None, k: str | None) -> list[str]:
    """One job's pytest arguments with a single ``-k``: its own selection and the caller's."""
    expr = " and ".join(e for e in (own_k, k and (f"({k})" if own_k else k)) if e)
    return ["-q", "-x", *files, *(["-k", expr] if expr else [])]


def jobs(root: Path, args: list[str] = ()) -> list[tuple[str, list[str]]]:
    """``(name, pytest arguments)`` of every job: each chapter's tests, then each notebook."""
    k, _ = split_k(list(args))
    notebooks = sorted(p.stem[:2] for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    found = [(name, [f for f in files if (root / f).exists()]) for name, files in GPU_TESTS]
    return ([(n, pytest_args(files, None, k)) for n, files in found if files]
            + [(f"notebook {nb}", pytest_args(["tests/test_notebooks.py"], nb, k)) for nb in notebooks])


def outcome(returncode: int) -> str:
    """A job's result from pytest's exit code: 5 means no test was selected (``-k``)."""
    return "pass" if returncode == 0 else "skipped (none selected)" if returncode == 5 else f"FAIL ({returncode})"


def job_result(name: str, returncode: int, entries: list[dict]) -> tuple[str, list[str]]:
    """A job's result and findings: pytest's (:func:`outcome`) and, unless the job is
    :data:`UNCHECKED`, the ranks that trained on the CPU (:func:`device_findings`)."""
    result = outcome(returncode)
    findings = [] if name in UNCHECKED or returncode == 5 else device_findings(entries)
    return ("FAIL (CPU ranks)" if findings and result == "pass" else result), findings


def peaks(entries: list[dict]) -> dict[int, int]:
    """The peak GPU memory of each rank over a job's launches."""
    out: dict[int, int] = {}
    for e in entries:
        out[e["rank"]] = max(out.get(e["rank"], 0), e["peak"])
    return out


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def used(entry: dict) -> int:
    """Bytes a rank allocated on its GPU during the launch: its peak above what its warm worker
    still held when the launch began (``start``: cuBLAS's workspace and the like, left by earlier
    jobs; a rank that computed on the CPU has a peak equal to it)."""
    return entry["peak"] - entry.get("start", 0)


def device_findings(entries: list[dict]) -> list[str]:
    """Who trained on the CPU, from the GPU ranks' logged peaks (``rank``, ``device``, ``peak``
    and ``start`` bytes, ``launch`` id, ``test``): in one launch a rank that allocated nothing
    (:func:`used`) beside ranks that did; or a test none of whose GPU ranks ever allocated any."""
    gpu = [e for e in entries if str(e.get("device", "")).startswith("cuda")]
    found = []
    for launch in dict.fromkeys(e.get("launch") for e in gpu):
        ranks = [e for e in gpu if e.get("launch") == launch]
        busy = [e for e in ranks if used(e) > 0]
        if busy:
            found += [f"{e.get('test') or '?'}: rank {e['rank']} computed on the CPU (no GPU memory allocated; "
                      f"rank {busy[0]['rank']} allocated {used(busy[0]) / 2**20:.1f} MiB)"
                      for e in ranks if used(e) <= 0]
    for test in dict.fromkeys(e.get("test") for e in gpu):
        if all(used(e) <= 0 for e in gpu if e.get("test") == test):
            found.append(f"{test or '?'}: no rank computed on the GPU (no rank allocated GPU memory)")
    return found


# ``--gpu --first``: (name, command after the environment's python, seconds allowed)
FIRST = [
    ("fused attention vs autograd SDPA", ["-m", "minipar.course.first_gpu", "attention"], 120),
    ("minipar.train cp2 fp32", ["-m", "minipar.train", "--cp", "2", "--steps", "2", "--device", "cuda",
                                "--no-progress"], 180),
    ("minipar.train cp2 bf16", ["-m", "minipar.train", "--cp", "2", "--steps", "2", "--device", "cuda",
                                "--dtype", "bf16", "--no-progress"], 180),
]
FIRST_JOB_ARGS = ["-m", "not slow", "--maxfail", "3"]  # one job per chapter, its quick tier


def benchmarks(root: Path) -> list[str]:
    """The benchmarks ``python -m minipar.bench`` lists (its modules, read from the folder)."""
    return sorted(p.stem for p in (root / "minipar" / "bench").glob("*.py")
                  if p.stem not in ("common", "__main__", "__init__") and not p.stem.startswith("_"))


def first_checks(root: Path) -> list[tuple[str, list[str], int]]:
    """``--first``'s checks: :data:`FIRST`, then each benchmark at ``--smoke --device cuda`` on
    its own (it runs with its ranks on the GPU(s), or refuses in one line saying what it needs)."""
    return FIRST + [(f"benchmark {b}", ["-m", "minipar.course.first_gpu", "bench", b], 150)
                    for b in benchmarks(root)]


# ---------------------------------------------------------------- how many at once
# Every job's ranks share the GPU(s) and the cores: a rank is one process of 1 thread holding a
# CUDA context. A job may start while the ranks running with it fit both the cores (one each) and
# the GPU memory (GIB_PER_RANK each); the first always starts.
GIB_PER_RANK = 1.0   # a CUDA context (about 0.5 GiB) + a chapter's largest per-rank peak (< 0.5 GiB)
JOB_RANKS = 4        # a chapter's or a notebook's launches: 4 ranks at most, mostly
CORES_PER_JOB, GIB_PER_JOB = JOB_RANKS, JOB_RANKS * GIB_PER_RANK
RANKS = {"fused attention vs autograd SDPA": 1, "minipar.train cp2 fp32": 2, "minipar.train cp2 bf16": 2,
         "benchmark mesh5d": 8, "benchmark adapt": 4, "benchmark recompute": 1, "benchmark planner": 2}
BENCH_RANKS = 2      # the other benchmarks at --smoke
GPU_GIB_IF_NONE = 15.0   # the dry run without a GPU: as on Colab's T4 (15 GiB)


def ranks_of(name: str) -> int:
    """Ranks (cores, and GPU contexts) a job or check holds while it runs."""
    return RANKS.get(name, BENCH_RANKS if name.startswith("benchmark ") else JOB_RANKS)


def fits(running: list[int], ranks: int, cores: int, gpu_gib: float) -> bool:
    """Whether a job of ``ranks`` may start beside jobs holding ``running`` ranks."""
    held = sum(running) + ranks
    return not running or (held <= cores and held * GIB_PER_RANK <= gpu_gib)


def width(cores: int, gpu_gib: float, n_jobs: int, override: str | None = None) -> tuple[int, str]:
    """Chapter jobs at once, and the rule as a sentence: ``min(cores // CORES_PER_JOB, GPU
    memory // GIB_PER_JOB, jobs)``, at least 1 (:func:`fits` for 4-rank jobs; lighter checks,
    a benchmark of 2 ranks, fit more). A 16-core H200 (139 GiB) runs 4 at a time, Colab's 2-core
    T4 one. ``override``: ``MINIPAR_GPU_JOBS``, which wins (a fixed number of jobs at once)."""
    if override:
        return max(1, int(override)), f"MINIPAR_GPU_JOBS={override}"
    by_cores, by_mem = max(1, cores // CORES_PER_JOB), max(1, int(gpu_gib // GIB_PER_JOB))
    w = max(1, min(by_cores, by_mem, n_jobs))
    return w, (f"min({cores} cores // {CORES_PER_JOB} per job = {by_cores}, {gpu_gib:.0f} GiB of GPU memory "
               f"// {GIB_PER_JOB:g} GiB per job = {by_mem}, {n_jobs} jobs)")


# ---------------------------------------------------------------- in which order
# seconds per job on one H200 with 16 cores, 4 at a time: the full tier, and --first's quick tier
# (-m "not slow" --maxfail 3). The first run's log has only the quick tier, and its jobs stopped
# at their first failures, so these are estimates from it; each run keeps its own (TIMES_FILE)
SECONDS = {"01 collectives": 30, "02 data parallel": 45, "03 model parallel": 30, "04 pipeline": 75,
           "05 tensor parallel": 45, "06 zero": 90, "07 hybrid": 90, "08 context parallel": 75,
           "09 expert parallel": 55, "10 planning": 70, "mixed precision": 40, "12 adaptive": 60,
           "11 train, checkpoints": 120, "devices": 55}
QUICK_SECONDS = {"01 collectives": 20, "02 data parallel": 35, "03 model parallel": 25, "04 pipeline": 45,
                 "05 tensor parallel": 30, "06 zero": 50, "07 hybrid": 45, "08 context parallel": 45,
                 "09 expert parallel": 41, "10 planning": 45, "mixed precision": 30, "12 adaptive": 35,
                 "11 train, checkpoints": 55, "devices": 46,
                 # each benchmark at --smoke: a fresh process, its launches, minipar's and the baseline's runs
                 "benchmark adapt": 60, "benchmark mesh5d": 60, "benchmark ddp": 40, "benchmark planner": 40,
                 "benchmark launch": 30}
NOTEBOOK_SECONDS, CHECK_SECONDS, BENCH_SECONDS = 45, 20, 25
TIMES_FILE = "build/gpu-run-seconds.json"   # the last run's times, which order the next run
REPORT_FILE = "build/gpu-run-report.txt"    # the last run's table: result, seconds, peak memory per rank


def expected(name: str, last: dict, quick: bool = False) -> float:
    """A job's expected seconds: the last run's on this machine, else the estimates above."""
    key = f"{name} (quick)" if quick else name
    return (last.get(key) or (QUICK_SECONDS if quick else SECONDS).get(name)
            or (NOTEBOOK_SECONDS if name.startswith("notebook") else
                BENCH_SECONDS if name.startswith("benchmark") else CHECK_SECONDS))


def longest_first(names: list[str], last: dict, quick: bool = False) -> list[int]:
    """The order to start jobs in: most work first (expected seconds x ranks: so the run does not
    end waiting on one long or wide job started last), ties in the given order."""
    return sorted(range(len(names)), key=lambda i: (-expected(names[i], last, quick) * ranks_of(names[i]), i))


def next_job(todo: list[int], ranks: dict, running: list[int], cores: int, gpu_gib: float) -> int | None:
    """The first job of ``todo`` (in order) that :func:`fits` beside the ``running`` ranks: a wide
    job waiting for room does not hold back a narrower one behind it."""
    return next((i for i in todo if fits(running, ranks[i], cores, gpu_gib)), None)


def makespan(jobs: list[tuple[float, int]], cores: int, gpu_gib: float) -> float:
    """Wall time of ``(seconds, ranks)`` jobs, each started (in that order, :func:`next_job`) as
    soon as it fits beside the running ones: what ``course.py test --gpu`` does, timed ahead."""
    todo, t, running = list(range(len(jobs))), 0.0, []   # running: (finish time, job)
    ranks = {i: r for i, (_, r) in enumerate(jobs)}
    while todo or running:
        i = next_job(todo, ranks, [ranks[j] for _, j in running], cores, gpu_gib)
        if i is None:
            t = min(f for f, _ in running)
            running = [(f, j) for f, j in running if f > t]
            continue
        todo.remove(i)
        running.append((t + jobs[i][0], i))
    return t if not running else max(f for f, _ in running)


def read_times(root: Path) -> dict:
    try:
        return json.loads((root / TIMES_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_times(root: Path, rows: list[tuple], quick: bool = False) -> None:
    """Keep each job's seconds (a job that failed early says little: only passes are kept)."""
    times = read_times(root)
    times.update({f"{name} (quick)" if quick else name: round(secs, 1)
                  for name, result, secs, *_ in rows if result == "pass"})
    (root / TIMES_FILE).parent.mkdir(exist_ok=True)
    (root / TIMES_FILE).write_text(json.dumps(times, indent=1, sort_keys=True))
