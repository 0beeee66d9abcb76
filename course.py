#!/usr/bin/env python3
"""Set up the course and open it, or run its tests: the README's commands.

    python3 course.py lab                 # make .venv, install, open notebook 00 in JupyterLab
    python3 course.py test [pytest args]  # make .venv, install, run the test suite
    python3 course.py test --quick        # all but the slow tier (the notebooks, multi-minute
                                          # launches: pytest -m "not slow"), a few minutes
    python3 course.py book                # the web book: every notebook executed (or reused from
                                          # the tests' run), a static site, checked in a browser
    python3 course.py test --gpu          # on a GPU machine: equivalence tests and every notebook
                                          # on the GPU, then a report per job (< 8 min on 16 cores)
    python3 course.py test --gpu --dry-run   # the torch and the width it would use, what it would
                                          # run, every test file in or out and why, and a check
                                          # (no GPU needed) that none assumes the CPU
    python3 course.py test --gpu --first  # a new GPU machine's first run (< 4 min): fused kernels,
                                          # minipar.train with CP, each benchmark, one quick job
                                          # per chapter
    python3 course.py test --gpu --system # with the interpreter running course.py as it is
    python3 course.py test --torch 2.9.0 -k launch   # the tests under another torch, in its
                                          # own environment (~/.cache/minipar/envs/torch-2.9.0)
    python3 course.py test --colab        # play Colab: a fresh runtime with its own torch (2.9.0),
                                          # notebooks 00 and 02 run from outside the repository

Needs only Python >= 3.10. Everything goes into ./.venv; the install is redone only when
pyproject.toml changes. PyTorch is pinned to the version the course is tested with
(override with MINIPAR_TORCH, e.g. MINIPAR_TORCH="torch==2.13.0" or a CUDA build's spec).
``test --gpu`` on a machine whose python3 already has a CUDA torch (Colab, Kaggle, a rented
box, a cluster node) uses that torch, through ./.venv-gpu, which sees its packages and gets
only what is missing (offline too, when nothing is): minipar/course/gpu_env.py.
``lab`` works as root too (Docker images, rented GPU machines) and prints the URL to open.
"""
import hashlib
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH = os.environ.get("MINIPAR_TORCH", "torch==2.13.0")
ENVS = Path(os.environ.get("MINIPAR_ENVS", Path.home() / ".cache" / "minipar" / "envs"))



def _load(name: str, path: Path):
    """A standard-library module of the package, loaded by path (no torch, no install needed)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# what `test --gpu` runs (each chapter's tests, then every notebook) and what it leaves out, why
gpu = _load("_gpu_run", ROOT / "minipar" / "course" / "gpu_run.py")
GPU_TESTS = gpu.GPU_TESTS
# which python and torch it runs with: the machine's own CUDA torch when there is one
genv = _load("_gpu_env", ROOT / "minipar" / "course" / "gpu_env.py")
runner = _load("_gpu_jobs", ROOT / "minipar" / "course" / "gpu_jobs.py")   # and how its jobs run side by side


def python(env: Path = VENV) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(*cmd, **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, **kw)


def setup() -> None:
    if sys.version_info < (3, 10):
        sys.exit(f"minipar needs Python >= 3.10; this is {sys.version.split()[0]}")
    if not python().exists():
        venv.create(VENV, with_pip=True)
    stamp = VENV / ".minipar-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return
    run(python(), "-m", "pip", "install", "-q", "--upgrade", "pip")
    run(python(), "-m", "pip", "install", "-q", TORCH)
    run(python(), "-m", "pip", "install", "-q", "-e", ".[test]")
    stamp.write_text(want)


# ------------------------------------------------------------------ lab
def _free_port(start: int = 8888) -> int:
    for port in range(start, start + 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    return start


def lab(extra: list[str]) -> int:
    """JupyterLab on the notebooks, with a token we print (the URL to open), as root too."""
    port, token = _free_port(), secrets.token_hex(16)
    first = "00_welcome.ipynb"
    cmd = [str(python()), "-m", "jupyter", "lab", f"--ServerApp.root_dir={ROOT / 'notebooks'}",
           f"--LabApp.default_url=/lab/tree/{first}", f"--port={port}", f"--IdentityProvider.token={token}"]
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if root:  # Docker images and rented GPU machines run as root; JupyterLab refuses without this
        cmd += ["--allow-root", "--no-browser"]
    cmd += extra
    print(f"\nOpen the course at:  http://localhost:{port}/lab/tree/{first}?token={token}\n"
          f"(on a remote machine: ssh -L {port}:localhost:{port} to it first){' [root]' if root else ''}\n",
          flush=True)
    return subprocess.call(cmd, cwd=ROOT)


# ------------------------------------------------------------------ test --torch X.Y.Z
def _runtime_deps(build: bool = True) -> list[str]:
    """pyproject's build requirements, dependencies and test extras, without torch (the tests build
    a wheel, so the build backend is one of them; ``build=False``: not it, as for ``test --gpu``,
    whose jobs build nothing; a small parser: py3.10 has no tomllib)."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = []
    for block in re.findall(r"(?:requires|dependencies|test)\s*=\s*\[(.*?)\]" if build else
                            r"(?:dependencies|test)\s*=\s*\[(.*?)\]", text, re.S):
        deps += re.findall(r'"([^"]+)"', block)
    return [d for d in deps if not re.match(r"torch\b", d)]


