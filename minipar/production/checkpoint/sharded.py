"""Save and load sharded checkpoints: every rank writes what it holds, any layout reads it.

``save(root, model, optimizer, step=...)`` (every rank calls it) writes::

    root/latest                      "step_00000100"  (replaced atomically: the commit)
    root/step_00000100/meta.json     step, mesh, world size, files, every tensor's full shape
    root/step_00000100/rank_00003.pt this rank's pieces (see :mod:`minipar.pieces`), its mesh
                                     coordinates and its RNG state

on a file system every rank sees (on a cluster: NFS, Lustre, GPFS; an absolute path): each
rank writes its own file and rank 0 commits. A piece is named by the single-device parameter
name and says which part of the full tensor it is, so replicated copies are written once
(by the lowest rank holding an identical piece) and loading needs nothing of the saving layout.

``load(root, model, optimizer)`` needs no communication: every rank reads the pieces that
overlap the tensors it holds now, reassembles those full tensors and copies its own parts
into its parameters and optimizer state (creating the state a fresh optimizer lacks): a
checkpoint saved at dp=2, tp=2 loads at pp=2, dp=2, or on one process. A file is read
(``torch.load(weights_only=True)``: no pickled code runs) only once its size and SHA-256
match those recorded at save time; else :class:`~.integrity.CheckpointError` names it.
"""
from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from .atomic import commit, prepare, resolve, temporary_dir, write_file
from .integrity import FORMAT, CheckpointError, check_file, digest, locate, open_meta
from ...pieces import PARAM, Piece, assemble, extract, local_pieces


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _mesh_dict(mesh, model) -> dict | None:
    mesh = mesh if mesh is not None else getattr(model, "mesh", None)
    if mesh is None or isinstance(mesh, dict):
        return mesh
    out = {"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp}
    out.update({k: getattr(mesh, k) for k in ("cp", "ep") if getattr(mesh, k, 1) > 1})  # 4D, 5D layouts
    return out


def _unique(pieces: list[Piece], rank: int, world: int) -> tuple[list[Piece], list[list]]:
    """This rank's pieces that no lower rank holds identically (replicas are written once),
    and every rank's descriptors."""
    descs = [p.descriptor() for p in pieces]
    everyone = [descs] * world
    if world > 1:
        dist.all_gather_object(everyone, descs)
    seen = {d for other in everyone[:rank] for d in other}
    mine = []
    for p, d in zip(pieces, descs):
        if d not in seen:
            seen.add(d)
            mine.append(p)
    return mine, everyone


def _optimizer_info(optimizer) -> dict | None:
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optim", optimizer)
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()   # JSON's plain values
               if k != "params" and isinstance(v, (int, float, str, bool, tuple, list, type(None)))}
              for g in inner.param_groups]
    return {"class": type(optimizer).__name__, "inner": type(inner).__name__, "param_groups": groups}


def save(root, model, optimizer=None, step: int = 0, extra: dict | None = None, mesh=None,
         keep: int | None = None) -> Path:
    """Every rank: write this rank's shard of ``model`` (and ``optimizer``) as checkpoint
    ``step`` under ``root``, atomically. ``extra``: JSON data to keep (data position,
    configuration). ``mesh``: the layout to record (default ``model.mesh`` if any).
    ``keep``: how many checkpoints to keep (default all). Returns the directory."""
    root = Path(root)
    rank, world = _rank_world()
    mine, everyone = _unique(local_pieces(model, optimizer), rank, world)
    if rank == 0:
        prepare(root, step)
    _barrier(world)  # the temporary directory exists and is empty
    record = {"format": FORMAT, "rank": rank, "coords": getattr(model, "coords", None),
              "rng": torch.get_rng_state(),
              "pieces": [{**p.to_record(), "data": p.data.detach().cpu().clone()} for p in mine]}
    name = f"rank_{rank:05d}.pt"
    buf = io.BytesIO()
    torch.save(record, buf)
    data = buf.getvalue()
    write_file(temporary_dir(root, step) / name, lambda f: f.write(data))
    written = [(name, len(data), digest(data))] * world
    if world > 1:  # also the barrier: every rank's file is on disk
        dist.all_gather_object(written, written[rank])
    if rank == 0:
        files = [f"rank_{r:05d}.pt" for r in range(world)]
        missing = [f for f in files if not (temporary_dir(root, step) / f).exists()]
        if missing:
            raise FileNotFoundError(f"rank 0 cannot see {missing} in {temporary_dir(root, step)}: "
                                    "the checkpoint directory must be one shared file system "
                                    "that every node writes to")
        tensors = defaultdict(dict)
        for n, key, full, *_ in (d for descs in everyone for d in descs):
            tensors[n][key] = list(full)
        meta = {"format": FORMAT, "step": step, "world_size": world,
                "mesh": _mesh_dict(mesh, model), "files": files,
                "sizes": {n: size for n, size, _ in written}, "checksums": {n: d for n, _, d in written},
                "tensors": tensors, "optimizer": _optimizer_info(optimizer), "extra": extra or {}}
        commit(root, step, meta, keep)
    _barrier(world)  # nobody goes on (or exits) before the checkpoint is committed
    return resolve(root)


