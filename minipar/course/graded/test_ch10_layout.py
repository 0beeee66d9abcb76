"""Challenge 10: choose a layout as good as the planner's, without the planner's search.

``choose(model, cluster, nodes, global_batch, seq_len)`` returns a ``plan.Layout`` on all
the cluster's GPUs, with ``plan.search`` disabled while it runs. For Llama 3 8B on 2 DGX H100
nodes (64 × 8192 tokens), Llama 3 70B on 8 (512 × 8192) and GPT-3 13B on 4 Selene nodes
(256 × 2048), ``plan.predict`` must find it valid and fitting, with a step time within 10% of
the best that ``plan.search`` finds for the same job when the test runs. The library's own
answer is that search: ``choose`` may not call it, and the file may not import
``minipar.plan.search`` nor its enumerator ``plan.layouts``. Grade it with
``python -m minipar.grade ch10``; ``minipar.hint("ch10")`` gives a nudge, then the idea, then
the method.
"""
import sys

import pytest

from minipar import plan
from minipar.course.grading import GradeFailure, observes

CHALLENGE = "ch10_layout"
FORBIDDEN = ("minipar.plan.search", "minipar.plan.search_module",
             "minipar.plan.layouts", "minipar.plan.SearchResult")
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNoljkEOwjAMBL+yD6j4Ap9A4uw2WxKR2Ch2Qf09FhxXM1rNrdrhosVhO7qcdoRDJvGW3sqC9QgM8'
        '0A3J3abEEyKmyJdbKLwkCBWJiRek6Vt0fSBqBwX3GvbKkobVG+mnmK3pC1nYb6pFS7IBHx+6lNt/ScoZfYT+'
        'ySvX0YnPQY=',
        'sealed:eNotUMtOxDAM/JU5grRbiet+AFyQFvEQEjdv6lBr0yRy3Jbl63FbDpEjz3hm7HfOrSgqKaXESdqIU'
        'MZxyhLIuEEyeGa9IdGN9YQrc4UYFrHBMUIuPXf44tfz8QFtIO0bbGCUajLKLyuauRLInAr+MSX4i1FChzdOH'
        'ExmhrLb1smpUjJ6LXWXITPOW6+Foh4oelpC5AWVNTiGEvH4fH5pHT4Hd5GGxHGrQ1k2kaeXj4ZWk+e+sC3MG'
        'VYPqBWUe4SKu77C6Mq7p9vY/WH7jhK0HC9kYdi4a28WtYnSutc3t9N/mmHKvbKrOU369XYHMPlYyYyaKHfVY'
        'QnmjJQ6nBULpesJUcvoGn7fMpkb+ApRzKfXQHuIMvMODJz8LmNp1v0BVcCdmg==',
        'sealed:eNplkD1OxDAQha/yuiRStKusqECmQzQUNNCuHHtCrHXswXayWi5Gz8mYRPxJFPZ4bM+bb94QEwrDB'
        'XA8U8qIAw6YGSVCI0RLLZihg4X59+3syijVH+8sS56tW5x14QVlJNw/PuUWiUyceC601tYhBtHL5MkUt8hxm'
        'L1vWvTba9fiIMnyk7S4anAeKawIt+iu4fUFCux12D3oS5xLbVkF7PeofzlEo7AqvJIrlmBYGQlvlKIS3cmZF'
        'I+9LmZU/R9ElYx0V4sQmpHs7ElVLhRKnvRCtoIbBE44QD4Tqm7o+qq5AX8jcSLrTKknsc1LWz9nqW5Xaplx7'
        'bcO/9puvma17Q3qfHLiMJ61n+kupZhE80TEm42DK2W1VJz78lsuBSgX8E7k+VjcRLtPvDSZ2g==',
    ),
}
JOBS = [("llama3-8b", "dgx-h100", 2, 64, 8192), ("llama3-70b", "dgx-h100", 8, 512, 8192),
        ("gpt3-13b", "selene", 4, 256, 2048)]
WITHIN = 1.10


def _no_search(*_, **__):
    raise GradeFailure("choose() called plan.search, which this challenge is graded without "
                       "(plan.predict and plan.memory_per_gpu are allowed)")


def _choose(challenge, job, monkeypatch):
    model, cluster, nodes, batch, seq = job
    with monkeypatch.context() as m:
        m.setattr(plan, "search", _no_search)
        m.setattr(sys.modules["minipar.plan.search"], "search", _no_search)
        lay = challenge.choose(model, cluster, nodes, batch, seq)
    if not isinstance(lay, plan.Layout):
        raise GradeFailure(f"{model} on {nodes} × {cluster}: choose returned {type(lay).__name__}, not a plan.Layout")
    world = nodes * plan.CLUSTERS[cluster].gpus_per_node
    if lay.world != world:
        raise GradeFailure(f"{model} on {nodes} × {cluster}: layout {lay} uses {lay.world} GPUs, the cluster has {world}")
    try:
        return lay, plan.predict(model, cluster, lay, batch, seq, nodes=nodes)
    except ValueError as e:
        raise GradeFailure(f"{model} on {nodes} × {cluster}: layout {lay} cannot run: {e}") from None


@pytest.mark.parametrize("job", JOBS, ids=[j[0] for j in JOBS])
@observes('ch10.*.fits', 'ch10.*.near_best')
def test_fits_and_is_near_the_best(challenge, job, monkeypatch):
    """The chosen layout fits, and its predicted step is within 10% of plan.search's best."""
    model, cluster, nodes, batch, seq = job
    lay, got = _choose(challenge, job, monkeypatch)
    if not got.fits:
        raise GradeFailure(f"{model} on {nodes} × {cluster}: {lay} does not fit: {got.reason}")
    best = plan.search(model, cluster, batch, seq, nodes=nodes).best
    ratio = got.step_time / best.step_time
    if ratio > WITHIN:
        raise GradeFailure(f"{model} on {nodes} × {cluster}: predicted step {got.step_time:.2f} s with {lay}, "
                           f"{ratio:.2f} × the planner's best {best.step_time:.2f} s ({best.layout}); the goal "
                           f"is at most {WITHIN:.2f} ×\n  where the time goes, yours: "
                           + ", ".join(f"{k} {v:.2f} s" for k, v in got.components().items() if v)
                           + "\n  the best's: " + ", ".join(f"{k} {v:.2f} s" for k, v in best.components().items() if v))