def torch_env(version: str) -> Path:
    """An environment with torch==``version`` and minipar's other dependencies (minipar itself
    comes from this checkout through PYTHONPATH). Made once, reused."""
    env = ENVS / f"torch-{version}"
    stamp = env / ".minipar-installed"
    want = hashlib.sha256(("\n".join(_runtime_deps()) + version).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return env
    ENVS.mkdir(parents=True, exist_ok=True)
    if not python(env).exists():
        venv.create(env, with_pip=True)
    print(f"installing torch=={version} into {env} (a CUDA build from PyPI is several GB)", flush=True)
    run(python(env), "-m", "pip", "install", "-q", f"torch=={version}", *_runtime_deps())
    stamp.write_text(want)
    return env


def test_torch(version: str, args: list[str]) -> int:
    env = torch_env(version)
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([str(python(env)), "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, env=environ)
    print(f"testing with torch {out.stdout.strip()} ({env})", flush=True)
    return subprocess.call([str(python(env)), "-m", "pytest", "-p", "no:cacheprovider", *args],
                           cwd=ROOT, env=environ)


# ------------------------------------------------------------------ test --gpu
def gpu_jobs(args: list[str] = ()) -> list[tuple[str, list[str]]]:
    """``(name, pytest arguments)`` of every job ``test --gpu`` runs: each chapter's tests, then
    each notebook; a ``-k`` in ``args`` is one combined expression per job."""
    return gpu.jobs(ROOT, args)


def gpu_width(gpus: int, cores: int | None = None, gpu_gib: float | None = None,
              n_jobs: int = 1000) -> int:
    """Jobs at once (:func:`gpu_run.width`: the cores and the GPU memory; ``MINIPAR_GPU_JOBS``
    overrides). No GPU (the dry run): as on Colab's T4."""
    return gpu_width_rule(gpus, cores, gpu_gib, n_jobs)[0]


def gpu_width_rule(gpus, cores=None, gpu_gib=None, n_jobs=1000) -> tuple[int, str]:
    gib = gpu_gib if gpu_gib is not None and gpus else gpu.GPU_GIB_IF_NONE * max(gpus, 1)
    return gpu.width(cores or os.cpu_count() or 1, gib, n_jobs, os.environ.get("MINIPAR_GPU_JOBS"))


def gpu_python(args: list[str]):
    """The interpreter ``test --gpu`` runs with, ready (:mod:`minipar.course.gpu_env`: the
    machine's own CUDA torch when the interpreter running course.py has one, through .venv-gpu
    with only what is missing installed; ``--system``: that interpreter itself; else .venv),
    and its torch (:class:`gpu_env.Torch`), said in two lines."""
    interpreter = genv.probe(sys.executable)
    choice = genv.choose(interpreter, ROOT, system="--system" in args,
                         torch_spec=os.environ.get("MINIPAR_TORCH"), pinned=TORCH)
    installed, lacking = [], []
    if choice.kind == "pinned":
        setup()
        py = python()
    else:
        py = Path(sys.executable)
        if choice.kind == "own":
            try:
                py = genv.make_own_env(choice.env, interpreter)
            except (OSError, subprocess.CalledProcessError, StopIteration) as e:  # no venv module, a read-only disk
                choice.why += f"; {choice.env.name} could not be made ({type(e).__name__}: {e}), so {py} itself"
        installed, lacking = genv.install_missing(py, _runtime_deps(build=False), run)
    used = interpreter if choice.kind == "system" else genv.probe(py)
    extra = (f"; installed: {', '.join(installed)}" if installed else "") + \
            (f"; still missing (no package registry?): {', '.join(lacking)}" if lacking else "")
    print(f"torch: {used.describe()}\n  chosen because: {choice.why}{extra}", flush=True)
    return py, used


def gpu_dry_run(gpus: int, args: list[str], py: Path | None = None, cores: int | None = None,
                gpu_gib: float | None = None) -> int:
    """List the jobs and commands of ``test --gpu``, the width chosen and why, every test file
    (in a job, or left out and why), and check, without a GPU, that its tests collect as on one
    (``minipar.runtime.devices_check``) and that none assumes the CPU."""
    py = py or python()
    simulated = max(gpus, 1)
    jobs = gpu_jobs(args)
    w, rule = gpu_width_rule(gpus, cores, gpu_gib, len(jobs))
    print(f"course.py test --gpu --dry-run: {gpus} GPU(s) here; as on {simulated}: "
          f"{len(jobs)} jobs, {w} at a time, each with MINIPAR_DEVICE=cuda; every job "
          f"but {', '.join(gpu.UNCHECKED)} fails if one of its ranks trained on the CPU (allocated no GPU memory)")
    print(f"width: {w} = {rule}" + ("" if gpus else f" (no GPU here: as on one of {gpu.GPU_GIB_IF_NONE:g} GiB)"))
    last, names = gpu.read_times(ROOT), [n for n, _ in jobs]
    order = gpu.longest_first(names, last)
    expect = gpu.makespan([(gpu.expected(names[i], last), gpu.ranks_of(names[i])) for i in order],
                          *_budget(w, cores or os.cpu_count() or 1, gpu_gib if gpus and gpu_gib else
                                   gpu.GPU_GIB_IF_NONE * simulated))
    print(f"order: most work first (seconds x ranks: {'the last run' if last else 'the first H200 run'}'s seconds), "
          f"about {expect:.0f} s expected")
    for name, pytest_args in jobs:
        print(f"  {name:<24} {py} -m pytest {' '.join(pytest_args)}")
    print("test files:")
    for f, job, why in gpu.classify(ROOT):
        print(f"  {f:<40} {'in ' + job if job else 'left out: ' + why}")
    files = sorted({f for _, a in jobs for f in a if f.startswith("tests/")})
    return subprocess.call([str(py), "-m", "minipar.runtime.devices_check", "--gpus", str(simulated),
                            *files], cwd=ROOT)


def _budget(width: int, cores: int, gpu_gib: float) -> tuple[int, float]:
    """Cores and GPU GiB the jobs may hold at once: the machine's, or under ``MINIPAR_GPU_JOBS``
    that many 4-rank jobs' worth."""
    if os.environ.get("MINIPAR_GPU_JOBS"):
        return width * gpu.CORES_PER_JOB, width * gpu.GIB_PER_JOB
    return cores, gpu_gib


def _environ(**extra) -> dict:
    """This checkout's minipar first (the machine's own environment has no minipar installed)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)


def test_gpu(args: list[str]) -> int:
    """Every chapter's equivalence tests with the ranks on the GPU(s), then every notebook,
    each timed, with the peak GPU memory of each rank; a report at the end (``--dry-run``:
    what it would run, :func:`gpu_dry_run`; ``--first``: the checks of :func:`gpu.first_checks`
    and each chapter's quick tier, run side by side with the jobs). Jobs start most work first,
    :func:`gpu_width` at a time."""
    py, used = gpu_python(args)
    args = [a for a in args if a != "--system"]
    gpus = len(used.gpus)
    if "--dry-run" in args:
        return gpu_dry_run(gpus, [a for a in args if a != "--dry-run"], py, used.cores, used.gpu_gib)
    if gpus == 0:
        print(f"course.py test --gpu: no CUDA GPU visible to {py}'s torch ({used.torch}); "
              "run it on a machine with a GPU (a CUDA torch there is used as it is).")
        return 2
    first = "--first" in args
    _, rest = gpu.split_k([a for a in args if a != "--first"])
    if first:
        tasks = [(n, ["-m", "pytest", *a, *gpu.FIRST_JOB_ARGS, *rest], 300, True)
                 for n, a in gpu_jobs() if not n.startswith("notebook")]
        tasks = [(n, cmd, limit, False) for n, cmd, limit in gpu.first_checks(ROOT)] + tasks
    else:
        tasks = [(n, ["-m", "pytest", *a, *rest], 240 if n.startswith("notebook") else 480, True)
                 for n, a in gpu_jobs(args)]
    width, rule = gpu_width_rule(gpus, used.cores, used.gpu_gib, len(tasks))
    cores, gib = _budget(width, used.cores, used.gpu_gib)
    print(f"{len(tasks)} jobs, {width} chapter jobs at a time: {rule}; lighter checks fill the "
          f"rest of {cores} cores and {gib:.0f} GiB ({gpu.GIB_PER_RANK:g} GiB per rank); most work first", flush=True)
    t_all = time.perf_counter()
    rows = runner.run(gpu, py, tasks, ROOT, _environ, cores, gib, gpu.read_times(ROOT), first)
    gpu.write_times(ROOT, rows, first)
    report = runner.table(rows, f"course.py test --gpu{' --first' if first else ''}: {gpus} GPU(s) "
                                f"({used.describe()}), {used.cores} cores, {width} chapter jobs at a time, "
                                f"{time.perf_counter() - t_all:.0f} s in all")
    print("\n" + "\n".join(report))
    try:   # kept beside the run's times, to paste into a note
        (ROOT / gpu.REPORT_FILE).write_text("\n".join(report) + "\n")
        print(f"(also in {gpu.REPORT_FILE})")
    except OSError:
        pass
    return 1 if [r for r in rows if r[1].startswith("FAIL")] else 0


# ------------------------------------------------------------------ no arguments: the map
def course_map() -> str:
    """The two commands and the chapters (read from minipar/course/chapters.py, which needs no torch)."""
    chapters = _load("_chapters", ROOT / "minipar" / "course" / "chapters.py")
    return ("minipar: distributed training, built from scratch and run for real.\n\n"
            "  python3 course.py lab     set up .venv and open the course (notebook 00)\n"
            "  python3 course.py test    set up .venv and run the tests\n"
            "  python3 course.py help    every command\n\n"
            "The chapters (notebooks/), with their exercise and minutes to run on 2 cores:\n"
            + chapters.course_map())


# ------------------------------------------------------------------ book
def book(extra: list[str]) -> int:
    """The web book's tools (pyproject's `book` extra) once, then python -m minipar.course.book."""
    stamp = VENV / ".minipar-book-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not (stamp.exists() and stamp.read_text() == want):
        run(python(), "-m", "pip", "install", "-q", "-e", ".[test,book]")
        stamp.write_text(want)
    return subprocess.call([str(python()), "-m", "minipar.course.book", *extra], cwd=ROOT)


# ------------------------------------------------------------------ test --colab
def test_colab(version: str, args: list[str]) -> int:
    """A fresh runtime as Colab's: torch==``version`` (not the pinned one), ipykernel and
    nbclient, no minipar; tests/test_colab_runtime.py plays notebooks 00 and 02 in it."""
    env = ENVS / f"colab-torch-{version}"
    stamp = env / ".minipar-colab"
    if not stamp.exists():
        if not python(env).exists():
            venv.create(env, with_pip=True)
        print(f"a fresh runtime with torch=={version} in {env} (a CUDA build from PyPI is several GB)", flush=True)
        run(python(env), "-m", "pip", "install", "-q", f"torch=={version}", "ipykernel", "nbclient", "nbformat")
        stamp.write_text(version)
    # the notebooks' setup cell installs the course into the runtime: undo the last run's, so
    # every run starts as a new Colab runtime does, without minipar
    subprocess.run([str(python(env)), "-m", "pip", "uninstall", "-q", "-y", "minipar"], capture_output=True)
    environ = dict(os.environ, MINIPAR_COLAB_PYTHON=str(python(env)))
    return subprocess.call([str(python()), "-m", "pytest", "tests/test_colab_runtime.py", "-s", *args],
                           cwd=ROOT, env=environ)


def main(argv) -> int:
    what = argv[1] if len(argv) > 1 else "map"
    if what == "map":
        print(course_map())
        return 0
    if what not in ("lab", "test", "book"):
        print(__doc__)
        return 0 if what in ("help", "-h", "--help") else 2
    rest = argv[2:]
    if what == "test" and "--torch" in rest:
        i = rest.index("--torch")
        if i + 1 >= len(rest):
            print("course.py test --torch needs a version, e.g. --torch 2.9.0")
            return 2
        return test_torch(rest[i + 1], rest[:i] + rest[i + 2:])
    if what == "test" and "--gpu" in rest:   # its own environment: the machine's torch if CUDA
        return test_gpu([a for a in rest if a != "--gpu"])
    setup()
    if what == "lab":
        return lab(rest)
    if what == "book":
        return book(rest)
    if "--colab" in rest:
        i = rest.index("--colab")
        version = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("-") else "2.9.0"
        return test_colab(version, [a for a in rest if a not in ("--colab", version)])
    if "--quick" in rest:   # the tests marked slow (pyproject's markers) left out
        rest = [a for a in rest if a != "--quick"] + ["-m", "not slow"]
    return subprocess.call([str(python()), "-m", "pytest", *rest], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
