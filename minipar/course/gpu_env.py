"""Which Python and which torch ``python3 course.py test --gpu`` runs with (standard library only:
``course.py`` loads this file before any environment exists).

A GPU machine usually comes with its own CUDA build of torch (Colab, Kaggle, a rented box, a
cluster node without internet); downloading another (``.venv``'s pinned ``torch==2.13.0``, GBs)
is slow at best and impossible offline. So, in this order:

1. ``--system``: the interpreter running ``course.py`` itself (nothing made; only the missing
   packages installed into it);
2. ``MINIPAR_TORCH`` set: ``.venv`` with that torch, as ``course.py test`` makes it;
3. the interpreter has a CUDA (or ROCm) build of torch: **its own torch**, through ``.venv-gpu``,
   an environment that sees the interpreter's packages (``system_site_packages``, and a ``.pth``
   that adds the site directories of an interpreter which is itself a virtual environment), into
   which only what is missing is installed (:func:`missing`; minipar itself comes from this
   checkout through ``PYTHONPATH``). With nothing missing no package registry is needed; when an
   install fails (no registry) the run goes on and says what is missing;
4. otherwise ``.venv`` with the pinned torch: ``course.py test``'s behaviour, unchanged.

:func:`probe` asks an interpreter what its torch is (version, CUDA, GPUs and their memory,
cores) in a subprocess, so ``course.py`` never imports torch itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import venv
from dataclasses import dataclass, field
from pathlib import Path

PROBE = r"""
import json, os, site, sys
out = {"python": sys.executable, "cores": os.cpu_count() or 1, "in_venv": sys.prefix != sys.base_prefix,
       "site": [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda or getattr(torch.version, "hip", None))
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out["gpus"] = [[torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory]
                   for i in range(n)]
except Exception as e:  # no torch, or a broken one: say which
    out.update(torch=None, cuda=None, gpus=[], error=f"{type(e).__name__}: {e}"[:200])
print(json.dumps(out))
"""


@dataclass
class Torch:
    """What an interpreter has: its torch (``None``: none), the CUDA/ROCm version it was built
    with (``None``: a CPU build), its GPUs (name, bytes), the machine's cores."""

    python: str
    torch: str | None = None
    cuda: str | None = None
    gpus: list = field(default_factory=list)
    cores: int = 1
    in_venv: bool = False
    site: list = field(default_factory=list)
    error: str = ""

    @property
    def gpu_gib(self) -> float:
        """GPU memory over all its GPUs, GiB."""
        return sum(b for _, b in self.gpus) / 2**30

    def describe(self) -> str:
        if not self.torch:
            return f"no torch in {self.python}" + (f" ({self.error})" if self.error else "")
        build = f"CUDA {self.cuda}" if self.cuda else "a CPU-only build"
        gpus = ", ".join(sorted({f"{n} {b / 2**30:.0f} GiB" for n, b in self.gpus})) or "no GPU visible"
        return f"torch {self.torch} ({build}; {len(self.gpus)} GPU(s): {gpus}) of {self.python}"


def probe(python) -> Torch:
    """:class:`Torch` of the interpreter ``python`` (a path), asked in a subprocess."""
    try:
        p = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=300)
        return Torch(**json.loads(p.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError) as e:
        return Torch(python=str(python), error=f"{type(e).__name__}: {e}"[:200])


@dataclass
class Choice:
    """The environment chosen: ``kind`` (``"system"``, ``"pinned"``, ``"own"``), the directory
    to make (``None``: none) and why, in one sentence."""

    kind: str
    env: Path | None
    why: str


def choose(interpreter: Torch, root: Path, system: bool = False, torch_spec: str | None = None,
           pinned: str = "torch==2.13.0") -> Choice:
    """The rule of this module's docstring, decided from a probe of the interpreter."""
    if system:
        return Choice("system", None, f"--system: {interpreter.python} itself, as it is")
    if torch_spec:
        return Choice("pinned", root / ".venv", f"MINIPAR_TORCH={torch_spec}: .venv with that torch")
    if interpreter.torch and interpreter.cuda:
        return Choice("own", root / ".venv-gpu",
                      f"this machine's own torch ({interpreter.torch}, CUDA {interpreter.cuda}) through "
                      f".venv-gpu, which sees {interpreter.python}'s packages")
    why = "no torch" if not interpreter.torch else f"torch {interpreter.torch}, a CPU-only build"
    return Choice("pinned", root / ".venv", f"{interpreter.python} has {why}: .venv with {pinned}")


def make_own_env(env: Path, interpreter: Torch) -> Path:
    """``env`` seeing ``interpreter``'s packages: ``system_site_packages`` covers a system or
    conda interpreter; one that is itself a virtual environment has its site directories added
    by a ``.pth`` (each through ``site.addsitedir``, so their own ``.pth`` files count). Its
    own site-packages come first: what is installed into it wins; it has no pip of its own
    (the interpreter's installs into it). Returns its python."""
    py = env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if not py.exists():   # no pip of its own: the interpreter's pip installs into it (and no ensurepip needed)
        venv.create(env, with_pip=False, system_site_packages=True)
    if interpreter.in_venv and interpreter.site:
        site = next(iter([*env.glob("lib/python*/site-packages"), *env.glob("Lib/site-packages")]))
        lines = [f"import site; site.addsitedir({d!r})" for d in interpreter.site]
        (site / "_minipar_interpreter.pth").write_text("\n".join(lines) + "\n")
    return py


MISSING = r"""
import json, re, sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None
out = []
for spec in json.loads(sys.argv[1]):
    name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0)
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        out.append(spec)
        continue
    if Requirement is not None and not Requirement(spec).specifier.contains(have, prereleases=True):
        out.append(spec)
print(json.dumps(out))
"""


def missing(python, requirements: list[str]) -> list[str]:
    """The ``requirements`` that ``python`` lacks, or has in a version outside the range."""
    p = subprocess.run([str(python), "-c", MISSING, json.dumps(requirements)], capture_output=True, text=True)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return list(requirements)


def install_missing(python, requirements: list[str], run) -> tuple[list[str], list[str]]:
    """Install what ``python`` lacks with ``run(python, "-m", "pip", ...)``; ``(installed, still
    missing)``: an install that fails (no registry) leaves the run going, with the list."""
    need = missing(python, requirements)
    if not need:
        return [], []
    try:
        run(python, "-m", "pip", "install", "-q", *need)
    except (subprocess.CalledProcessError, OSError):
        return [], need
    return need, missing(python, need)
