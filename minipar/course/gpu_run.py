"""What ``python3 course.py test --gpu`` runs and how it reads the results (standard library
only: ``course.py`` loads this file before any environment exists).

* :data:`GPU_TESTS`, the jobs: each chapter's tests with the ranks on the GPU(s), then every
  notebook; :data:`LEFT_OUT`, every other test file with the reason it stays off the GPU run;
* :func:`pytest_args`: ``-k EXPR`` becomes one expression per job (a notebook job's own
  selection ``and`` the caller's), and :func:`outcome` reads pytest's exit 5 (nothing
  selected) as skipped, not failed;
* :func:`device_findings`: every rank a job launched on a GPU must have allocated GPU memory
  (the peaks each rank logs, ``$MINIPAR_MEMORY_LOG``); a rank at 0 MiB beside ranks that used
  the GPU, or a test whose every rank stayed at 0, trained on the CPU: the job fails, naming it;
* :data:`FIRST`, ``--gpu --first``: the short run for a GPU machine never tried before.
"""
from __future__ import annotations

import json
from pathlib import Path

GPU_TESTS = [
    ("01 collectives", ["tests/test_comm.py"]),
    ("02 data parallel", ["tests/test_data_parallel.py", "tests/test_data_parallel_async.py"]),
    ("03 model parallel", ["tests/test_model_parallel.py"]),
    ("04 pipeline", ["tests/test_pipeline_equivalence.py", "tests/test_adaptive.py"]),
    ("05 tensor parallel", ["tests/test_tensor_parallel.py", "tests/test_reference.py"]),
    ("06 zero", ["tests/test_zero.py", "tests/test_zero_per_parameter.py", "tests/test_zero_persist.py",
                 "tests/test_zero_options.py"]),
    ("07 hybrid", ["tests/test_hybrid.py", "tests/test_mesh5d.py", "tests/test_zero_mesh.py",
                   "tests/test_plan_zero3_pp.py"]),
    ("08 context parallel", ["tests/test_context_parallel.py", "tests/test_attention.py"]),
    ("09 expert parallel", ["tests/test_expert_parallel.py"]),
    ("10 planning", ["tests/test_plan.py", "tests/test_recompute.py"]),
    ("mixed precision", ["tests/test_precision.py"]),
    ("12 adaptive", ["tests/test_adapt.py", "tests/test_elastic.py"]),
    ("11 train, checkpoints", ["tests/test_train.py", "tests/test_train_options.py", "tests/test_checkpoint.py",
                               "tests/test_faults.py"]),
    ("devices", ["tests/test_devices.py", "tests/test_launch.py", "tests/test_gpu_paths.py",
                 "tests/test_gpu_run.py"]),
]
# jobs whose tests launch ranks that need not compute (launch, placement, fakes): no peak check
UNCHECKED = {"devices": "its launches test starting ranks, not computing on them"}

_PAPER = "formulas or data structures on paper: no rank computes"
_COURSE = "the course's tooling (exercises, grader, book, packaging): CPU by design"
LEFT_OUT = {
    "tests/test_notebooks.py": "run as one job per notebook (below)",
    "tests/test_bench.py": "the benchmarks' CPU smoke run; --gpu --first runs their GPU refusals",
    "tests/test_nccl_pairing.py": "a CPU model of NCCL's pairing, with torch.distributed faked",
    "tests/test_cost.py": _PAPER, "tests/test_capacity.py": _PAPER, "tests/test_plan_holes.py": _PAPER,
    "tests/test_pipeline_schedules.py": _PAPER, "tests/test_mesh.py": "the mesh's group layout (CPU ranks)",
    "tests/test_models_data.py": "single-process models and data on the CPU",
    "tests/test_trace_viz.py": "trace bookkeeping and figures from recorded events",
    "tests/test_conformance.py": "the strategies' API shape (their equivalence runs in the chapter jobs)",
    "tests/test_checkpoint_integrity.py": "checkpoint files' integrity chain (no training)",
    "tests/test_faults_snapshot.py": "undoing a step in one process (no device path)",
    "tests/test_colab.py": "notebooks' first cells", "tests/test_colab_runtime.py": "plays a Colab runtime on the CPU",
    "tests/test_course.py": _COURSE, "tests/test_book.py": _COURSE, "tests/test_install.py": _COURSE,
    "tests/test_layers.py": _COURSE, "tests/test_project.py": _COURSE, "tests/test_contracts.py": _COURSE,
    "tests/test_no_hint_unasked.py": _COURSE, "tests/test_notebook_exercises.py": _COURSE,
    "tests/test_parallelize.py": "the composition's order and its one call site, read from the source",
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


def device_findings(entries: list[dict]) -> list[str]:
    """Who trained on the CPU, from the GPU ranks' logged peaks (``rank``, ``device``, ``peak``
    bytes, ``launch`` id, ``test``): in one launch a rank at 0 beside ranks that allocated GPU
    memory; or a test none of whose GPU ranks ever allocated any."""
    gpu = [e for e in entries if str(e.get("device", "")).startswith("cuda")]
    found = []
    for launch in dict.fromkeys(e.get("launch") for e in gpu):
        ranks = [e for e in gpu if e.get("launch") == launch]
        used = [e for e in ranks if e["peak"] > 0]
        if used:
            found += [f"{e.get('test') or '?'}: rank {e['rank']} computed on the CPU (GPU peak 0 MiB; "
                      f"rank {used[0]['rank']} used {used[0]['peak'] / 2**20:.1f} MiB)"
                      for e in ranks if e["peak"] == 0]
    for test in dict.fromkeys(e.get("test") for e in gpu):
        if all(e["peak"] == 0 for e in gpu if e.get("test") == test):
            found.append(f"{test or '?'}: no rank computed on the GPU (every rank's GPU peak is 0 MiB)")
    return found


# ``--gpu --first``: (name, command after the venv's python, seconds allowed)
FIRST = [
    ("fused attention vs autograd SDPA", ["-m", "minipar.course.first_gpu", "attention"], 120),
    ("minipar.train cp2 fp32", ["-m", "minipar.train", "--cp", "2", "--steps", "2", "--device", "cuda",
                                "--no-progress"], 180),
    ("minipar.train cp2 bf16", ["-m", "minipar.train", "--cp", "2", "--steps", "2", "--device", "cuda",
                                "--dtype", "bf16", "--no-progress"], 180),
    ("benchmarks' refusals", ["-m", "minipar.course.first_gpu", "refusals"], 240),
]
FIRST_JOB_ARGS = ["-m", "not slow", "--maxfail", "3"]  # one job per chapter, its quick tier
