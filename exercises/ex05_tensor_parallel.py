"""Exercise 05: tensor parallelism's operators, layers and loss.

Write the five functions below, with the same names and signatures as in
``minipar.tensor_parallel`` (the library's ColumnParallelLinear and RowParallelLinear call
functions just like these). ``group`` is the tensor-parallel process group (``None``: all
ranks); use group-local ranks, ``group_rank(group)`` and ``group_size(group)``.

1. **f and g**, the conjugate operators of Megatron-LM, as ``torch.autograd.Function``s:
   f is the identity in forward and an all-reduce (sum) of the gradient in backward;
   g all-reduces in forward and passes the gradient through unchanged. Move data only with
   ``minipar.comm.all_reduce`` (in place, recorded so the grader can count bytes), and
   never modify a tensor autograd gave you: all-reduce a copy.
2. **column_parallel_linear**: this rank holds rows ``weight`` (out/t, in) of the full
   ``nn.Linear`` weight and ``bias`` (out/t). Return ``f(x) Wᵀ + b``: this rank's output
   features, or all of them with ``gather_output=True`` (use the given ``gather``).
3. **row_parallel_linear**: this rank holds columns ``weight`` (out, in/t) and receives its
   slice of the input features; sum the partial products with g, then add the full
   ``bias`` (out) once.
4. **vocab_parallel_cross_entropy**: ``logits`` (..., V/t) are this rank's slice of the
   vocabulary (rank r has tokens [r·V/t, (r+1)·V/t)). Return the mean cross-entropy
   against ``targets`` (...), equal to ``F.cross_entropy`` on the full logits, without
   ever gathering the logits: reduce max, sum of exponentials and the target's logit over
   the vocabulary on each rank first, then combine those N numbers across ranks. Subtract
   the global max before ``exp`` so large logits do not overflow. (Using your g for the
   sums gives the right gradient for free.)

Grade it with ``python -m minipar.grade ex05``.
"""
import torch
import torch.nn.functional as F  # noqa: F401 - for your code

from minipar.comm import all_gather, all_reduce, group_rank, group_size  # noqa: F401
from minipar.tensor_parallel import gather  # noqa: F401 - all-gathers along a dim; backward keeps this rank's slice


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("Exercise 05: f's forward (identity); remember the group in ctx")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("Exercise 05: f's backward (all-reduce a copy of grad); "
                                  "return one gradient per forward input: (grad_x, None)")


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("Exercise 05: g's forward (all-reduce a copy of x)")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("Exercise 05: g's backward (identity)")


def f(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: ``x`` unchanged forward; the gradient is all-reduced over ``group``."""
    return _F.apply(x, group)


def g(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: the sum of ``x`` over ``group`` forward; the gradient passes unchanged."""
    return _G.apply(x, group)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           gather_output: bool = False, group=None) -> torch.Tensor:
    """``f(x) A_iᵀ + b_i`` with this rank's rows of the weight (its output features).

    ``weight`` is (out/t, in), ``bias`` (out/t,). Returns this rank's output features, or
    all of them (all-gathered along the last dimension) with ``gather_output=True``."""
    raise NotImplementedError("Exercise 05: implement column_parallel_linear")


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        group=None) -> torch.Tensor:
    """``g(x_i A_iᵀ) + b``: this rank's input features ``x_i`` times its columns of the
    weight (out, in/t), summed over the group; the full bias (out,) is added once."""
    raise NotImplementedError("Exercise 05: implement row_parallel_linear")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Mean cross-entropy of (..., V/t) vocabulary-parallel logits against (...) targets,
    equal to ``F.cross_entropy`` on the full logits; never gathers the logits."""
    raise NotImplementedError("Exercise 05: implement vocab_parallel_cross_entropy")
