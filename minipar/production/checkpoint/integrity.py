"""Checksums that make a damaged checkpoint an error, never a silent load.

A checkpoint is trusted along a chain, each link holding the checksum (SHA-256) of the next:

* ``latest`` holds the name of the checkpoint directory *and* the digest of its
  ``meta.json``: a pointer flipped to another existing checkpoint does not match;
* ``meta.json`` holds the size and digest of every rank file, and a ``seal``, the digest of
  its own content (so a checkpoint directory opened directly is checked too);
* every rank file is checked against ``meta.json`` (size, then digest) before ``torch.load``
  reads a byte of it.

Every failure raises :class:`CheckpointError` naming the file and its fault (truncated,
changed, missing, not a minipar checkpoint, pointing nowhere), never wrong weights.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

FORMAT = "minipar-checkpoint/2"
LATEST = "latest"
META = "meta.json"
_NAME = re.compile(r"step_\d{8}(\.\d+)?")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; ``.path`` is the file at fault."""

    def __init__(self, path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for, or a file of one is missing."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _canonical(meta: dict) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != "seal"}, sort_keys=True,
                      separators=(",", ":")).encode()


def seal(meta: dict) -> bytes:
    """``meta`` as the bytes of ``meta.json``, with its ``seal`` (digest of its content)."""
    return json.dumps({**meta, "seal": digest(_canonical(meta))}, indent=1).encode()


def pointer(name: str, meta_bytes: bytes) -> bytes:
    """The content of ``latest``: the directory name and the digest of its ``meta.json``."""
    return f"{name} {digest(meta_bytes)}\n".encode()


def read_pointer(root: Path) -> tuple[Path, str]:
    """The directory ``root/latest`` names and the ``meta.json`` digest it expects."""
    path = root / LATEST
    tokens = path.read_bytes().decode("ascii", errors="replace").split()   # non-ASCII fails the check below
    if len(tokens) != 2 or not _NAME.fullmatch(tokens[0]) or not re.fullmatch(r"[0-9a-f]{64}", tokens[1]):
        raise CheckpointError(path, "corrupt: it should hold a checkpoint name (step_NNNNNNNN) "
                                    "and the SHA-256 of that checkpoint's meta.json")
    target = root / tokens[0]
    if not (target / META).is_file():
        raise CheckpointNotFound(path, f"points nowhere: it names {tokens[0]}, and "
                                       f"{target / META} does not exist")
    return target, tokens[1]


def open_meta(directory: Path, expected: str | None = None) -> dict:
    """The checked ``meta.json`` of a checkpoint directory (``expected``: its digest, from ``latest``)."""
    path = directory / META
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFound(path, "missing: the checkpoint directory is incomplete") from None
    if expected is not None and digest(raw) != expected:
        raise CheckpointError(path, f"changed or corrupt: its SHA-256 is not the one "
                                    f"{directory.parent / LATEST} recorded")
    try:
        meta = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"not a minipar checkpoint (not JSON: {e})") from None
    if not isinstance(meta, dict) or "format" not in meta:
        raise CheckpointError(path, "not a minipar checkpoint (no format field)")
    if meta["format"] != FORMAT:
        raise CheckpointError(path, f"not a {FORMAT} checkpoint (format {meta['format']!r})")
    if meta.get("seal") != digest(_canonical(meta)):
        raise CheckpointError(path, "corrupt: its content does not match its seal (checksum)")
    return meta


def check_file(directory: Path, name: str, meta: dict) -> Path:
    """Rank file ``name`` of the checkpoint, after checking its size and digest."""
    path = directory / name
    want_size, want = meta["sizes"][name], meta["checksums"][name]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointNotFound(path, f"missing: the checkpoint lists it ({want_size} bytes) "
                                       "but it is not there") from None
    if size != want_size:
        what = "truncated" if size < want_size else "longer than written"
        raise CheckpointError(path, f"{what}: {size} bytes, the checkpoint recorded {want_size}")
    if file_digest(path) != want:
        raise CheckpointError(path, "corrupt: its SHA-256 does not match the one in meta.json "
                                    "(changed on disk since it was written)")
    return path


def locate(path) -> tuple[Path, str | None]:
    """The checkpoint directory for ``path`` (itself, or what ``path/latest`` names) and the
    digest its ``meta.json`` must have (``None`` when opened directly)."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(path, "not a minipar checkpoint (a file; give the checkpoint "
                                    "directory or the root holding `latest`)")
    if (path / META).exists():
        return path, None
    if (path / LATEST).exists():
        return read_pointer(path)
    raise CheckpointNotFound(path, f"no checkpoint here: neither {path / META} nor {path / LATEST} exists")


def verify(path) -> dict:
    """Check a whole checkpoint (pointer, ``meta.json``, every rank file) without loading
    it; returns its meta dict. Raises :class:`CheckpointError` naming the first bad file."""
    directory, expected = locate(path)
    meta = open_meta(directory, expected)
    for name in meta["files"]:
        check_file(directory, name, meta)
    return meta
