"""Execute a notebook headless as a learner would, and keep the executed copy.

The notebook tests and ``python -m minipar.course.book`` share this: each run leaves its executed
copy in ``build/executed/`` with what the book needs to know about it (the hash of the
source it came from, the seconds it took, the torch it ran on), so the book is built from
the very executions the tests did, and a notebook is re-executed only when it changed.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EXECUTED = ROOT / "build" / "executed"


def source_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def execute(path: Path, out_dir: Path = EXECUTED, timeout: int = 600):
    """Run ``path`` top to bottom in a fresh kernel from its own folder; write the executed copy
    to ``out_dir``; return ``(notebook, seconds)``. A cell that raises raises here."""
    import nbformat
    import torch
    from nbclient import NotebookClient
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("MINIPAR_STATIC_WIDGETS", "1")  # see minipar.runtime.viz.explore
    t = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - t
    nb.metadata["minipar"] = {"source_sha256": source_hash(path), "seconds": round(seconds, 1),
                              "torch": torch.__version__}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, Path(out_dir) / path.name)
    return nb, seconds


def fresh(path: Path, out_dir: Path = EXECUTED) -> bool:
    """Whether ``out_dir`` holds an executed copy of ``path`` as it is now."""
    import nbformat
    copy = Path(out_dir) / Path(path).name
    if not copy.exists():
        return False
    meta = nbformat.read(copy, as_version=4).metadata.get("minipar", {})
    return meta.get("source_sha256") == source_hash(path)
