#!/usr/bin/env python3
"""Set up the course and open it, or run its tests: the README's two commands.

    python3 course.py lab     # make .venv, install, open the notebooks in JupyterLab
    python3 course.py test    # make .venv, install, run the test suite

Needs only Python >= 3.10. Everything goes into ./.venv; the install is redone only when
pyproject.toml changes. PyTorch is pinned to the version the course is tested with
(override with MINIPAR_TORCH, e.g. MINIPAR_TORCH="torch==2.13.0" or a CUDA build's spec).
"""
import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH = os.environ.get("MINIPAR_TORCH", "torch==2.13.0")


def python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(*cmd) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


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


def main(argv) -> int:
    what = argv[1] if len(argv) > 1 else "help"
    if what not in ("lab", "test"):
        print(__doc__)
        return 0 if what in ("help", "-h", "--help") else 2
    setup()
    if what == "lab":
        return subprocess.call([str(python()), "-m", "jupyter", "lab", "notebooks/"], cwd=ROOT)
    return subprocess.call([str(python()), "-m", "pytest", *argv[2:]], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
