"""``course.py test --gpu`` on the machine's own torch (``minipar/course/gpu_env.py``), proven on
the CPU: interpreters are simulated (a probe's answer), installs are recorded, and one real
environment is made in a temporary folder from this interpreter, no CUDA build downloaded."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def course(monkeypatch):
    for name in ("MINIPAR_GPU_JOBS", "MINIPAR_TORCH"):
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("course", ROOT / "course.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torch(course, version="2.11.0+cu130", cuda="13.0", gpus=1, python="/usr/bin/python3", **kw):
    return course.genv.Torch(python=python, torch=version, cuda=cuda, cores=16,
                             gpus=[["NVIDIA H200", 139 * 2**30]] * gpus, **kw)


def test_the_machines_own_cuda_torch_is_chosen_and_the_cpu_default_is_unchanged(course, tmp_path):
    """A CUDA torch in the interpreter: its own torch, through .venv-gpu. A CPU build or no torch:
    .venv with the pinned torch (``course.py test``'s behaviour). MINIPAR_TORCH, then --system, win."""
    choose = course.genv.choose
    own = choose(_torch(course), tmp_path)
    assert own.kind == "own" and own.env == tmp_path / ".venv-gpu" and "2.11.0+cu130" in own.why
    rocm = choose(_torch(course, version="2.9.0+rocm6.4", cuda="6.4"), tmp_path)
    assert rocm.kind == "own"
    cpu = choose(_torch(course, version="2.13.0+cpu", cuda=None, gpus=0), tmp_path, pinned="torch==2.13.0")
    assert cpu.kind == "pinned" and cpu.env == tmp_path / ".venv" and "CPU-only build" in cpu.why
    none = choose(course.genv.Torch(python="/usr/bin/python3"), tmp_path, pinned="torch==2.13.0")
    assert none.kind == "pinned" and "no torch" in none.why and "torch==2.13.0" in none.why
    assert choose(_torch(course), tmp_path, torch_spec="torch==2.10.0").kind == "pinned"
    assert choose(_torch(course), tmp_path, system=True).kind == "system"
    assert course.TORCH == "torch==2.13.0"


def _play(course, monkeypatch, interpreter, lacking, registry=True):
    """course.gpu_python with the interpreter simulated; returns the commands run."""
    ran, made = [], []
    monkeypatch.setattr(course.genv, "probe", lambda py: interpreter if str(py) == course.sys.executable
                        else _torch(course, python=str(py)))
    monkeypatch.setattr(course.genv, "make_own_env", lambda env, i: made.append(env) or env / "bin" / "python")
    monkeypatch.setattr(course.genv, "missing", lambda py, reqs: [r for r in reqs if r in lacking])
    monkeypatch.setattr(course, "setup", lambda: ran.append("setup"))

    def run(*cmd, **kw):
        ran.append([str(c) for c in cmd])
        if not registry:
            raise subprocess.CalledProcessError(1, cmd)
        lacking.clear()
    monkeypatch.setattr(course, "run", run)
    return ran, made


def test_own_torch_installs_only_what_is_missing_and_says_which_torch(course, monkeypatch, capsys):
    """With a CUDA torch in the interpreter: .venv-gpu is made, no torch installed, only the
    missing package; the torch used is named, and why."""
    need = [d for d in course._runtime_deps(build=False) if d.startswith("nbclient")]
    ran, made = _play(course, monkeypatch, _torch(course), list(need))
    py, used = course.gpu_python([])
    assert made == [course.ROOT / ".venv-gpu"] and py == course.ROOT / ".venv-gpu" / "bin" / "python"
    assert ran == [[str(py), "-m", "pip", "install", "-q", *need]]
    assert not any("torch" in a for cmd in ran for a in cmd)
    out = capsys.readouterr().out
    assert "torch: torch 2.11.0+cu130 (CUDA 13.0; 1 GPU(s): NVIDIA H200 139 GiB)" in out
    assert "this machine's own torch (2.11.0+cu130, CUDA 13.0) through .venv-gpu" in out
    assert f"installed: {need[0]}" in out and used.torch == "2.11.0+cu130"


def test_without_a_registry_it_still_runs_and_says_what_is_missing(course, monkeypatch, capsys):
    """Nothing missing: no install at all (offline is fine). An install that fails (no registry):
    the run goes on, naming what is missing."""
    ran, _ = _play(course, monkeypatch, _torch(course), [])
    course.gpu_python([])
    assert ran == []
    ran, _ = _play(course, monkeypatch, _torch(course), ["nbclient>=0.9"], registry=False)
    py, used = course.gpu_python([])
    assert used.torch == "2.11.0+cu130"
    assert "still missing (no package registry?): nbclient>=0.9" in capsys.readouterr().out


def test_an_environment_that_cannot_be_made_falls_back_to_the_interpreter(course, monkeypatch, capsys):
    """No venv module or a read-only checkout: the interpreter itself, said so."""
    _play(course, monkeypatch, _torch(course), [])

    def fail(env, interpreter):
        raise OSError("read-only file system")
    monkeypatch.setattr(course.genv, "make_own_env", fail)
    py, used = course.gpu_python([])
    assert str(py) == course.sys.executable
    assert ".venv-gpu could not be made (OSError: read-only file system)" in capsys.readouterr().out


def test_system_uses_the_interpreter_itself_and_a_cpu_torch_keeps_the_pinned_venv(course, monkeypatch, capsys):
    """--system: no environment made, the missing packages go into the interpreter. A CPU torch:
    ``setup()`` (.venv, torch==2.13.0), as ``course.py test``."""
    ran, made = _play(course, monkeypatch, _torch(course), [])
    py, _ = course.gpu_python(["--system"])
    assert str(py) == course.sys.executable and made == []
    ran, made = _play(course, monkeypatch, _torch(course, version="2.13.0+cpu", cuda=None, gpus=0), [])
    py, used = course.gpu_python([])
    assert ran == ["setup"] and made == [] and py == course.python()
    assert "has torch 2.13.0+cpu, a CPU-only build: .venv with torch==2.13.0" in capsys.readouterr().out


def test_the_dry_run_names_the_torch_and_the_width_on_a_simulated_machine(course, monkeypatch, capsys):
    """``test --gpu --dry-run`` on a simulated H200 with its own torch: which torch, why, and the
    width 4 with the rule's numbers; the file check runs with the chosen environment's python."""
    calls = []
    _play(course, monkeypatch, _torch(course), [])
    monkeypatch.setattr(course.gpu, "read_times", lambda root: {})
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    assert course.test_gpu(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "torch: torch 2.11.0+cu130 (CUDA 13.0; 1 GPU(s): NVIDIA H200 139 GiB)" in out
    assert "width: 4 = min(16 cores // 4 per job = 4, 139 GiB of GPU memory // 4 GiB per job = 34, 27 jobs)" in out
    assert calls[0][0] == str(course.ROOT / ".venv-gpu" / "bin" / "python")


def test_no_gpu_says_so(course, monkeypatch, capsys):
    _play(course, monkeypatch, _torch(course, version="2.13.0+cpu", cuda=None, gpus=0), [])
    monkeypatch.setattr(course.genv, "probe", lambda py: _torch(course, version="2.13.0+cpu", cuda=None, gpus=0))
    assert course.test_gpu([]) == 2
    assert "no CUDA GPU visible" in capsys.readouterr().out


def test_a_real_environment_sees_the_interpreters_torch_and_needs_nothing(course, tmp_path):
    """Made for real from this interpreter (itself a virtual environment, so the ``.pth`` path):
    the new environment imports this interpreter's torch, finds every requirement present (no
    registry needed) and reports a missing one."""
    genv = course.genv
    here = genv.probe(sys.executable)
    assert here.torch and here.in_venv and here.site
    py = genv.make_own_env(tmp_path / ".venv-gpu", here)
    seen = genv.probe(py)
    assert seen.torch == here.torch and seen.python == str(py)
    assert genv.missing(py, course._runtime_deps(build=False)) == []
    assert "setuptools>=77" in course._runtime_deps() and "setuptools>=77" not in course._runtime_deps(build=False)
    # an install goes into the new environment (the interpreter's pip, offline from a folder), not
    # into the interpreter
    pkg = tmp_path / "pkg"
    (pkg / "minipar_tiny_probe").mkdir(parents=True)
    (pkg / "minipar_tiny_probe" / "__init__.py").write_text("")
    (pkg / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = '
                                        '"setuptools.build_meta"\n[project]\nname = "minipar-tiny-probe"\n'
                                        'version = "0.1"\n')
    course.run(py, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", str(pkg))
    where = subprocess.run([str(py), "-c", "import minipar_tiny_probe as m; print(m.__file__)"],
                           capture_output=True, text=True).stdout
    assert where.startswith(str(tmp_path / ".venv-gpu"))
    assert genv.missing(sys.executable, ["minipar-tiny-probe"]) == ["minipar-tiny-probe"]
    assert genv.missing(py, ["minipar-surely-absent>=1", "numpy>=1.0"]) == ["minipar-surely-absent>=1"]
