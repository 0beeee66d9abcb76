"""The checks of ``python3 course.py test --gpu --first`` (``python -m minipar.course.first_gpu
attention|bench NAME|refusals``), each printing one line per case and exiting 1 if one failed.

* ``attention``: minipar's fused attention (:func:`minipar.models.attention.fused_attention`,
  PyTorch's memory-efficient kernel called directly, forward and backward) against autograd
  through ``torch.nn.functional.scaled_dot_product_attention`` in fp32 on the same rounded
  inputs, in fp32, fp16 and bf16, causal and with a positions' mask: O, dQ, dK, dV within the
  dtype's rounding (bf16 below sm80 takes the fp32 fallback, and says so).
* ``bench NAME`` (``refusals``: all of them, in turn): the benchmark with ``--smoke --device cuda``:
  it runs (its ranks sharing the GPU where it can), or refuses in one line with exit code 2
  saying what it needs; anything else (a traceback) fails.
"""
from __future__ import annotations

import subprocess
import sys

TOL = {"fp32": (1e-4, 1e-5), "fp16": (1e-2, 4e-3), "bf16": (4e-2, 3e-2)}  # (rtol, atol)


def attention() -> int:
    import torch
    import torch.nn.functional as F

    from ..models import attention as attn
    from ..runtime.pool import deterministic_cuda
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return 1
    deterministic_cuda()
    failed, g = 0, torch.Generator().manual_seed(0)
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for mask in ("causal", "positions"):
            q, k, v, w = (torch.randn(2, 4, 80, 16, generator=g).to("cuda", dtype) for _ in range(4))
            pos = torch.randperm(80, generator=g).cuda() if mask == "positions" else None
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            o, _ = attn.fused_attention(*leaves, mask == "causal", pos, pos)
            (o * w).sum().backward()
            ref = [t.float().clone().requires_grad_() for t in (q, k, v)]
            allowed = None if pos is None else pos[None, :] <= pos[:, None]
            o_ref = F.scaled_dot_product_attention(*ref, attn_mask=allowed, is_causal=pos is None)
            (o_ref * w.float()).sum().backward()
            rtol, atol = TOL[name]
            errs = {n: (a.float() - b).abs().max().item()
                    for n, a, b in zip(("O", "dQ", "dK", "dV"), (o, *(t.grad for t in leaves)),
                                       (o_ref, *(t.grad for t in ref)))}
            ok = all(torch.allclose(a.float(), b, rtol=rtol, atol=atol)
                     for a, b in zip((o, *(t.grad for t in leaves)), (o_ref, *(t.grad for t in ref))))
            failed += not ok
            print(f"{name} {mask:<9} " + " ".join(f"|d{n}| {e:.1e}" for n, e in errs.items())
                  + ("  ok" if ok else f"  FAIL (rtol {rtol}, atol {atol})"))
    return 1 if failed else 0


def bench(name: str, timeout: float = 140) -> int:
    """One benchmark at ``--smoke --device cuda``: it ran (its ratio printed), or refused in one
    line with exit code 2 (what it needs); a traceback, another exit code or a hang fails."""
    cmd = [sys.executable, "-m", "minipar.bench", name, "--smoke", "--device", "cuda"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{name:<12} FAIL: still running after {timeout:.0f} s at --smoke")
        return 1
    err, out = p.stderr.strip().splitlines(), p.stdout.strip().splitlines()
    if p.returncode == 0:
        ratio = next((line for line in reversed(out) if line.startswith("ratio")), "")
        print(f"{name:<12} ran {ratio[:110]}")
        return 0
    if p.returncode == 2 and err and "Traceback" not in p.stderr:
        print(f"{name:<12} refused: {err[-1][:160]}")
        return 0
    print(f"{name:<12} FAIL (exit {p.returncode}): {(err or ['?'])[-1][:110]}")
    return 1


def refusals() -> int:
    """Every benchmark, one after the other (:func:`bench`); ``--first`` runs them side by side."""
    from ..bench.__main__ import available
    return 1 if sum(bench(name) for name in available()) else 0


if __name__ == "__main__":
    what = sys.argv[1]
    sys.exit(bench(sys.argv[2]) if what == "bench" else {"attention": attention, "refusals": refusals}[what]())
