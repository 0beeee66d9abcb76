"""Exercise 05: tensor parallelism: the conjugate operators, the column- and row-parallel
layers and the vocabulary-parallel cross-entropy, forward and backward.

``group`` is the tensor-parallel process group of t ranks (``None``: all ranks). Megatron-LM
(Shoeybi et al. 2019, §3, eqs. 1-3); notebook 05 shows on real ranks where a layer's
partial results live and what must cross between ranks.

A. The operators: ``_sum``, ``_F`` and ``_G`` (``torch.autograd.Function`` s behind ``f`` and
   ``g``), ``gather_along`` and ``_split`` (behind ``gather`` and ``split``).
B. The layers: ``column_parallel_linear``, ``row_parallel_linear``, and
   ``ColumnParallelLinear.from_linear`` / ``RowParallelLinear.from_linear``.
C. The vocabulary-parallel cross-entropy (``_VocabParallelCrossEntropy.forward`` and
   ``.backward``): which numbers the ranks must combine, and how to keep them finite, is
   yours to derive.

Each function's docstring below is its contract: clauses ``ex05.P.word`` that must hold (the
grader names the clause a failure breaks). Graded against the single-device computation
(fp32, tolerance ``TOL``) and on the bytes sent. Grade it with ``python -m minipar.grade ex05``;
stuck? ``minipar.hint("ex05", "A")`` (parts A, B, C).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minipar
from minipar import cost
from minipar.runtime import trace
from minipar import tensor_parallel as tp
from minipar.course import grading
from minipar.course.grading import breaks, diagnose, expect, expect_close, expect_equal, expect_recorded, attempt, observes

EXERCISE = "ex05_tensor_parallel"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNp1jzFuAzEMBL+ynZsE7tMcUhrIJ3gSbRHmSYJI+XytK78zL4lsFymCNCSxXOxgDxmEULQv+b1SI'
        '1VWKG3cwBduGxrlM7qxwRPDaGFcMXdHybpB3GAqgVGOT8PKckr+gTWRY+nmSFQrZ3jB9/32tR/jOuHwwLay/'
        'mFSSC9kIhuW8XYhRW0l9vBPrvgbKMfXaTg1isLZJ3wOcU0yIkdD5eByYdQ+PL/ddoZZSzg/ChCiLJxNSoZJZ'
        'Mzbc08/1exq2A==',
        'sealed:eNplj1FOxDAMRK8yf4BU9gDlMKts4myjpk5lO0XL6XFbtCDxac/zjCePKInYij2Qm3wGSQNCre9Cq'
        'UfCq/blDS3DJsJdQioO4xbivKMX3Mf/9NPn6fzLX52AkHVhReA/xwmxrY8BTBvJEVd47YZiSjV7UvCdXENt7'
        'KFL2wipLLB2sFma/6X7EAwU4gQJPL8obrXFGUXR2LHqqnQ+O56W5/2PoK5wOu33vUcQa2l8dPjw/9dabEScy'
        'F3N9c1b6sFq+aIBM9HqcucZcvkGD9t84A==',
        'sealed:eNqNUs1uhCAQfpU5woYS9+rGa/fWF9gYQ3GqZgUMgkvfvuNit27aQw8MEL+/fNjM0ZTgYoAKktTOh'
        'qGLLs6MSz06i4yfQDtjpBrHxmMbNTJCC+i8i1N1nwKsMlitg9AeQ/R2lZTQvMoP52/KtyXokOQGX48rmjx3A'
        'g9qksuAt0bNLJEeabwrfc0iG6Kh1KzzqhV/yXIBbxQ9Twpx/gmx5yexd1+dzr+dsslerlOhR98oaqcrIeXij'
        'FuwHQyjJaDgT0WetnrRTOGTWTgQSdpocGR8324Wzu0SwuPcqwnZy5H/r+21tG/5O/VS1AIOj9uxrPkjaCGAN'
        'k7tzNM4hJJuy9AiSxuYPhLZCpBS8t3L6D7aK7OZffH18y/zBWUiyaQ=',
    ),
    'B': (
        'sealed:eNo9jkEOwjAMBL+yN0DiD31Gz2njNpZaG8WOIn5PkgJX73p25sRrgm7YECRih7EbgsMTYdWjnIIjv'
        'CnfDCyv4k/U8fKtZK3/XIuPQgfVRJlwFrtqCwfDQggxUoRpOzYAe5so0gZVVpowD3Lkk8RYpWtV4j057trBL'
        'A+wDeC1hY2Cl0z2s+rR0GxEsukDE49Oyw==',
        'sealed:eNpNkEtuwzAMRK8yuzZAGrTbZNkbFN0XikXLRCjR0CeGb1+ZTj9Lasg3o3lXaTGd4eZZVoyoijoRO'
        'M2tHhGbVN6E64pVW0bWpRzhvN/HK7uCIjzQBcH1w2zX4kqF50ipsCZo6gQe4cqN/Akfupz/yMYxux30azVYs'
        'u5WWoTeH+iQtc1YuE4Ix+0lWZpNGpuIJTrhs49RfRMquDaWfaFwCkIvnu6bj7i1M41kIpF/AG9EM4appRsyd'
        'DR5IQ5ThRNNYfsaXvG8J7SjvYmqeoBm09/w3Mv6Jy6TCh0uGLPGL+FEri9qD2juLtJP94HvPYTFe+rtVlepE'
        '4d6+gaQMpfc',
        'sealed:eNpNkM1OwzAQhF9ljrYIK3oN6pUj4o6QZZJNYtWxK//QRoh3x06TqqfVrne/GU/nbZ5diwVHvJE1j'
        'nUQg7g2GIPPZ9ngwmacUoNvo6N8ReCUg8Oo08RBLA2eD/suzLDNlc/pnBPYRsZCCP5ykxjFXeS6o+V+f4cve'
        'FrlKvBWI5xPePeO70yljDNJqRZDtrawVa1qoxunBtaFxrFBcfPQVWKDyNwXxch2oJuPgnCOPnTQM6fyt4rbn'
        'qjnpLtJSOqm7E6ixPECH3CQn+GLOlt8CbnTVsdHEFFdqZ4JQ/DzZq3FTNbrXsWkE6vedEn8nlr8PLArtgL+J'
        'MSaXQl1Swu6qI3ozYwSfJ2vepfJW5b0D8Bsm68=',
    ),
    'C': (
        'sealed:eNo9TcENw0AIW8W/fjpBPx2iE5CEJKh3EMHl0mxf0kclY9kWhpfNrdIHyjwF2spIJ3WvIJ1+Xs0rF'
        'Ql2WE+6smO1wug20rAX8vP+327kC7dboNgiDUU6B0wTDCd9pyjnIw/IuMLmqxMM8hzMfED3OrAHtvy0WUgT0'
        '+cXr0I8Ug==',
        'sealed:eNpNUDtuwzAMvcrbYgN2uqfo0qFjr1AQEW0LscWAYuIk1+l9cqZSFtB25MP78kN0JQ0H2MRQWbHQL'
        'S6XBXJlBc0zlNIpoxnJGVppBdlVJrVdwRKya57f4Nu5eaDH0oJS2OhGOrLtMvIUB+OAWcZoNeDXDs2DVbB6h'
        'iummDcYQTgjibPX9M+sfXWTnPFWvEps7/qv+5bbgdyZRg57vNPxVOc1WQbzxk6RxP0k1uIFn378pZWKczxyh'
        '0Fl8S5kGOp/kN00dFC2iybfEGudbYr/Itj9zPsfVD90HQ==',
        'sealed:eNpFjcENwjAMRVf5N1qJ0gFQN0AsgFAUSNpGpDVK2rRhHYbgzgDMRBwhcfHXl5+fLXkvDBpY6vB5i'
        'gC93ouHMAEVBmHKFFzjr255JnyQa2IzR0E7TL1GO1uLQFd5ma10cQ91qFVGGnROKrxfKDy1Ex/nBydeRWHOJ'
        'Woc0RKLjIeT423jEVCwl0Zd9TSltBFLr53+U6Bl9Kwod19tg0UK',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT
TOL = dict(rtol=1e-5, atol=1e-5)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _comm_bytes(n0):
    return sum(e["bytes_sent"] for e in trace.events()[n0:] if e["kind"] == "comm")


def _comm_calls(n0):
    return sum(e["kind"] == "comm" for e in trace.events()[n0:])


def _comm_names(n0):
    return [e["name"] for e in trace.events()[n0:] if e["kind"] == "comm"]


def _close(got, want, what, where=""):
    expect_close(got, want, what, where=where, **TOL)


# ----------------------------------------------------------------------------- f and g
def _f_case():
    r = dist.get_rank()
    x = _randn(4, 3, seed=0).requires_grad_()        # the same x on every rank
    w = _randn(4, 3, seed=10 + r)                      # a different upstream gradient per rank
    n_fwd = len(trace.events())
    y = tp.f(x)
    n0 = len(trace.events())
    (y * w).sum().backward()
    return {"y": y.detach(), "x": x.detach(), "grad": x.grad, "w": w, "bytes": _comm_bytes(n0),
            "forward": [_comm_bytes(n_fwd) - _comm_bytes(n0), _comm_calls(n_fwd) - _comm_calls(n0)],
            "calls": _comm_calls(n0), "names": _comm_names(n0)}


def _g_case():
    r = dist.get_rank()
    x = _randn(4, 3, seed=20 + r).requires_grad_()    # a different partial result per rank
    w = _randn(4, 3, seed=10)                          # the same upstream gradient everywhere
    before = x.detach().clone()
    n0 = len(trace.events())
    z = tp.g(x)
    sent, calls, names = _comm_bytes(n0), _comm_calls(n0), _comm_names(n0)
    n1 = len(trace.events())
    (z * w).sum().backward()
    return {"z": z.detach(), "x": before, "x_after": x.detach(), "grad": x.grad, "w": w, "bytes": sent,
            "calls": calls, "names": names, "backward": [_comm_bytes(n1), _comm_calls(n1)]}


@observes("ex05.A.f", "ex05.A.bytes")
def test_f_identity_forward_all_reduce_backward(impl):
    """f on 2 ranks: its output, the gradient it passes back, and what it records (ex05.A)."""
    results = minipar.launch(_f_case, 2, timeout=TIMEOUT)
    total = sum(fo["w"] for fo in results)
    for rank, fo in enumerate(results):
        with breaks("ex05.A.f"):
            _close(fo["y"], fo["x"], "f's forward (the identity)", f"rank {rank}")
            with diagnose(lambda e, fo=fo: torch.allclose(fo["grad"], fo["w"]), "the gradient is this rank's own "
                          "upstream gradient, not the sum over ranks"):
                _close(fo["grad"], total, "f's gradient (the sum of the ranks' gradients)", f"rank {rank}")
        _one_all_reduce(fo, "f", "backward", fo["forward"], "forward", rank)


def _one_all_reduce(res, op: str, where: str, other, other_where: str, rank: int) -> None:
    """``op`` (f or g) recorded one all-reduce of 12 floats, named ``<op>.all_reduce``, in its
    ``where`` pass, and nothing in the other (``other``: [bytes, collectives] there)."""
    with breaks("ex05.A.bytes"):
        expect_recorded(res["bytes"], int(cost.collective_bytes("all_reduce", 4 * 12, 2)),
                        f"bytes sent in {op}'s {where} (one all-reduce of 12 floats)", f"rank {rank}")
        expect_equal(res["calls"], 1, f"rank {rank}: collectives recorded in {op}'s {where}")
        expect_equal(res["names"], [f"{op}.all_reduce"],
                     f"rank {rank}: the name {op}'s {where} collective is recorded under")
        expect_equal(other, [0, 0], f"rank {rank}: [bytes, collectives] recorded in {op}'s {other_where}")


@observes("ex05.A.g", "ex05.A.bytes", "ex05.A.inplace")
def test_g_all_reduce_forward_identity_backward(impl):
    """g on 2 ranks: its output, its input left alone, the gradient it passes back, and what it records
    (ex05.A)."""
    results = minipar.launch(_g_case, 2, timeout=TIMEOUT)
    total = sum(go["x"] for go in results)
    for rank, go in enumerate(results):
        with breaks("ex05.A.g"):
            _close(go["z"], total, "g's forward (the sum over ranks)", f"rank {rank}")
        with breaks("ex05.A.inplace"):
            with diagnose(True, "the tensor given to g changed during the call"):
                _close(go["x_after"], go["x"], "g's input after the call (unchanged)", f"rank {rank}")
        with breaks("ex05.A.g"):
            _close(go["grad"], go["w"], "g's gradient (the identity)", f"rank {rank}")
        _one_all_reduce(go, "g", "forward", go["backward"], "backward", rank)


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
        if tuple(y.shape) != (5, 8 if gather_output else 8 // t):     # reported by the driver
            out[gather_output] = (y.detach(), None, None, None)
            continue
        (y * (up if gather_output else up.chunk(t, 1)[r])).sum().backward()
        out[gather_output] = (y.detach(), x.grad, wr.grad, br.grad)
    return k, r, out


def _full_linear(x, w, b, up):
    x, w, b = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    y = F.linear(x, w, b)
    (y * up).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


@observes("ex05.*.group", "ex05.B.column")
def test_column_parallel_linear(impl):
    """ColumnParallelLinear: each rank's output (gathered or not) and the input gradient equal the full
    layer's."""
    t = 2
    for k, r, out in minipar.launch(_column, 4, args=(t,), timeout=TIMEOUT):
        y, gx, gw, gb = _full_linear(_randn(5, 6, seed=k), _randn(8, 6, seed=10 + k), _randn(8, seed=20 + k),
                                     _randn(5, 8, seed=30 + k))
        for gather_output, (got_y, got_gx, got_gw, got_gb) in out.items():
            what = f"group {k} rank {r}, gather_output={gather_output}"
            with breaks("ex05.B.column"):
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


