"""What one rank holds, as pieces of the single-device model: shared by checkpoints
(:mod:`minipar.production.checkpoint`) and the live reshard of parallelism that adapts
(:mod:`minipar.adapt`), so that neither folder imports the other for it.

* :mod:`.boxes` — a rank's tensor as *pieces* of the full tensor (boxes and flat ranges);
  :func:`assemble` and :func:`extract` between pieces and whole tensors;
* :mod:`.held` — the pieces a rank holds: parameters and optimizer state (torch, ZeRO 1-3, the mesh).
"""
from .boxes import Piece, assemble, extract, pieces_of, tensor_parallel_boxes, whole
from .held import PARAM, local_pieces, parameter_layout, tensor_parallel_layout

__all__ = ["Piece", "assemble", "extract", "pieces_of", "tensor_parallel_boxes", "whole", "PARAM",
           "local_pieces", "parameter_layout", "tensor_parallel_layout"]
