"""``python -m minipar.bench cp``: ring attention at cp = 2 against full attention on one rank,
and against PyTorch's own context parallelism where it runs.

On c ranks (default 2, one thread each) every rank holds T/c tokens of the same causal attention
problem (B, heads, T, d). Timed, interleaved, forward + backward, after checking the outputs against
full attention: minipar's ring attention (zigzag), all-gather attention and Ulysses over the c ranks,
each on fused blocks (``sdpa``, :mod:`minipar.models.attention`) and on written-out ones
(``materialized``), and on every rank full attention on the whole sequence (PyTorch's
``scaled_dot_product_attention``, minipar's written-out ``masked_attention``). Each row also gives
the activation bytes its forward keeps for the backward on the rank that keeps most, against one
rank's: context parallelism's other reason to exist. Goals (one-rank SDPA = 1): ring at most 1.2
at T = 2048 and below 1 at T = 8192 (``--seq 8192 --attention sdpa``), Ulysses at most 1.3.
PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` is tried too; on Gloo/CPU it
has no CPU attention kernel to shard (the output says why), and the ratio is then against full
attention on one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from .. import context_parallel as cpm
from ..runtime.launch import launch
from .common import (backward_step, here, interleaved, median, placement, parser, report,
                     row, size)

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("PyTorch's context_parallel is tried in the same placement (where it cannot run, the ratio is "
              "against full attention on one rank, as on the CPU)")


def _try_torch_cp(q, k, v, repeats):
    """Seconds per forward+backward of PyTorch's context parallelism, or the reason it cannot run."""
    try:
        from torch.distributed.device_mesh import init_device_mesh  # deferred: optional (absent from some torch versions: the try)
        from torch.distributed.tensor.experimental import context_parallel  # deferred: optional, as above
        mesh = init_device_mesh(here().type, (dist.get_world_size(),))
        bufs = [t.detach().clone() for t in (q, k, v)]

        def step():
            with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
                qs, ks, vs = (t.detach().requires_grad_() for t in bufs)
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).sum().backward()
        return median(interleaved({"torch cp": step}, repeats, warmup=1)["torch cp"]), None
    except Exception as e:   # noqa: BLE001 - the reason is the result
        return None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:140]}"


PATHS = ("sdpa", "materialized")


def _rank(b, T, heads, d, repeats, paths):
    c, r = comm.group_size(), comm.group_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, T, d, generator=g).to(here()) for _ in range(3))
    local = [cpm.shard_sequence(t, r, c, "zigzag", dim=2) for t in (q, k, v)]
    want = cpm.shard_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=True), r, c, "zigzag", dim=2)

    def over_ranks(variant, path):   # minipar's attention over the c ranks, zigzag layout
        return lambda *t: cpm.context_attention(*t, None, True, "zigzag", variant, attention=path)[0]
    one_rank = {"torch sdpa, 1 rank": lambda *t: F.scaled_dot_product_attention(*t, is_causal=True)}
    if "materialized" in paths:
        one_rank["minipar materialized, 1 rank"] = lambda *t: cpm.masked_attention(*t, causal=True)[0]
    err, fns, saved = 0.0, {}, {}
    for path in paths:
        for variant in cpm.VARIANTS:
            fn = over_ranks(variant, path)
            err = max(err, (fn(*local) - want).abs().max().item())
            fns[f"minipar {variant} ({path})"] = backward_step(fn, *local)
            saved[f"minipar {variant} ({path})"] = _saved_bytes(fn, local)
    for name, fn in one_rank.items():
        fns[name] = backward_step(fn, q, k, v)
        saved[name] = _saved_bytes(fn, (q, k, v))
    out = {k: median(t) for k, t in interleaved(fns, repeats, warmup=2).items()}
    out["torch cp"], out["torch_cp_error"] = _try_torch_cp(q, k, v, repeats)
    return {**out, "max_abs_diff": err, "saved": saved}


