"""Exercise 05: tensor parallelism's operators, layers and loss.

``group`` is the tensor-parallel process group of t ranks (``None``: all ranks); group-local
ranks come from ``size_and_rank(group)``. Megatron-LM (Shoeybi et al. 2019, §3, eqs. 1-3),
derived in notebook 05:

A. **f and g**, the conjugate operators (``_F``, ``_G`` and their helper ``_sum(x, group,
   name)``), as ``torch.autograd.Function`` s: f is what a column-parallel layer needs at its
   input, g what a row-parallel layer needs at its output, each the other's transpose (notebook
   05, "Two ways to split Y = XA"). Neither modifies a tensor autograd gave it; ``backward``
   returns one gradient per input of ``forward``.
B. **column_parallel_linear** and **row_parallel_linear**: with this rank's shard of the weight
   (column: rows (out/t, in) and bias (out/t); row: columns (out, in/t) and the full bias),
   return this rank's output features (or all of them with ``gather_output=True``) and,
   for the row layer, the full output; gradients flow to the input correctly, and a column
   layer followed by a row layer communicates once in forward and once in backward (notebook
   05, "Column then row: one all-reduce per MLP").
C. **the vocabulary-parallel cross-entropy** (``_VocabParallelCrossEntropy.forward`` and
   ``.backward``): ``logits`` (..., V/t) are this rank's slice of the vocabulary (rank r has
   tokens [r·V/t, (r+1)·V/t)). Return the mean cross-entropy equal to ``F.cross_entropy`` on the
   full logits, finite even when logits reach hundreds, communicating a few numbers per
   position rather than the logits; the backward, written by hand, needs no communication
   (notebook 05, "The loss without the full logits"; Megatron-LM §3).

Graded against the single-device computation (fp32, tolerance ``TOL``) and on the bytes sent.
Grade it with ``python -m minipar.grade ex05``; stuck? ``minipar.hint("ex05", "A")`` (parts A, B, C).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minipar
from minipar.analysis import cost
from minipar.runtime import trace
from minipar import tensor_parallel as tp
from minipar.course.grading import diagnose, expect, expect_close, expect_equal

EXERCISE = "ex05_tensor_parallel"
HINTS = {
    'A': (
        'In a column-parallel layer every rank uses the same x but only its slice of the weight: '
        'what must happen to ∂L/∂x? In a row-parallel layer each rank has a partial product: what'
        ' must happen to it, and to its gradient?',
        'f: identity forward, all-reduce (sum) of the gradient backward. g: all-reduce (sum) '
        'forward, identity backward. _sum returns an all-reduced copy, never the input itself.',
        '_sum: out = x.contiguous().clone(); comm.all_reduce(out, group=group, name=name); return'
        ' out. _F.forward: ctx.group, ctx.name = group, name; return x.view_as(x); _F.backward: '
        'return _sum(grad, ctx.group, ctx.name), None, None. _G.forward: return _sum(x, group, '
        '...); _G.backward: return grad, None.',
    ),
    'B': (
        "Which of f and g sits at the column layer's input, which at the row layer's output, and "
        'where must the bias be added so that it counts once?',
        'Column: apply f to the input, multiply by your rows, add your bias slice; gather the '
        'last dimension only if asked. Row: multiply your input slice by your columns, sum over '
        'the group with g, then add the full bias.',
        'column: y = F.linear(f(x, group), weight, bias); return gather(y, -1, group) if '
        'gather_output else y. row: y = g(F.linear(x, weight), group); return y + bias if bias is'
        ' not None else y.',
    ),
    'C': (
        "Softmax needs the maximum and the normaliser over the whole vocabulary, and the target's"
        ' logit lives on one rank only: which of these are a few numbers per position?',
        "Forward: the row maximum over all ranks (gather the ranks' maxima), then sum Σ exp(z - "
        "m) and the target's shifted logit over the ranks (zero where this rank does not own the "
        'target); loss = log Σ - (z_y - m), averaged. Backward: (softmax - one-hot) / N on this '
        "rank's slice, from what forward saved.",
        'loss_i = log Σ_v exp(z_iv - m_i) - (z_iy - m_i), m_i = max_v z_iv over the full '
        "vocabulary; dL/dz_iv = grad · (softmax_iv - [v = y_i]) / N for this rank's v (the "
        'one-hot only where this rank owns y_i).',
    ),
}
TIMEOUT = 30
TOL = dict(rtol=1e-5, atol=1e-5)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _comm_bytes(n0):
    return sum(e["bytes_sent"] for e in trace.events()[n0:] if e["kind"] == "comm")


def _close(got, want, what, where=""):
    expect_close(got, want, what, where=where, **TOL)


# ----------------------------------------------------------------------------- f and g
def _f_case():
    r = dist.get_rank()
    x = _randn(4, 3, seed=0).requires_grad_()        # the same x on every rank
    w = _randn(4, 3, seed=10 + r)                      # a different upstream gradient per rank
    y = tp.f(x)
    n0 = len(trace.events())
    (y * w).sum().backward()
    return {"y": y.detach(), "x": x.detach(), "grad": x.grad, "w": w, "bytes": _comm_bytes(n0)}


def _g_case():
    r = dist.get_rank()
    x = _randn(4, 3, seed=20 + r).requires_grad_()    # a different partial result per rank
    w = _randn(4, 3, seed=10)                          # the same upstream gradient everywhere
    before = x.detach().clone()
    n0 = len(trace.events())
    z = tp.g(x)
    sent = _comm_bytes(n0)
    (z * w).sum().backward()
    return {"z": z.detach(), "x": before, "x_after": x.detach(), "grad": x.grad, "w": w, "bytes": sent}


def test_f_identity_forward_all_reduce_backward(impl):
    """f returns x unchanged and sums the ranks' gradients in backward (2 ranks)."""
    results = minipar.launch(_f_case, 2, timeout=TIMEOUT)
    total = sum(fo["w"] for fo in results)
    for rank, fo in enumerate(results):
        _close(fo["y"], fo["x"], "f's forward (the identity)", f"rank {rank}")
        with diagnose(lambda e, fo=fo: torch.allclose(fo["grad"], fo["w"]), "the gradient is this rank's own: "
                      "f's backward sums the ranks' gradients"):
            _close(fo["grad"], total, "f's gradient (the sum of the ranks' gradients)", f"rank {rank}")
        expect_equal(fo["bytes"], int(cost.collective_bytes("all_reduce", 4 * 12, 2)),
                     f"rank {rank}: bytes sent in f's backward (one all-reduce of 12 floats)")