def read_pieces(directory) -> tuple[dict, dict[tuple[str, str], list[Piece]], list[dict]]:
    """``(meta, {(name, key): saved pieces}, per-file records)`` of a checkpoint directory
    (memory-mapped: only the pieces used are read from disk)."""
    directory, expected = locate(directory)
    meta = open_meta(directory, expected)
    records = [_load_record(check_file(directory, f, meta)) for f in meta["files"]]
    saved = defaultdict(list)
    for p in (Piece.from_record(r) for rec in records for r in rec["pieces"]):
        saved[(p.name, p.key)].append(p)
    return meta, saved, records


def _load_record(path: Path) -> dict:
    try:
        rec = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - a checked file that still does not load
        raise CheckpointError(path, f"not a minipar rank file ({type(e).__name__}: {e})") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or "pieces" not in rec:
        raise CheckpointError(path, f"not a {FORMAT} rank file")
    return rec


def load(root, model, optimizer=None, restore_rng: bool = True) -> dict:
    """Fill ``model``'s parameters (and ``optimizer``'s state) on this rank from the
    checkpoint at ``root`` (a checkpoint directory, or a root with ``latest``), whatever
    layout saved it. Call on every rank; no communication. Returns the meta dict (``step``,
    ``extra``, ``mesh``...). ``restore_rng``: restore this rank's torch RNG state when the
    world size and mesh are those that saved it (another layout has other ranks)."""
    meta, saved, records = read_pieces(root)
    where = locate(root)[0] / "meta.json"
    if optimizer is not None and meta["optimizer"] is not None:
        have, mine = meta["optimizer"]["inner"], _optimizer_info(optimizer)["inner"]
        if have != mine:
            raise CheckpointError(where, f"another optimizer: the checkpoint holds {have} state; "
                                         f"this optimizer is a {mine}")
    keys = defaultdict(dict)
    for (name, key), ps in saved.items():
        keys[name][key] = (len(ps[0].full_shape) == 0, ps[0].data.dtype)
    targets = defaultdict(list)
    for p in local_pieces(model, optimizer, keys if optimizer is not None else None):
        targets[(p.name, p.key)].append(p)
    for (name, key), want in targets.items():
        have = saved.get((name, key))
        if not have:
            what = "parameter" if key == PARAM else f"optimizer state {key!r} of"
            raise KeyError(f"{where}: the checkpoint has no {what} {name}; it was saved from another "
                           f"model (it has {len({n for n, _ in saved})} tensors)")
        if tuple(have[0].full_shape) != tuple(want[0].full_shape):
            raise CheckpointError(where, f"another model configuration: {name}: the checkpoint holds "
                                         f"shape {tuple(have[0].full_shape)}, this model "
                                         f"{tuple(want[0].full_shape)}")
        full, seen = assemble(have, want[0].full_shape, want[0].data.dtype)
        for p in want:
            if not bool(extract(seen, p).all()):
                raise CheckpointError(where, f"the checkpoint is missing part of {name} ({key}): "
                                             "a rank's file is incomplete")
            with torch.no_grad():
                p.data.copy_(extract(full, p))
    rank, world = _rank_world()
    if restore_rng and world == meta["world_size"] and meta["mesh"] == _mesh_dict(None, model):
        torch.set_rng_state(records[rank]["rng"])
    return meta


def load_full_state_dict(root, key: str = PARAM) -> dict[str, torch.Tensor]:
    """The single-device tensors of a checkpoint by parameter name (``key="exp_avg"``
    etc. for optimizer state), on one process, whatever layout saved it."""
    _, saved, _ = read_pieces(root)
    out = {}
    for (name, k), ps in saved.items():
        if k == key:
            full, seen = assemble(ps, ps[0].full_shape)
            if not bool(seen.all()):
                raise ValueError(f"the checkpoint covers only part of {name}")
            out[name] = full
    return out
