"""course.py: the lab as root, the GPU run without a GPU, another torch's environment."""
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def course():
    spec = importlib.util.spec_from_file_location("course", ROOT / "course.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("root", [True, False])
def test_lab_prints_its_url_and_runs_as_root(course, monkeypatch, capsys, root):
    calls = []
    monkeypatch.setattr(course.os, "geteuid", lambda: 0 if root else 1000, raising=False)
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    assert course.lab(["--ip=0.0.0.0"]) == 0
    cmd, out = calls[0], capsys.readouterr().out
    token = next(a.split("=", 1)[1] for a in cmd if a.startswith("--IdentityProvider.token="))
    port = next(a.split("=", 1)[1] for a in cmd if a.startswith("--port="))
    assert f"http://localhost:{port}/lab/tree/00_welcome.ipynb?token={token}" in out   # opens notebook 00
    assert "--LabApp.default_url=/lab/tree/00_welcome.ipynb" in cmd
    assert ("--allow-root" in cmd) == root and cmd[-1] == "--ip=0.0.0.0"


def test_gpu_run_without_a_gpu_says_so(course, monkeypatch, capsys):
    cpu = course.genv.Torch(python="python", torch="2.13.0+cpu")
    monkeypatch.setattr(course, "gpu_python", lambda args: ("python", cpu))
    assert course.test_gpu([]) == 2
    assert "no CUDA GPU visible" in capsys.readouterr().out


def test_another_torch_gets_the_other_dependencies_and_this_checkout(course, monkeypatch, tmp_path):
    deps = course._runtime_deps()
    assert deps and not any(d.startswith("torch") for d in deps) and any(d.startswith("cloudpickle") for d in deps)
    monkeypatch.setattr(course, "ENVS", tmp_path)
    installs, runs = [], []
    monkeypatch.setattr(course.venv, "create", lambda env, **kw: Path(env).mkdir(parents=True))
    monkeypatch.setattr(course, "run", lambda *cmd, **kw: installs.append([str(c) for c in cmd]))
    monkeypatch.setattr(course.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "2.9.0", ""))
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: runs.append((cmd, kw["env"])) or 0)
    assert course.test_torch("2.9.0", ["-k", "launch"]) == 0
    assert "torch==2.9.0" in installs[0] and str(tmp_path / "torch-2.9.0") in installs[0][0]
    cmd, env = runs[0]
    assert cmd[1:3] == ["-m", "pytest"] and cmd[-2:] == ["-k", "launch"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert course.test_torch("2.9.0", []) == 0 and len(installs) == 1  # made once, reused


def test_quick_runs_the_suite_without_the_slow_tier(course, monkeypatch):
    """``course.py test --quick -x``: pytest with ``-x -m "not slow"``; without ``--quick``
    everything (CI's run), the arguments as given."""
    calls = []
    monkeypatch.setattr(course, "setup", lambda: None)
    monkeypatch.setattr(course.subprocess, "call", lambda cmd, **kw: calls.append(cmd[3:]) or 0)
    assert course.main(["course.py", "test", "--quick", "-x"]) == 0
    assert course.main(["course.py", "test", "-q"]) == 0
    assert calls == [["-x", "-m", "not slow"], ["-q"]]