def test_g_all_reduce_forward_identity_backward(impl):
    """g sums the ranks' inputs in forward, leaves its input alone, and passes the gradient unchanged."""
    results = minipar.launch(_g_case, 2, timeout=TIMEOUT)
    total = sum(go["x"] for go in results)
    for rank, go in enumerate(results):
        _close(go["z"], total, "g's forward (the sum over ranks)", f"rank {rank}")
        with diagnose(True, "g changed the tensor it was given: all-reduce a contiguous clone"):
            _close(go["x_after"], go["x"], "g's input after the call (unchanged)", f"rank {rank}")
        _close(go["grad"], go["w"], "g's gradient (the identity)", f"rank {rank}")
        expect_equal(go["bytes"], int(cost.collective_bytes("all_reduce", 4 * 12, 2)),
                     f"rank {rank}: bytes sent in g's forward (one all-reduce of 12 floats)")


# ----------------------------------------------------------------------------- linear layers
def _column(t):
    """Two groups of t ranks ({0..t-1}, {t..2t-1}), each splitting its own layer."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(i, i + t))) for i in range(0, world, t)]
    k, group = rank // t, groups[rank // t]
    r = dist.get_rank(group)
    x_full, w, b = _randn(5, 6, seed=k), _randn(8, 6, seed=10 + k), _randn(8, seed=20 + k)
    up = _randn(5, 8, seed=30 + k)                        # upstream gradient of the full output
    out = {}
    for gather_output in (False, True):
        x = x_full.clone().requires_grad_()
        wr, br = (w.chunk(t, 0)[r].clone().requires_grad_(), b.chunk(t, 0)[r].clone().requires_grad_())
        y = tp.column_parallel_linear(x, wr, br, gather_output=gather_output, group=group)
        (y * (up if gather_output else up.chunk(t, 1)[r])).sum().backward()
        out[gather_output] = (y.detach(), x.grad, wr.grad, br.grad)
    return k, r, out


def _full_linear(x, w, b, up):
    x, w, b = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    y = F.linear(x, w, b)
    (y * up).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


def test_column_parallel_linear(impl):
    """Each rank computes its output features (or all of them, gathered); the input gradient is whole."""
    t = 2
    for k, r, out in minipar.launch(_column, 4, args=(t,), timeout=TIMEOUT):
        y, gx, gw, gb = _full_linear(_randn(5, 6, seed=k), _randn(8, 6, seed=10 + k), _randn(8, seed=20 + k),
                                     _randn(5, 8, seed=30 + k))
        for gather_output, (got_y, got_gx, got_gw, got_gb) in out.items():
            what = f"group {k} rank {r}, gather_output={gather_output}"
            _close(got_y, y if gather_output else y.chunk(t, 1)[r],
                   "output (all features)" if gather_output else f"output (features {r}/{t} of the full layer's)", what)
            _close(got_gx, gx, "input gradient (the sum of the group's partial ones: f's backward)", what)
            _close(got_gw, gw.chunk(t, 0)[r], "weight gradient (this rank's rows)", what)
            _close(got_gb, gb.chunk(t, 0)[r], "bias gradient (this rank's slice)", what)


def _row():
    r, t = dist.get_rank(), dist.get_world_size()
    x_full, w, b, up = _randn(5, 8, seed=1), _randn(6, 8, seed=2), _randn(6, seed=3), _randn(5, 6, seed=4)
    x = x_full.chunk(t, 1)[r].clone().requires_grad_()
    wr, b = w.chunk(t, 1)[r].clone().requires_grad_(), b.clone().requires_grad_()
    y = tp.row_parallel_linear(x, wr, b)
    (y * up).sum().backward()
    return y.detach(), x.grad, wr.grad, b.grad


def test_row_parallel_linear(impl):
    """The partial products sum to the full output, with the bias added once (4 ranks)."""
    t = 4
    y, gx, gw, gb = _full_linear(_randn(5, 8, seed=1), _randn(6, 8, seed=2), _randn(6, seed=3),
                                 _randn(5, 6, seed=4))
    results = minipar.launch(_row, t, timeout=TIMEOUT)
    b = _randn(6, seed=3)
    for r, (got_y, got_gx, got_gw, got_gb) in enumerate(results):
        with diagnose(lambda e: torch.allclose(got_y, y + (t - 1) * b, **TOL), f"the output holds the bias {t} times: "
                      "add it once, after g sums the partial products"):
            _close(got_y, y, "output (the sum of the partial products, plus the bias once)", f"rank {r}")
        _close(got_gx, gx.chunk(t, 1)[r], "input gradient (this rank's input features)", f"rank {r}")
        _close(got_gw, gw.chunk(t, 1)[r], "weight gradient (this rank's columns)", f"rank {r}")
        _close(got_gb, gb, "bias gradient", f"rank {r}")


def _mlp():
    r, t = dist.get_rank(), dist.get_world_size()
    x = _randn(3, 4, 8, seed=5).requires_grad_()
    w1, b1, w2, b2 = _randn(32, 8, seed=6), _randn(32, seed=7), _randn(8, 32, seed=8), _randn(8, seed=9)
    n0 = len(trace.events())
    h = F.gelu(tp.column_parallel_linear(x, w1.chunk(t, 0)[r], b1.chunk(t, 0)[r]))
    y = tp.row_parallel_linear(h, w2.chunk(t, 1)[r], b2)
    forward = [e["bytes_sent"] for e in trace.events()[n0:] if e["kind"] == "comm"]
    n0 = len(trace.events())
    y.sum().backward()
    backward = [e["bytes_sent"] for e in trace.events()[n0:] if e["kind"] == "comm"]
    return y.detach(), x.grad, forward, backward


def test_mlp_needs_one_all_reduce_each_way(impl):
    """Column then row parallel MLP equals the full MLP, with one all-reduce forward and one backward."""
    t = 4
    x = _randn(3, 4, 8, seed=5).requires_grad_()
    hidden = F.gelu(F.linear(x, _randn(32, 8, seed=6), _randn(32, seed=7)))
    y = F.linear(hidden, _randn(8, 32, seed=8), _randn(8, seed=9))
    y.sum().backward()
    one = cost.collective_bytes("all_reduce", 3 * 4 * 8 * 4, t)
    results = minipar.launch(_mlp, t, timeout=TIMEOUT)
    for r, (got_y, got_gx, forward, backward) in enumerate(results):
        _close(got_y, y.detach(), "MLP output", f"rank {r}")
        _close(got_gx, x.grad, "MLP input gradient", f"rank {r}")
        expect_equal({"forward": forward, "backward": backward}, {"forward": [int(one)], "backward": [int(one)]},
                     f"rank {r}: bytes sent by each communication (one all-reduce of {3 * 4 * 8} floats each way)")


# ----------------------------------------------------------------------------- cross-entropy
N, V = 12, 256


def _logits(scale):
    return scale * _randn(N, V, seed=11), torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(12))


def _ce(scale):
    r, t = dist.get_rank(), dist.get_world_size()
    full, targets = _logits(scale)
    z = full.chunk(t, -1)[r].clone().view(3, 4, V // t).requires_grad_()
    n0 = len(trace.events())
    loss = tp.vocab_parallel_cross_entropy(z, targets.view(3, 4))
    loss.backward()
    return loss.detach(), z.grad.reshape(N, V // t), _comm_bytes(n0)


def _check_ce(scale, t=2):
    full, targets = _logits(scale)
    full.requires_grad_()
    want = F.cross_entropy(full, targets)
    want.backward()
    results = minipar.launch(_ce, t, args=(scale,), timeout=TIMEOUT)
    for r, (loss, grad, sent) in enumerate(results):
        with diagnose(not bool(torch.isfinite(loss)), "exp overflowed: subtract the maximum over the whole "
                                                      "vocabulary (every rank's) before exp"):
            _close(loss, want.detach(), f"loss (F.cross_entropy on the full logits, scale {scale:g})", f"rank {r}")
        _close(grad, full.grad.chunk(t, -1)[r], "gradient of this rank's logits (rows: positions, columns: "
               "this rank's vocabulary)", f"rank {r}")
    return results


def test_vocab_parallel_cross_entropy(impl):
    """Loss and gradients equal F.cross_entropy on the full logits (2 ranks, targets on both halves)."""
    _check_ce(scale=1.0)


def test_vocab_parallel_cross_entropy_large_logits(impl):
    """Still exact (and finite) when logits reach hundreds, where exp overflows without the max."""
    _check_ce(scale=150.0)


def test_vocab_parallel_cross_entropy_never_gathers_logits(impl):
    """Each rank sends far fewer bytes than gathering the logits would (N·V floats, 4 ranks)."""
    t = 4
    gathering = cost.collective_bytes("all_gather", N * V * 4, t)
    for r, (_, _, sent) in enumerate(_check_ce(scale=1.0, t=t)):
        expect(0 < sent < gathering / 8, f"rank {r}: sent {sent} bytes; expected more than 0 and under "
                                         f"{gathering / 8:.0f} (an eighth of gathering the logits, {gathering:.0f})")
