"""Search: every valid layout for a model on a cluster, the ones that fit, ranked.

:func:`search` enumerates ``dp·tp·pp·cp = N`` (tp inside a node), the expert-parallel size,
the ZeRO stage (ZeRO-3 under a pipeline too; ``policies=True``, ``hsdp=True``: either
``reshard_after_forward`` policy and HSDP's splits), the micro-batch, the recomputation and the
schedule (1F1B, or interleaved with v virtual stages), predicts each
(:func:`minipar.plan.predict`), rejects what cannot run or does not fit, each with its
reason, and ranks the rest by predicted step time.
:meth:`SearchResult.explain` says why the winner beats the runner-up: where their steps differ most,
and each one's bottleneck (:attr:`Prediction.bottleneck`: compute-bound, memory-bound, exposed
communication on which link, or the bubble). Layouts within :data:`NEAR_TIE` (2%) of each other
are a near-tie, not a ranking the model can vouch for: within such a group the one with more
memory headroom comes first, and :meth:`~SearchResult.explain` says so.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .hardware import get_cluster
from .layout import Layout, problems
from .models import get_model
from .predict import Prediction, predict


NEAR_TIE = 0.02


def rank(predictions: list[Prediction]) -> list[Prediction]:
    """By step time; within a near-tie (each within :data:`NEAR_TIE` of its group's fastest) by memory."""
    ordered, out, group = sorted(predictions, key=lambda p: (p.step_time, p.memory["total"])), [], []
    for p in ordered:
        if group and p.step_time > (1 + NEAR_TIE) * group[0].step_time:
            out += sorted(group, key=lambda q: (q.memory["total"], q.step_time))
            group = []
        group.append(p)
    return out + sorted(group, key=lambda q: (q.memory["total"], q.step_time))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchResult:
    ranked: list[Prediction]                       # fitting layouts, fastest first
    rejected: list[tuple[Layout, str]] = field(default_factory=list)   # (layout, reason)

    @property
    def best(self) -> Prediction:
        if not self.ranked:
            reasons = sorted({r for _, r in self.rejected})[:5]
            raise ValueError("no layout fits: " + "; ".join(reasons))
        return self.ranked[0]

    def explain(self) -> str:
        """The winner, the runner-up, and where their step times differ."""
        if len(self.ranked) < 2:
            return str(self.best) + "\n(no runner-up: it is the only layout that fits)"
        a, b = self.ranked[0], self.ranked[1]
        ca, cb = a.components(), b.components()
        diffs = sorted(((cb.get(k, 0.0) - ca.get(k, 0.0), k) for k in set(ca) | set(cb)), reverse=True)
        why = ", ".join(f"{k} {1e3 * d:+.1f} ms" for d, k in diffs if abs(d) > 1e-3 * a.step_time)
        tie = ""
        if self.near_tie(a, b):
            free = lambda p: p.usable * p.hbm - p.memory["total"]   # noqa: E731
            tie = (f"\nnear-tie: within {NEAR_TIE:.0%} of each other, closer than the model can rank; "
                   f"broken by memory headroom ({free(a) / 1e9:.1f} GB free against {free(b) / 1e9:.1f} GB)")
        return (f"winner     {a.layout}: {1e3 * a.step_time:.1f} ms, {a.memory['total'] / 1e9:.1f} GB; "
                f"bottleneck {a.bottleneck}\n"
                f"runner-up  {b.layout}: {1e3 * b.step_time:.1f} ms ({b.step_time / a.step_time - 1:+.1%}), "
                f"{b.memory['total'] / 1e9:.1f} GB; bottleneck {b.bottleneck}\n"
                f"the runner-up spends more (or less) on: {why or 'nothing measurable'}" + tie)

    @staticmethod
    def near_tie(a: Prediction, b: Prediction) -> bool:
        return abs(a.step_time - b.step_time) <= NEAR_TIE * min(a.step_time, b.step_time)

    def table(self, n: int = 10) -> list[dict]:
        """The first ``n`` ranked layouts as rows (for a figure or a DataFrame)."""
        return [{"layout": str(p.layout), "step_s": p.step_time, "memory_GB": p.memory["total"] / 1e9,
                 "TFLOP/s": p.tflops_per_gpu, "MFU": p.mfu, "bottleneck": p.bottleneck,
                 "near_tie": i > 0 and self.near_tie(self.ranked[0], p)} for i, p in enumerate(self.ranked[:n])]


def layouts(model, n_gpus: int, gpus_per_node: int, global_batch: int, seq_len: int,
            dtype: str = "bf16", micro_batches=(1, 2, 4, 8), recompute=("none", "selective", "full"),
            zero=(0, 1, 2, 3), virtual=(1, 2, 4), max_cp: int = 16, flash: bool = False,
            overlap_tp="auto", policies: bool = False, hsdp: bool = False):
    """Every combination of the knobs (invalid ones included; :func:`search` filters);
    ``flash``: leave out selective recomputation, which flash attention makes the same run as none;
    ``overlap_tp``: whether the framework overlaps sequence parallelism's gathers and scatters with
    their GEMMs (:meth:`Layout.tp_overlap_on`; ``"auto"``: on a GPU). ZeRO-3 comes with its ``"auto"``
    policy (kept gathered under a pipeline, the library's default); ``policies=True`` adds the other
    ``reshard_after_forward`` (with m > 1 micro-batches: resharding under a pipeline, kept gathered
    without one), ``hsdp=True`` every HSDP split ``dp_shard`` = S, 1 < S < dp (both off by default:
    each multiplies the ZeRO-3 layouts to predict)."""
    spec = get_model(model)
    for tp, cp, pp in itertools.product(_divisors(min(n_gpus, gpus_per_node)), _divisors(n_gpus),
                                        _divisors(n_gpus)):
        if n_gpus % (tp * cp * pp) or cp > max_cp or pp > spec.n_layer:
            continue
        dp = n_gpus // (tp * cp * pp)
        eps = [e for e in _divisors(spec.n_experts) if (dp * cp) % e == 0]
        for ep, z, b, rc, v in itertools.product(eps, zero, micro_batches, recompute, virtual):
            if (pp == 1 and v > 1) or (dp * cp == 1 and z) or (rc == "selective" and flash):
                continue   # under flash attention selective recomputation is "none" (no scores to drop)
            lay = Layout(dp=dp, tp=tp, pp=pp, v=v, cp=cp, ep=ep, zero=z, micro_batch=b, recompute=rc,
                         dtype=dtype, schedule="interleaved" if v > 1 else "1f1b", overlap_tp=overlap_tp)
            yield lay
            if z != 3:
                continue
            other = ["always" if pp > 1 else "never"] if policies and global_batch // (dp * b) > 1 else []
            shards = [None] + ([S for S in _divisors(dp) if 1 < S < dp] if hsdp and ep == 1 else [])
            for policy, S in itertools.product(["auto"] + other, shards):
                if policy != "auto" or S is not None:
                    yield lay.replace(reshard_after_forward=policy, dp_shard=S)


def search(model, cluster, global_batch: int, seq_len: int | None = None, nodes: int | None = None,
           efficiency=None, **knobs) -> SearchResult:
    """Rank every layout that runs ``model`` on all of ``cluster``'s GPUs and fits in memory
    (``knobs`` restrict the enumeration: ``micro_batches=``, ``recompute=``, ``zero=``, ...)."""
    spec, cl = get_model(model), get_cluster(cluster, nodes)
    s = seq_len or spec.seq_len
    ranked, rejected = [], []
    knobs.setdefault("flash", Layout().attention_on(cl.gpu) == "flash")
    for lay in layouts(spec, cl.world, cl.gpus_per_node, global_batch, s, **knobs):
        found = problems(spec, lay, global_batch, s)
        if found:
            rejected.append((lay, "; ".join(found)))
            continue
        p = predict(spec, cl, lay, global_batch, s, efficiency)
        (ranked if p.fits else rejected).append(p if p.fits else (lay, p.reason))
    return SearchResult(rank(ranked), rejected)
