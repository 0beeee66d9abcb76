"""A layout, written the same way everywhere: ``"dp=2,tp=2"``, ``"pp=2,tp=2,zero=1"``.

A layout names the degree of each mesh dimension (``dp``, ``pp``, ``tp``, ``cp``, and ``ep``, the
experts' split carved out of dp·cp; a missing one is 1), the ZeRO stage (``zero``, 0-3), stage
3's ``sharding`` (``flat`` or ``per-parameter``), HSDP's ``dp_shard`` (stage 3 within groups of
``dp_shard`` ranks, replicated across them) and, optionally, the pipeline's micro-batches
(``m``; by default ``pp``, so a pipeline is never run as one micro-batch). The global batch is
not part of a layout: it is the run's, so every layout trains the same step as one process
(each dp rank takes 1/dp of it, cut into m micro-batches).

:func:`parse` turns the text into a :class:`Layout`, :func:`check` refuses one that cannot run on
``world_size`` ranks with a plain error (before any process starts), and
:func:`parse_switches` reads ``STEP=LAYOUT`` (``--switch-at``'s argument)."""
from __future__ import annotations

from dataclasses import dataclass

from ..mesh import ProcessMesh

KEYS = ("dp", "pp", "tp", "cp", "ep", "zero", "sharding", "dp_shard", "m")
SHARDINGS = ("flat", "per-parameter")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sharding: str = "flat"
    dp_shard: int | None = None   # HSDP: ZeRO-3 within groups of dp_shard ranks; None: all of dp
    m: int | None = None          # micro-batches; None: pp

    @property
    def size(self) -> int:
        """The ranks the layout needs: dp·pp·tp·cp."""
        return self.dp * self.pp * self.tp * self.cp

    @property
    def microbatches(self) -> int:
        return self.m or self.pp

    def options(self) -> dict:
        """The :class:`~minipar.hybrid.HybridModel` keywords of this layout (its mesh: :meth:`mesh`)."""
        return {"zero": self.zero, "microbatches": self.microbatches, "sharding": self.sharding,
                "dp_shard": self.dp_shard}

    def mesh(self):
        """This layout's :class:`~minipar.mesh.ProcessMesh`, its groups built (a collective)."""
        return ProcessMesh(dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp, ep=self.ep).build()

    def __str__(self) -> str:
        shown = [f"{k}={getattr(self, k)}" for k in ("dp", "pp", "tp", "cp", "ep") if getattr(self, k) > 1]
        shown += [f"zero={self.zero}"] if self.zero else []
        shown += [f"sharding={self.sharding}"] if self.sharding != "flat" else []
        shown += [f"dp_shard={self.dp_shard}"] if self.dp_shard is not None else []
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
        if key == "sharding":
            if value not in SHARDINGS:
                raise ValueError(f"layout {text!r}: sharding is one of {SHARDINGS}, got {value!r}")
            values[key] = value
            continue
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


def same_step(old: Layout, new: Layout, config) -> str | None:
    """Why a switch from ``old`` to ``new`` would not continue one process's training (``None``: it
    does). A dense GPT's step is the global batch's mean whatever the layout. A mixture of experts
    counts routing per micro-batch (capacity ``C_i = ceil(k·S_i/E·c)`` and the auxiliary loss,
    :mod:`minipar.hybrid.experts`): its step is that of :func:`~minipar.hybrid.experts.moe_reference`
    on the layout's micro-batches, the same after the switch only if the micro-batches hold the same
    rows (one micro-batch, or the same dp and m)."""
    if not getattr(config, "moe_every", 0):
        return None
    a, b = (old.dp, old.microbatches), (new.dp, new.microbatches)
    if a == b or old.microbatches == new.microbatches == 1:
        return None
    what = ("the tokens dropped over capacity and the auxiliary loss" if getattr(config, "capacity_factor", None)
            else "the auxiliary loss")
    return (f"a mixture of experts routes each micro-batch on its own (capacity and the auxiliary loss per "
            f"micro-batch): {old} cuts the batch into dp·m = {a[0]}·{a[1]} micro-batch parts, {new} into "
            f"{b[0]}·{b[1]}, so the micro-batches hold other rows and the steps after the switch would "
            f"not be the run's ({what} would differ); keep m = 1, or dp and m, across the switch")


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

