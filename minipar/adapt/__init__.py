"""Chapter 12: parallelism that adapts while it trains.

* :mod:`.layout`: a layout written ``"dp=2,tp=2,zero=1"``, parsed and checked before launch;
* :mod:`.holdings`: which global elements of every parameter and optimizer slot a rank holds;
* :mod:`.moves`: the plan of moves between two layouts (local copies first, bytes counted);
* :mod:`.switch`: the live switch that carries the plan out with one all-to-all;
* :mod:`.train`: a run that switches layout at given steps (``check``/``train``/``run``);
* :mod:`.auto`, :mod:`.straggler`, :mod:`.runner`: the layouts to try, a slow rank, and
  :class:`Adaptive`, which the training command (:mod:`minipar.production.train`) drives;
* :mod:`.membership`, :mod:`.grow`: a rank joins or leaves a running job, the ranks that stay
  keep their process (``python -m minipar.adapt.grow``)."""
from .auto import decide, fit, propose
from .layout import Layout, parse, parse_switches, same_step
from .layout import check as check_layout
from .moves import Move, Plan, plan
from .runner import Adaptive
from .straggler import parse_slow
from .switch import reshard
from .train import check, run, segments, train

__all__ = ["Layout", "parse", "parse_switches", "same_step", "check_layout", "Move", "Plan", "plan", "reshard",
           "check", "run", "segments", "train", "Adaptive", "parse_slow", "propose", "fit", "decide"]
