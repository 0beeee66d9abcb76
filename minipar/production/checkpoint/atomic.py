"""Atomic commits of a checkpoint directory: a crash never leaves a half-new checkpoint.

A checkpoint, a directory of files written by many ranks, must appear all at once or not
at all. The protocol (the same idea as a database's commit record):

1. every rank writes its file into ``ROOT/.tmp-step_N`` and ``fsync``s it;
2. a barrier: every file is on disk;
3. rank 0 writes ``meta.json`` (the files with their sizes and checksums), ``fsync``s,
   renames the directory to ``ROOT/step_N``, then replaces the pointer file ``ROOT/latest``
   (the name and the checksum of its ``meta.json``, see :mod:`.integrity`) with
   ``os.replace``, atomic on POSIX and Windows: a reader sees the old pointer or the new.

A crash before the pointer is replaced leaves ``latest`` naming the previous, untouched
checkpoint; the next save removes the half-written temporary directory. Fsyncing files and
directories makes the order survive a power cut, not only a crashed process.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .integrity import LATEST, META, locate, open_meta, pointer, seal


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk (a no-op where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file(path: Path, write) -> None:
    """``write(f)`` into ``path`` opened for binary writing, then flush and fsync."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def temporary_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step_{step:08d}"


def prepare(root: Path, step: int) -> Path:
    """Rank 0, before anyone writes: an empty temporary directory for step ``step``
    (leftovers of a crashed save, at any step, are removed)."""
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(".tmp-step_*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = temporary_dir(root, step)
    tmp.mkdir()
    return tmp


def commit(root: Path, step: int, meta: dict, keep: int | None = None) -> Path:
    """Rank 0, after every rank's file is on disk: write ``meta.json``, rename the
    directory into place, replace ``latest``; then drop all but the ``keep`` newest."""
    tmp, meta_bytes = temporary_dir(root, step), seal(meta)
    write_file(tmp / META, lambda f: f.write(meta_bytes))
    fsync_dir(tmp)
    final, n = root / f"step_{step:08d}", 1
    while final.exists():  # saving the same step again: never touch the committed one
        final, n = root / f"step_{step:08d}.{n}", n + 1
    os.rename(tmp, final)
    fsync_dir(root)
    tmp_pointer = root / f".{LATEST}.tmp"
    write_file(tmp_pointer, lambda f: f.write(pointer(final.name, meta_bytes)))
    os.replace(tmp_pointer, root / LATEST)  # the commit point
    fsync_dir(root)
    if keep is not None:
        prune(root, keep)
    return final


def committed(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first (by step, then by age)."""
    found = [p for p in root.glob("step_*") if (p / META).exists()]
    return sorted(found, key=lambda p: (p.name.split(".")[0], p.stat().st_mtime_ns))


def prune(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest checkpoints; never the one ``latest`` names."""
    current = resolve(root)
    old = [p for p in committed(root) if p != current]
    for p in old[:max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def resolve(path) -> Path:
    """The checkpoint directory to load: ``path`` itself if it is one, else the one that
    ``path/latest`` names. Raises :class:`~.integrity.CheckpointError` (a
    ``FileNotFoundError`` when there is none) naming what was looked for."""
    return locate(path)[0]


def read_meta(directory: Path) -> dict:
    """The checked ``meta.json`` of a checkpoint directory."""
    return open_meta(Path(directory))
