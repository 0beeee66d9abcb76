"""A layout, written the same way everywhere: ``"dp=2,tp=2"``, ``"pp=2,tp=2,zero=1"``.

A layout names the degree of each mesh dimension (``dp``, ``pp``, ``tp``, ``cp``; a missing one
is 1), the ZeRO stage (``zero``, 0 or 1 here) and, optionally, the pipeline's micro-batches
(``m``; by default ``pp``, so a pipeline is never run as one micro-batch). The global batch is
not part of a layout: it is the run's, so every layout trains the same step as one process
(each dp rank takes 1/dp of it, cut into m micro-batches).

:func:`parse` turns the text into a :class:`Layout`, :func:`check` refuses one that cannot run on
``world_size`` ranks with a plain error (before any process starts), and
:func:`parse_switches` reads ``STEP=LAYOUT`` (``--switch-at``'s argument)."""
from __future__ import annotations

from dataclasses import dataclass

KEYS = ("dp", "pp", "tp", "cp", "zero", "m")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    zero: int = 0
    m: int | None = None          # micro-batches; None: pp

    @property
    def size(self) -> int:
        """The ranks the layout needs: dp·pp·tp·cp."""
        return self.dp * self.pp * self.tp * self.cp

    @property
    def microbatches(self) -> int:
        return self.m or self.pp

    def options(self) -> dict:
        """The :class:`~minipar.hybrid.HybridModel` keywords of this layout."""
        return {"zero": self.zero, "microbatches": self.microbatches}

    def __str__(self) -> str:
        shown = [f"{k}={getattr(self, k)}" for k in ("dp", "pp", "tp", "cp") if getattr(self, k) > 1]
        shown += [f"zero={self.zero}"] if self.zero else []
        shown += [f"m={self.m}"] if self.m else []
        return ",".join(shown) or "dp=1"


def parse(text: str | Layout) -> Layout:
    """``"dp=2,tp=2,zero=1"`` → ``Layout(dp=2, tp=2, zero=1)``; a plain error names a bad part."""
    if isinstance(text, Layout):
        return text
    values = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in KEYS:
            raise ValueError(f"layout {text!r}: {part!r} is not KEY=N with KEY one of {KEYS}")
        if key in values:
            raise ValueError(f"layout {text!r}: {key} is given twice")
        if not value.isdigit() or (int(value) < 1 and key != "zero"):
            raise ValueError(f"layout {text!r}: {key} must be a positive integer, got {value!r}")
        values[key] = int(value)
    if not values:
        raise ValueError(f"layout {text!r} names no dimension")
    return Layout(**values)


def check(layout: Layout, world_size: int, batch_size: int | None = None) -> None:
    """Refuse ``layout`` on ``world_size`` ranks (and a global batch of ``batch_size``), plainly."""
    if layout.size != world_size:
        raise ValueError(f"layout {layout}: dp·pp·tp·cp = {layout.size}, but the job has {world_size} ranks")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"layout {layout}: the ZeRO stage is 0, 1, 2 or 3, got zero={layout.zero}")
    if batch_size is not None and batch_size % (layout.dp * layout.microbatches):
        raise ValueError(f"layout {layout}: the global batch {batch_size} does not split into "
                         f"dp·m = {layout.dp}·{layout.microbatches} equal micro-batches")


def parse_switches(items, steps: int | None = None) -> list[tuple[int, Layout]]:
    """``["2=dp=2,tp=2", "4=pp=2,tp=2"]`` → ``[(2, Layout(dp=2, tp=2)), (4, ...)]``, in step order:
    after step ``STEP`` (counted from 1) has finished, the job moves to ``LAYOUT``. A step must lie
    inside the run (``0 < STEP < steps``) and appear once."""
    out = []
    for item in items or ():
        step, eq, text = str(item).partition("=")
        if not eq or not step.strip().isdigit():
            raise ValueError(f"switch {item!r}: expected STEP=LAYOUT, e.g. 2=dp=2,tp=2")
        out.append((int(step), parse(text)))
    out.sort(key=lambda s: s[0])
    for (a, _), (b, _) in zip(out, out[1:]):
        if a == b:
            raise ValueError(f"two switches after step {a}")
    for step, layout in out:
        if step < 1 or (steps is not None and step >= steps):
            raise ValueError(f"switch after step {step} ({layout}) lies outside the run's {steps} steps: "
                             f"it must be 1..{(steps or 2) - 1}")
    return out

