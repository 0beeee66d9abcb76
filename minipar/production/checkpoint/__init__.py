"""Sharded, atomic, layout-independent checkpoints.

* :mod:`minipar.pieces` — a rank's tensor as *pieces* of the full tensor (boxes and flat ranges),
  and the pieces a rank holds: parameters and optimizer state (torch, ZeRO), re-exported here;
* :mod:`.atomic` — write to a temporary directory, fsync, rename, replace ``latest``;
* :mod:`.integrity` — a checksum per file, checked on load (:func:`verify`):
  :class:`CheckpointError` names a damaged, missing or foreign file instead of loading it;
* :mod:`.sharded` — :func:`save` (every rank writes its pieces), :func:`load` (every rank
  reads the pieces it needs, whatever layout saved them).

Usage, on every rank::

    minipar.production.checkpoint.save("ckpt", model, optimizer, step=step, extra={"step": step})
    meta = minipar.production.checkpoint.load("ckpt", model, optimizer)   # meta["step"], meta["extra"]
"""
from .atomic import committed, resolve
from .integrity import CheckpointError, CheckpointNotFound, verify
from ...pieces import (Piece, assemble, extract, local_pieces, parameter_layout, pieces_of, tensor_parallel_boxes,
                       tensor_parallel_layout, whole)
from .sharded import FORMAT, load, load_full_state_dict, read_pieces, save

__all__ = ["save", "load", "verify", "CheckpointError", "CheckpointNotFound", "load_full_state_dict",
           "read_pieces", "resolve", "committed", "FORMAT", "Piece", "pieces_of", "assemble", "extract",
           "whole", "tensor_parallel_boxes", "local_pieces", "parameter_layout", "tensor_parallel_layout"]
