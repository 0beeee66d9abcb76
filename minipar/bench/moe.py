"""``python -m minipar.bench moe``: expert parallelism (ep = 2) against one rank, and minipar's
token dispatch against one written directly on PyTorch's ``all_to_all_single``.

Three ways to run the same MoE layer (E experts, top-k, dropless), forward + backward, timed
interleaved on every rank of an ep = 2 group, after checking that all three give the same output:

* **minipar EP**: :class:`~minipar.expert_parallel.ExpertParallelMoE` (counts all-gathered,
  tokens sorted by expert, recorded all-to-alls with their backward written out);
* **baseline (torch dispatch)**: the same routing and experts with a dispatch in the manner of
  torchtitan's ``AllToAllTokenDispatcher``: per-expert counts exchanged with ``all_to_all_single``,
  tokens and results moved with PyTorch's autograd-aware
  ``_functional_collectives.all_to_all_single_autograd`` (what torchtitan uses), nothing recorded;
* **one rank**: the single-device :class:`~minipar.models.moe.MoE` on the whole group's tokens
  (both ranks' rows) with all E experts: the work EP splits in two.

The ratio is minipar EP / baseline (same math, so it measures the dispatch's overhead); timings on
a shared CPU are noisy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import expert_parallel as xp
from ..runtime.launch import launch
from ..models.moe import MoE, route
from .common import (backward_step, interleaved, median, placement, parser, report, row,
                     size, to_here)

# with fewer GPUs than ranks the ranks share them (Gloo through host memory), and then:
SHARED_GPU = ("Gloo's all_to_all stages CUDA tensors through host memory for PyTorch's dispatch as minipar's "
              "staging does for its own; the ratio is the dispatch's overhead there")


def _torch_dispatch(moe, x, group=None):
    """The layer ``moe`` (an :class:`~minipar.expert_parallel.ExpertParallelMoE`) with a dispatch
    built directly on torch.distributed (dropless)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd  # deferred: PyTorch's own baseline, loaded only when this benchmark runs it
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    E, k, n_local = moe.n_experts, moe.top_k, moe.n_experts // ep
    xf = x.reshape(-1, x.shape[-1])
    _, w, experts = route(moe.router(xf), k)
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    tokens_per_expert = torch.bincount(flat, minlength=E)
    got = torch.empty_like(tokens_per_expert)                 # [source, local expert] counts
    dist.all_to_all_single(got, tokens_per_expert, group=group)
    got = got.view(ep, n_local)
    send, recv = tokens_per_expert.view(ep, n_local).sum(1).tolist(), got.sum(1).tolist()
    arrived = all_to_all_single_autograd(xf[order.div(k, rounding_mode="floor")], recv, send,
                                         group or dist.group.WORLD)
    local = torch.arange(n_local, device=x.device).repeat(ep).repeat_interleave(got.reshape(-1))
    by_expert = local.argsort(stable=True)                   # arrived rows, grouped by local expert
    outs = torch.cat([moe.experts[str(me * n_local + i)](c)
                      for i, c in enumerate(arrived[by_expert].split(got.sum(0).tolist()))])
    back = torch.empty_like(outs).index_copy(0, by_expert, outs)
    home = all_to_all_single_autograd(back, send, recv, group or dist.group.WORLD)
    result = torch.empty_like(home).index_copy(0, order, home)
    token_of = torch.arange(xf.shape[0], device=x.device).repeat_interleave(k)
    return torch.zeros_like(xf).index_add(0, token_of, result * w.reshape(-1, 1)).view_as(x)


def _rank(tokens, h, E, k, repeats):
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    single = to_here(MoE(h, E, k, None))
    torch.manual_seed(0)
    ep_layer = xp.ExpertParallelMoE(to_here(MoE(h, E, k, None)))
    x_all = to_here(torch.randn(n * tokens, h, generator=torch.Generator().manual_seed(1), device="cpu"))
    x = x_all.chunk(n)[r]
    with torch.no_grad():
        want = single(x_all).chunk(n)[r]
        err = max((ep_layer(x) - want).abs().max().item(),
                  (_torch_dispatch(ep_layer, x) - want).abs().max().item())
    fns = {"minipar EP": backward_step(ep_layer, x, module=ep_layer),
           "torch dispatch EP": backward_step(lambda xi: _torch_dispatch(ep_layer, xi), x, module=ep_layer),
           "one rank, all tokens": backward_step(single, x_all, module=single)}
    return {**{name: median(t) for name, t in interleaved(fns, repeats=repeats, warmup=2).items()},
            "max_abs_diff": err}


def main(argv=None) -> dict:
    p = parser("moe", __doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 2048, --quick 512, --smoke 32)")
    p.add_argument("--hidden", type=int, default=None, help="default 128, --smoke 16")
    p.add_argument("--experts", type=int, default=None, help="default 8, --smoke 4")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="timed steps each (default 20, --quick 6, --smoke 1)")
    a = p.parse_args(argv)
    placement(p, a.device, 2, shares=SHARED_GPU)
    tokens, repeats = a.tokens or size(a, 2048, 512, 32), a.repeats or size(a, 20, 6, 1)
    a.hidden, a.experts = a.hidden or size(a, 128, 128, 16), a.experts or size(a, 8, 8, 4)
    res = launch(_rank, 2, args=(tokens, a.hidden, a.experts, a.top_k, repeats), timeout=600, device=a.device)
    slowest = {nm: max(r[nm] for r in res) for nm in res[0] if nm != "max_abs_diff"}  # the slowest rank's
    rows = [row(slowest["minipar EP"], slowest[nm], implementation="minipar EP", against=nm)
            for nm in ("torch dispatch EP", "one rank, all tokens")]
    err = max(r["max_abs_diff"] for r in res)
    if err > 1e-4:
        raise AssertionError(f"the implementations disagree (max abs diff {err:g})")
    result = {"rows": rows, "ratio": slowest["minipar EP"] / slowest["torch dispatch EP"],
              "baseline": "torch dispatch EP", "ep": 2, "tokens_per_rank": tokens, "hidden": a.hidden,
              "experts": a.experts, "top_k": a.top_k, "max_abs_diff": err,
              "speedup_vs_one_rank": slowest["one rank, all tokens"] / slowest["minipar EP"]}
    return report(result, a, notes=[
        f"EP (ep=2) vs one rank holding all experts and tokens: {result['speedup_vs_one_rank']:.2f}x"])