@observes("ex05.B.row")
def test_row_parallel_linear(impl):
    """RowParallelLinear: the output, with its bias, and the gradients equal the full layer's (4 ranks)."""
    t = 4
    y, gx, gw, gb = _full_linear(_randn(5, 8, seed=1), _randn(6, 8, seed=2), _randn(6, seed=3),
                                 _randn(5, 6, seed=4))
    results = minipar.launch(_row, t, timeout=TIMEOUT)
    b = _randn(6, seed=3)
    for r, (got_y, got_gx, got_gw, got_gb) in enumerate(results):
        with diagnose(lambda e: torch.allclose(got_y, y + (t - 1) * b, **TOL), f"the output holds the bias {t} times"):
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


@observes("ex05.B.once")
def test_mlp_needs_one_all_reduce_each_way(impl):
    """Column then row parallel MLP equals the full MLP; the all-reduces and bytes each way are the
    contract's."""
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


def _logits(scale, skew=0.0):
    """Logits of ``scale`` times a normal sample; ``skew`` added to the first half of the
    vocabulary (rank 0's slice of 2), so that one rank's logits sit far above another's."""
    full = scale * _randn(N, V, seed=11)
    full[:, :V // 2] += skew
    return full, torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(12))


UPSTREAM = 3.0


def _ce(scale, skew=0.0):
    r, t = dist.get_rank(), dist.get_world_size()
    full, targets = _logits(scale, skew)
    z = full.chunk(t, -1)[r].clone().view(3, 4, V // t).requires_grad_()
    n0 = len(trace.events())
    loss = tp.vocab_parallel_cross_entropy(z, targets.view(3, 4))
    sent, n0 = _comm_bytes(n0), len(trace.events())
    (UPSTREAM * loss).backward()                         # the loss scaled: the backward's gradient is not 1
    return loss.detach(), z.grad.reshape(N, V // t), (sent, _comm_bytes(n0))


def _check_ce(scale, t=2, skew=0.0, clause=""):
    full, targets = _logits(scale, skew)
    full.requires_grad_()
    want = F.cross_entropy(full, targets)
    (UPSTREAM * want).backward()
    results = minipar.launch(_ce, t, args=(scale, skew), timeout=TIMEOUT)
    case = f"scale {scale:g}" + (f", rank 0's logits near {skew:g} and rank 1's near 0" if skew else "")
    for r, (loss, grad, sent) in enumerate(results):
        with diagnose(not bool(torch.isfinite(loss)), "the loss is not finite (inf or nan)"):
            _close(loss, want.detach(), f"loss (F.cross_entropy on the full logits, {case}){clause}", f"rank {r}")
        with diagnose(lambda e, g=grad, r=r: torch.allclose(g, full.grad.chunk(t, -1)[r] / UPSTREAM, **TOL),
                      "the gradient is the one for an upstream gradient of 1"):
            _close(grad, full.grad.chunk(t, -1)[r], f"gradient of this rank's logits for the loss × {UPSTREAM:g} "
                   "(rows: positions, columns: this rank's vocabulary)", f"rank {r}")
    return results


@observes("ex05.C.exact")
def test_vocab_parallel_cross_entropy(impl):
    """Loss and gradients equal F.cross_entropy on the full logits (2 ranks, targets on both halves), the
    gradients those of 3 × the loss."""
    _check_ce(scale=1.0)


@observes("ex05.C.finite")
def test_vocab_parallel_cross_entropy_large_logits(impl):
    """Still exact and finite when logits reach hundreds: similar logits on every rank, and very different
    ones between ranks (rank 0's near 300, rank 1's near 0)."""
    clause = " (finite even when logits reach hundreds)"
    _check_ce(scale=150.0, clause=clause)
    _check_ce(scale=1.0, skew=300.0, clause=clause)


@observes("ex05.C.bytes", "ex05.C.backward")
def test_vocab_parallel_cross_entropy_never_gathers_logits(impl):
    """The bytes each rank sends in forward and in backward, against the contract's bound (4 ranks)."""
    t = 4
    gathering = cost.collective_bytes("all_gather", N * V * 4, t)
    for r, (_, _, (sent, back)) in enumerate(_check_ce(scale=1.0, t=t)):
        with breaks("ex05.C.bytes"):
            expect(0 < sent < gathering / 8, f"rank {r}: sent {sent} bytes in forward; expected more than 0 and under "
                                             f"{gathering / 8:.0f} (an eighth of gathering the logits, {gathering:.0f})")
        with breaks("ex05.C.backward"):
            expect_equal(back, 0, f"rank {r}: bytes sent in the cross-entropy's backward")


def _member(rank):
    """(group index, rank in the group) of a global rank, in the groups [0, 2] and [1, 3]: strided,
    so that a rank's place in its group differs from its global rank modulo the group size."""
    return rank % 2, rank // 2


def _pairs():
    """Two groups of 2 out of 4 ranks: (the group, its index, this rank's index in it)."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]    # every rank creates both
    return (groups[_member(dist.get_rank())[0]], *_member(dist.get_rank()))


def _in_group(rank):
    gi, gr = _member(rank)
    return f"rank {rank} (rank {gr} of group {[gi, gi + 2]})"


def _raised(got, where):
    expect(not isinstance(got, str), f"{where}: the call {got}")


# ----------------------------------------------------------------------------- gather and split
def _block(rank):
    return torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * rank


def _gather_split(group, gr):
    x = _block(dist.get_rank()).requires_grad_()
    since = len(trace.events())
    out = {dim: tp.gather(x, dim, group).detach() for dim in (0, 1, -1)}
    out["sent"] = _comm_bytes(since)
    up = _randn(3, 8, seed=7)
    (tp.gather(x, -1, group) * up).sum().backward()      # backward keeps this rank's block of the gradient
    out["gather grad"] = x.grad.clone()
    out["split"] = {dim: tp.split(_block(0), dim, group) for dim in (1, -1)}
    try:
        tp.split(torch.zeros(3, 5), -1, group)
        out["odd"] = "returned"
    except ValueError:
        out["odd"] = "ValueError"
    return out


def _gathers_and_splits():
    group, gi, gr = _pairs()
    return attempt(_gather_split, group, gr)


@observes("ex05.*.group", "ex05.A.gather", "ex05.A.split", "ex05.A.divide", "ex05.*.recorded")
def test_gather_and_split(impl):
    """gather and split on two groups of 2 out of 4 ranks ([0, 2] and [1, 3]): values and gradients along dims 0, 1 and -1, in
    group rank order; a size that does not divide is a ValueError."""
    results = minipar.launch(_gathers_and_splits, 4, timeout=TIMEOUT)
    up = _randn(3, 8, seed=7)
    for rank, got in enumerate(results):
        where, (gi, gr) = _in_group(rank), _member(rank)
        _raised(got, where)
        blocks = [_block(gi), _block(gi + 2)]
        with breaks("ex05.A.gather"):
            for dim in (0, 1, -1):
                _close(got[dim], torch.cat(blocks, dim), f"gather along dim {dim} (the group's blocks in rank order, "
                       f"rank {gi}'s first)", where)
        with breaks("ex05.*.recorded" if got["sent"] == 0 else "ex05.A.gather"):
            expect_recorded(got["sent"], 3 * 12 * 4, "bytes the three gathers sent, as recorded (each sends this "
                            "rank's 12 fp32 elements to the other rank of its group)", where)
        with breaks("ex05.A.split"):
            for dim in (1, -1):
                _close(got["split"][dim], _block(0).chunk(2, dim)[gr], f"split along dim {dim} (block {gr} of 2)", where)
        with breaks("ex05.A.gather"):
            _close(got["gather grad"], up.chunk(2, -1)[gr], "the gradient of gather's input (this rank's block of "
                   "the upstream gradient)", where)
        with breaks("ex05.A.divide"):
            expect_equal(got["odd"], "ValueError", f"{where}: split of a size-5 dimension over 2 ranks")


# ----------------------------------------------------------------------------- the modules' shards
def _given(gi, bias=True):
    lin = torch.nn.Linear(6, 4, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_randn(4, 6, seed=50 + gi))
        if bias:
            lin.bias.copy_(_randn(4, seed=60 + gi))
    return lin


def _state(m):
    return {"weight": m.weight.detach().clone(), "bias": None if m.bias is None else m.bias.detach().clone()}


def _shard_case(cls, gi, bias, group):
    given = _given(gi, bias)
    m = cls.from_linear(given, group=group, seed=99)                            # the seed is not the layer's
    ptrs = {q.untyped_storage().data_ptr() for q in given.parameters()}
    return {**_state(m), "shared": sorted(n for n, q in m.named_parameters() if q.untyped_storage().data_ptr() in ptrs)}


def _shards():
    group, gi, gr = _pairs()
    return {f"{kind}.from_linear(nn.Linear(6, 4{'' if bias else ', bias=False'}))":
            attempt(_shard_case, cls, gi, bias, group)
            for kind, cls in (("ColumnParallelLinear", tp.ColumnParallelLinear), ("RowParallelLinear", tp.RowParallelLinear))
            for bias in (True, False)}


@observes("ex05.*.group", "ex05.B.load", "ex05.B.nobias")
def test_layers_shard_the_single_device_layer(impl):
    """ColumnParallelLinear.from_linear and RowParallelLinear.from_linear of a given nn.Linear(6, 4), with and
    without a bias, on two groups of 2 out of 4 ranks: each rank's weight and bias are its shard of the given
    layer."""
    results = minipar.launch(_shards, 4, timeout=TIMEOUT)
    for rank, got in enumerate(results):
        where, (gi, gr) = _in_group(rank), _member(rank)
        for name, got_state in got.items():
            with breaks("ex05.B.nobias" if "bias=False" in name else "ex05.B.load"):
                _raised(got_state, f"{where}, {name}")
                full = _given(gi, bias="bias=False" not in name)
                column = name.startswith("Column")
                want_w = full.weight.detach().chunk(2, 0 if column else 1)[gr]
                want_b = None if full.bias is None else (full.bias.detach().chunk(2, 0)[gr] if column else full.bias.detach())
                expect_equal(tuple(got_state["weight"].shape), tuple(want_w.shape), f"{where}, {name}: the weight's shape")
                _close(got_state["weight"], want_w, f"{name}'s weight (the single-device layer's "
                       f"{'rows' if column else 'columns'} {'2r..2r+1' if column else '3r..3r+2'})", where)
                expect_equal(got_state["bias"] is None, want_b is None, f"{where}, {name}: the bias is None")
                if want_b is not None:
                    _close(got_state["bias"], want_b, f"{name}'s bias ({'entries 2r..2r+1' if column else 'whole'})", where)
                with breaks("ex05.B.load"):
                    expect_equal(got_state["shared"], [], f"{where}, {name}: the module's parameters whose storage is the "
                                 "given layer's (the shard is held in storage of its own)")


# ----------------------------------------------------------------------------- cross-entropy on subgroups
CE_DTYPES = [torch.float32, torch.bfloat16]


def _ce_case(group, gi, gr, dtype):
    full, targets = _logits(1.0 + gi)
    z = full.chunk(2, -1)[gr].to(dtype).requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(z, targets, group)
    loss.backward()
    return loss.detach().float(), z.grad.float()


def _ce_groups():
    group, gi, gr = _pairs()
    return [attempt(_ce_case, group, gi, gr, dtype) for dtype in CE_DTYPES]


@observes("ex05.*.group", "ex05.C.exact", "ex05.C.fp32")
def test_vocab_parallel_cross_entropy_on_subgroups(impl):
    """The loss and gradient on two groups of 2 out of 4 ranks (each group its own logits), in
    fp32 and with bf16 logits: the loss within 1e-5 of F.cross_entropy on those bf16 values in
    fp32."""
    results = minipar.launch(_ce_groups, 4, timeout=TIMEOUT)
    for rank, cases in enumerate(results):
        where, (gi, gr) = _in_group(rank), _member(rank)
        for dtype, got in zip(CE_DTYPES, cases):
            w = f"{where}, {dtype} logits"
            _raised(got, w)
            loss, grad = got
            full, targets = _logits(1.0 + gi)
            full = full.to(dtype).float().requires_grad_()
            want = F.cross_entropy(full, targets)
            want.backward()
            tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)     # a bf16 gradient
            with breaks("ex05.C.exact" if dtype == torch.float32 else "ex05.C.fp32"):
                expect_close(loss, want.detach(), "loss (F.cross_entropy on the group's full logits, in fp32)", where=w, **TOL)
                expect_close(grad, full.grad.chunk(2, -1)[gr], "gradient of this rank's logits (rows: positions, "
                             "columns: this rank's vocabulary)", where=w, **tol)