def _saved_bytes(fn, inputs):
    """Activation bytes autograd keeps for the backward of one forward of ``fn``: this rank's Q, K, V
    count where they are kept (in a model they are the projection's output)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    return cpm.saved_activation_bytes(lambda: fn(*leaves))[0]


def main(argv=None) -> dict:
    p = parser("cp", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="context-parallel size c (default 2)")
    p.add_argument("--heads", type=int, default=None, help="default 8, --smoke 2")
    p.add_argument("--head-dim", type=int, default=None, help="default 32, --smoke 8")
    p.add_argument("--batch", type=int, default=None, help="default 2, --smoke 1")
    p.add_argument("--seq", type=int, default=None, help="sequence length T (default 2048, --quick 512, --smoke 32)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps each (default 10, --quick 4, --smoke 1)")
    p.add_argument("--attention", choices=("both", *PATHS), default="both",
                   help="the per-block attention of minipar's rows: both (default), fused or written out")
    a = p.parse_args(argv)
    placement(p, a.device, a.ranks, shares=SHARED_GPU)
    paths = PATHS if a.attention == "both" else (a.attention,)
    T, repeats = a.seq or size(a, 2048, 512, 32), a.repeats or size(a, 10, 4, 1)
    a.heads, a.head_dim, a.batch = a.heads or size(a, 8, 8, 2), a.head_dim or size(a, 32, 32, 8), a.batch or size(a, 2, 2, 1)
    cpm.check_sequence(T, a.ranks, "zigzag")
    cpm.check_heads(a.heads, a.ranks)
    res = launch(_rank, a.ranks, args=(a.batch, T, a.heads, a.head_dim, repeats, paths), timeout=1800,
                 device=a.device)
    err = max(r["max_abs_diff"] for r in res)
    if err > 1e-4:
        raise RuntimeError(f"context-parallel attention disagrees with full attention: {err:.2e}")
    slowest = {k: max(r[k] for r in res) for k in res[0]
               if k not in ("torch_cp_error", "max_abs_diff", "saved") and res[0][k] is not None}
    peak = {k: max(r["saved"][k] for r in res) for k in res[0]["saved"]}   # the rank that keeps most
    torch_cp = slowest.get("torch cp")
    base_name = "torch context_parallel" if torch_cp else "torch sdpa, 1 rank"
    base = torch_cp or slowest["torch sdpa, 1 rank"]
    one = slowest["torch sdpa, 1 rank"]
    rows = [{**row(t, base, attention=k, ranks=1 if k.endswith("1 rank") else a.ranks), "vs 1-rank sdpa": t / one,
             "saved MB/rank": peak[k] / 1e6, "vs 1 rank's": peak[k] / peak["torch sdpa, 1 rank"]}
            for k, t in slowest.items() if k.startswith("minipar")]   # the baselines: the intro's line
    ring = slowest[f"minipar ring ({paths[0]})"]
    goals = {"ring (sdpa) at most 1.2x one-rank sdpa": ring / one <= 1.2 if paths[0] == "sdpa" else None,
             "ulysses (sdpa) at most 1.3x one-rank sdpa":
                 slowest[f"minipar ulysses ({paths[0]})"] / one <= 1.3 if paths[0] == "sdpa" else None}
    result = {"name": "cp", "baseline": base_name, "ranks": a.ranks, "rows": rows,
              "shape": {"b": a.batch, "T": T, "heads": a.heads, "d": a.head_dim},
              "ratio": ring / base, "ratio_vs_one_rank": ring / one, "goals": goals,
              "saved_bytes_per_rank": peak,
              "torch_cp": "ran" if torch_cp else f"not available here: {res[0]['torch_cp_error']}",
              "max_abs_diff": err}
    return report(result, a, intro=[
        f"causal attention, c={a.ranks} ranks x 1 thread, B={a.batch} T={T} heads={a.heads} "
        f"d={a.head_dim}; forward+backward, median of {repeats}, slowest rank; agree to {err:.1e}",
        f"torch.distributed.tensor.experimental.context_parallel: {result['torch_cp']}",
        f"torch sdpa, 1 rank (the whole sequence): {1e3 * one:.3g} ms/step, saved "
        f"{peak['torch sdpa, 1 rank'] / 1e6:.3g} MB" + (f"; torch context_parallel: {1e3 * torch_cp:.3g} ms/step"
                                                     if torch_cp else ""),
        "saved MB/rank: activation bytes kept for the backward on the rank that keeps most, "
        "and against one rank's (torch sdpa on the whole sequence)"],
        notes=[f"goal {k}: {'met' if ok else 'NOT met'}" for k, ok in goals.items() if ok is not None])
