"""Column- and row-parallel linear layers (Shoeybi et al. 2019, Section 3, Equations 2-3).

A linear layer computes ``Y = X A`` (PyTorch stores ``Aᵀ`` as ``weight``, shape (out, in)).
With t ranks, A can be split two ways:

* **by columns** ``A = [A_1, ..., A_t]`` (output features): ``Y = [X A_1, ..., X A_t]``.
* **by rows** ``A = [A_1; ...; A_t]`` (input features): ``Y = X_1 A_1 + ... + X_t A_t``.

Column then row is the transformer MLP with one all-reduce in forward and one in backward
(notebook 05, "Column then row: one all-reduce per MLP"). The layers call the functional forms
:func:`column_parallel_linear` and :func:`row_parallel_linear` (exercise 05 asks you to write them).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ops import divide, f, g, gather, size_and_rank, split
from .sequence import gather_linear, linear_reduce_scatter


# Contract:
# Given: ``weight`` is this rank's rows of the single-device weight, (out/t, in), ``bias`` its
#     rows of the bias, (out/t,) or None; ``x`` is the full input on every rank.
# ex05.B.column: returns this rank's output features (all of them, in order, with
#     ``gather_output=True``), and the gradient reaching ``x`` is the whole input gradient.
def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           gather_output: bool = False, group=None) -> torch.Tensor:
    """The column-parallel layer: this rank holds ``weight`` (out/t, in) and ``bias`` (out/t,),
    its output features of a single-device layer, and ``x`` is the same on every rank. Returns
    this rank's out/t output features of that layer (different on every rank), or all ``out`` of
    them, equal on every rank, with ``gather_output=True``. ``x``'s gradient is the single-device
    layer's, equal on every rank."""
    # >>> ex05 B
    y = F.linear(f(x, group), weight, bias)
    return gather(y, -1, group) if gather_output else y
    # <<< ex05 B


# Contract:
# Given: ``x`` holds this rank's input features (what a column-parallel layer returns), ``weight``
#     this rank's columns of the single-device weight, (out, in/t), ``bias`` the full bias.
# ex05.B.row: returns the full output on every rank, the bias added once.
# ex05.B.once: a column layer followed by a row layer communicates once in forward and once in
#     backward.
def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        group=None) -> torch.Tensor:
    """The row-parallel layer: this rank holds ``x`` (..., in/t), its input features, and
    ``weight`` (out, in/t), its input features of a single-device layer whose whole bias (out,)
    every rank holds. Returns that layer's full output, equal on every rank."""
    # >>> ex05 B
    y = g(F.linear(x, weight), group)
    return y if bias is None else y + bias
    # <<< ex05 B


def _full_linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    """The single-device layer every rank initialises identically before taking its shard."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, out_features, bias=bias)


def _init_from_seed(m: nn.Module, seed: int | None) -> None:
    """Fill ``m`` with its shard of the single-device layer ``seed`` initialises, taken by
    ``type(m).from_linear`` (the one place a layer is sharded); ``seed=None`` leaves it."""
    if seed is None:
        return
    full = _full_linear(m.in_features, m.out_features, m.bias is not None, seed)
    with torch.no_grad():
        m.load_state_dict(type(m).from_linear(full, group=m.group).state_dict())


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the output features split over ``group``:
    this rank holds what :meth:`from_linear` gives it of the single-device layer that ``seed``
    initialises (``seed=None``: left uninitialised, for :meth:`from_linear` to fill).
    ``gather_output``: return all output features (else this rank's ``out/t``).
    ``sequence_parallel``: the input is this rank's sequence shard (else the whole input)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, group=None, sequence_parallel: bool = False,
                 seed: int | None = 0):
        super().__init__()
        t, _ = size_and_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, t, "out_features")
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank)) if bias else None
        _init_from_seed(self, seed)

    # Contract:
    # ex05.B.load: ``ColumnParallelLinear.from_linear`` and ``RowParallelLinear.from_linear`` return
    #     a module (built with ``**kwargs``) holding this rank's shard of the given single-device
    #     ``nn.Linear`` in storage of its own (none shared with the given layer), so that it
    #     computes the rank's part of that layer.
    # ex05.B.nobias: from a layer with ``bias=False`` too.
    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "ColumnParallelLinear":
        """This rank's shard of an existing single-device ``nn.Linear``."""
        with torch.device(linear.weight.device):  # built where the layer lives
            m = cls(linear.in_features, linear.out_features, linear.bias is not None, **{**kwargs, "seed": None})
        # >>> ex05 B
        t, r = size_and_rank(m.group)
        m.load_state_dict({k: v.chunk(t, 0)[r] for k, v in linear.state_dict().items()})
        # <<< ex05 B
        return m

    def forward(self, x):
        if self.sequence_parallel:
            y = gather_linear(x, self.weight, self.bias, self.group)
            return gather(y, -1, self.group) if self.gather_output else y
        return column_parallel_linear(x, self.weight, self.bias, self.gather_output, self.group)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} ({self.out_per_rank} per rank), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the input features split over ``group``:
    this rank holds what :meth:`from_linear` gives it of the single-device layer that ``seed``
    initialises (``seed=None``: left uninitialised, for :meth:`from_linear` to fill).
    ``input_is_parallel``: the input already is this rank's slice of the features (the
    output of a ColumnParallelLinear); else the full input is split first.
    ``sequence_parallel``: the output is this rank's sequence shard (else the whole output)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, group=None, sequence_parallel: bool = False,
                 seed: int | None = 0):
        super().__init__()
        t, _ = size_and_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, t, "in_features")
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _init_from_seed(self, seed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "RowParallelLinear":
        """This rank's shard of an existing single-device ``nn.Linear``."""
        with torch.device(linear.weight.device):  # built where the layer lives
            m = cls(linear.in_features, linear.out_features, linear.bias is not None, **{**kwargs, "seed": None})
        # >>> ex05 B
        t, r = size_and_rank(m.group)
        m.load_state_dict({k: v.chunk(t, 1)[r] if k == "weight" else v  # the bias whole
                           for k, v in linear.state_dict().items()})
        # <<< ex05 B
        return m

    def forward(self, x):
        if not self.input_is_parallel:
            x = split(x, -1, self.group)
        if self.sequence_parallel:
            return linear_reduce_scatter(x, self.weight, self.bias, self.group)
        return row_parallel_linear(x, self.weight, self.bias, self.group)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} ({self.in_per_rank} per rank), out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")
