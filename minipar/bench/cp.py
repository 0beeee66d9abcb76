"""``python -m minipar.bench cp``: ring attention at cp = 2 against full attention on one rank,
and against PyTorch's own context parallelism where it runs.

On c ranks (default 2, one thread each) every rank holds T/c tokens of the same causal
attention problem (B, heads, T, d). Timed, interleaved, forward + backward: minipar's ring
attention (zigzag), all-gather attention and Ulysses over the c ranks, and, on every rank,
full attention on the whole sequence (PyTorch's ``scaled_dot_product_attention`` and minipar's
``masked_attention``). PyTorch's ``torch.distributed.tensor.experimental.context_parallel``
is tried first; on Gloo/CPU it has no CPU attention kernel to shard (it says why, and the
output says so), and the ratio is then against full attention on one rank. Outputs are checked
against full attention before timing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import here, interleaved, median, parser, report


def _try_torch_cp(q, k, v, repeats):
    """Seconds per forward+backward of PyTorch's context parallelism, or the reason it cannot run."""
    import torch.distributed as dist
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh(here().type, (dist.get_world_size(),))
        bufs = [t.detach().clone() for t in (q, k, v)]

        def step():
            with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
                qs, ks, vs = (t.detach().requires_grad_() for t in bufs)
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).sum().backward()
        return median(interleaved({"torch cp": step}, repeats, warmup=1)["torch cp"]), None
    except Exception as e:   # noqa: BLE001 - the reason is the result
        msg = str(e).strip().splitlines()
        return None, f"{type(e).__name__}: {msg[0][:140] if msg else ''}"


def _rank(b, T, heads, d, repeats):
    from minipar import comm
    from minipar import context_parallel as cpm
    c, r = comm.group_size(), comm.group_rank()
    dev = here()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, T, d, generator=g).to(dev) for _ in range(3))
    local = {lay: [cpm.shard_sequence(t, r, c, lay, dim=2) for t in (q, k, v)] for lay in ("zigzag",)}
    want, _ = cpm.masked_attention(q, k, v, causal=True)
    err = 0.0
    for variant in cpm.VARIANTS:
        o, _ = cpm.context_attention(*local["zigzag"], None, True, "zigzag", variant)
        err = max(err, (o - cpm.shard_sequence(want, r, c, "zigzag", dim=2)).abs().max().item())

    def cp_step(variant):
        def run():
            ql, kl, vl = (t.detach().requires_grad_() for t in local["zigzag"])
            o, _ = cpm.context_attention(ql, kl, vl, None, True, "zigzag", variant)
            o.sum().backward()
        return run

    def full_step(fn):
        def run():
            qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
            fn(qs, ks, vs).sum().backward()
        return run

    fns = {f"minipar {v}": cp_step(v) for v in cpm.VARIANTS}
    fns["torch sdpa, 1 rank"] = full_step(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True))
    fns["minipar full, 1 rank"] = full_step(lambda *t: cpm.masked_attention(*t, causal=True)[0])
    out = {k: median(t) for k, t in interleaved(fns, repeats, warmup=2).items()}
    out["torch cp"], out["torch_cp_error"] = _try_torch_cp(q, k, v, repeats)
    out["max_abs_diff"] = err
    return out


def main(argv=None) -> dict:
    p = parser("cp", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="context-parallel size c (default 2)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=None, help="sequence length T (default 2048, --quick 512)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps each (default 10, --quick 4)")
    a = p.parse_args(argv)
    import minipar
    from minipar import context_parallel as cpm

    T = a.seq or (512 if a.quick else 2048)
    repeats = a.repeats or (4 if a.quick else 10)
    cpm.check_sequence(T, a.ranks, "zigzag")
    cpm.check_heads(a.heads, a.ranks)
    res = minipar.launch(_rank, a.ranks, args=(a.batch, T, a.heads, a.head_dim, repeats), timeout=600,
                         device=a.device)
    err = max(r["max_abs_diff"] for r in res)
    if err > 1e-4:
        raise RuntimeError(f"context-parallel attention disagrees with full attention: {err:.2e}")
    slowest = {k: max(r[k] for r in res) for k in res[0] if k not in ("torch_cp_error", "max_abs_diff")
               and res[0][k] is not None}
    torch_cp = slowest.get("torch cp")
    base_name = "torch context_parallel" if torch_cp else "torch sdpa, 1 rank"
    base = torch_cp or slowest["torch sdpa, 1 rank"]
    rows = [{"attention": k, "ranks": 1 if k.endswith("1 rank") else a.ranks, "ms": 1e3 * t,
             "ratio": t / base} for k, t in slowest.items()]
    result = {"name": "cp", "baseline": base_name, "ranks": a.ranks, "rows": rows,
              "shape": {"b": a.batch, "T": T, "heads": a.heads, "d": a.head_dim},
              "ratio": slowest["minipar ring"] / base,
              "ratio_vs_one_rank": slowest["minipar ring"] / slowest["torch sdpa, 1 rank"],
              "torch_cp": "ran" if torch_cp else f"not available here: {res[0]['torch_cp_error']}",
              "max_abs_diff": err}
    if not a.json:
        print(f"causal attention, c={a.ranks} ranks x 1 thread, B={a.batch} T={T} heads={a.heads} "
              f"d={a.head_dim}; forward+backward, median of {repeats}, slowest rank; agree to {err:.1e}")
        print(f"torch.distributed.tensor.experimental.context_parallel: {result['torch_cp']}")
    return report(result, a, ["attention", "ranks", "ms", "ratio"])
