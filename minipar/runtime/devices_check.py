"""What ``python3 course.py test --gpu`` would run, checked without a GPU (``--dry-run``).

Two checks on the test files of its jobs:

* **No test assumes the CPU.** A test that asserts ``"cpu"`` or ``"gloo"`` (a device, a
  backend, a placement's sentence) must either pin its ranks there (``device="cpu"``,
  ``--device cpu``) or compute what to expect from the placement (``place(...)``,
  ``gpu_count()``, ``default_device()``, simulated ``gpus=``), or say in a ``# placement-free:``
  comment why it holds anywhere (it fakes the group or the allocator, say); otherwise it would
  fail under ``MINIPAR_DEVICE=cuda`` on a GPU. Read from the source (:func:`cpu_assumptions`).
* **They collect with a GPU.** ``pytest --collect-only`` with ``MINIPAR_DEVICE=cuda`` and
  ``torch.cuda`` reporting ``gpus`` devices (:func:`collect`), so skip conditions and
  module-level code see the GPU machine.

``python -m minipar.runtime.devices_check --gpus 1 FILE...`` prints both and exits 1 on a finding.
"""
from __future__ import annotations

import argparse
import ast
import re
import os
import subprocess
import sys

ASSUMED = re.compile(r"^cpu$|(?<![:\w])gloo\b|Gloo on CPU")  # a device, a backend, a reason
# what makes such an assertion safe: the test pins the CPU, or asks the placement
PINNED = ('device="cpu"', "device='cpu'", '"--device", "cpu"', "place(", "gpu_count(", "gpus=",
          "default_device(", 'setenv("MINIPAR_DEVICE"', 'delenv("MINIPAR_DEVICE"', "placement",
          "process_group_backend(", "init_options(", "gpu_identity(",  # pure functions
          "# placement-free:")
# the driver's own device follows MINIPAR_DEVICE, whatever the ranks were pinned to
DRIVER = ("minipar.device()", "backend.device()")
ASKED = ("gpu_count(", "default_device(", 'setenv("MINIPAR_DEVICE"', 'delenv("MINIPAR_DEVICE"')


def _strings(node) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def cpu_assumptions(path: str) -> list[str]:
    """``"path:line test_name: assertion"`` for each assertion on a CPU device or Gloo in a test
    that neither pins the CPU nor reads the placement (an assertion on the driver's own
    ``minipar.device()`` must read ``MINIPAR_DEVICE`` or the GPU count: pinning the ranks
    does not move the driver)."""
    source = open(path).read()
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")):
            continue
        body = ast.get_source_segment(source, fn) or ""
        pinned, asked = any(p in body for p in PINNED), any(p in body for p in ASKED)
        for a in (n for n in ast.walk(fn) if isinstance(n, ast.Assert)):
            text = ast.get_source_segment(source, a.test) or ""
            hits = {s for s in _strings(a.test) if ASSUMED.search(s)}
            if hits and not (asked if any(d in text for d in DRIVER) else pinned):
                found.append(f"{path}:{a.lineno} {fn.name}: {text}")
    return found


FAKE_GPUS = """
import sys, torch
n = int(sys.argv[1])
torch.cuda.is_available = lambda: n > 0
torch.cuda.device_count = lambda: n
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


def collect(files: list[str], gpus: int) -> tuple[int, str]:
    """``(exit code, pytest's summary line)`` of collecting ``files`` as on a machine with
    ``gpus`` GPUs and ``MINIPAR_DEVICE=cuda``."""
    env = dict(os.environ, MINIPAR_DEVICE="cuda")
    out = subprocess.run([sys.executable, "-c", FAKE_GPUS, str(gpus), *files], capture_output=True,
                         text=True, env=env)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return out.returncode, (lines[-1] if lines else out.stderr.strip()[-500:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minipar.runtime.devices_check", description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=1, help="GPUs torch.cuda reports while collecting")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    found = [f for path in args.files if path.endswith(".py") for f in cpu_assumptions(path)]
    code, summary = collect(args.files, args.gpus)
    print(f"collected with MINIPAR_DEVICE=cuda and {args.gpus} GPU(s) reported: {summary}")
    if found:
        print("tests that assume the CPU (pin device='cpu' or read the placement):")
        print("\n".join(f"  {f}" for f in found))
    else:
        print("no test assumes the CPU")
    return 1 if found or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
