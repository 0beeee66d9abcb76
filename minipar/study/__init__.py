"""Studies of the core: what a chapter shows about its strategy, kept beside it, never inside it.

* :mod:`.plots` — the chapters' figures (``plots.pipeline``, ``plots.hybrid``,
  ``plots.context_parallel``, ``plots.expert_parallel``);
* :mod:`.compare` — every strategy trained side by side on one model and world, measured
  (chapter 07's table, predicted by :mod:`minipar.plan.course`);
* :mod:`.layouts` — a planner's :class:`minipar.plan.Layout` run at toy size on CPU ranks.

Built on the core (it imports the strategy packages; no strategy imports it), in the same layer
as ``plan/``, ``production/``, ``adapt/`` and ``bench/``.
"""
from .compare import compare, strategies
from .layouts import toy_command, toy_options, toy_run

__all__ = ["compare", "strategies", "toy_options", "toy_command", "toy_run"]
