"""Pipeline schedules as data: for every rank, the list of actions it performs in order.

A model cut into ``S = p·v`` stages runs on ``p`` ranks; stage ``s`` lives on rank
``s % p`` (so with ``v`` virtual stages per rank, rank r holds stages r, r+p, r+2p...).
A batch is cut into ``m`` micro-batches. An :class:`Action` is one of

* ``F`` forward of micro-batch i on stage s, ``B`` its backward, ``W`` (zero-bubble
  schedules only) the weight-gradient part of the backward, ``B`` then being the
  input-gradient part;
* ``SEND_F``/``RECV_F`` the activation leaving/entering stage s, ``SEND_B``/``RECV_B``
  the gradient leaving/entering stage s, with ``peer`` the other rank (group-local).

The generators below return each rank's *compute* order; :func:`add_comms` adds the sends
and receives that make it runnable (a send is never waited on; under NCCL the executor posts
the receives earlier, :mod:`.posting`). The same :class:`Schedule` drives
:class:`minipar.pipeline.Pipeline` (real training) and :func:`minipar.pipeline.simulate`.

* GPipe / all-forward-all-backward (Huang et al. 2019): all m forwards, then all m
  backwards. Every rank stashes m micro-batches.
* 1F1B (PipeDream-Flush, Narayanan et al. 2021): each rank starts backwards as early as the
  pipeline allows. Rank r stashes at most ``min(p - r, m)``. Same bubble as GPipe.
* Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v >= 2 virtual stages per rank, the
  micro-batches go round the ranks v times in groups of p; the bubble shrinks to
  (p-1)/(v·m). Needs ``m % p == 0``.
* ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward is split into
  B (input gradient, on the critical path) and W (weight gradient, free to move); W fills
  the cool-down bubble. B keeps each linear layer's input X and output gradient ∂L/∂Y, and
  W computes only ∂L/∂W = (∂L/∂Y)ᵀ X from them (:mod:`minipar.autograd.split_backward`).
  Bubble (p-1)(F+B-W) instead of 1F1B's (p-1)(F+B+W), a third of it when F = B = W, at
  1F1B's peak memory (p micro-batches on the busiest rank).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.pipeline import SCHEDULES  # the schedules' names, one list for the formulas too

COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    op: str            # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B
    microbatch: int
    stage: int
    peer: int | None = None

    def __repr__(self) -> str:
        peer = "" if self.peer is None else f"->{self.peer}" if "SEND" in self.op else f"<-{self.peer}"
        return f"{self.op}{self.microbatch}s{self.stage}{peer}"


def message(a: Action) -> tuple[str, int, int]:
    """The message a SEND posts or a RECV waits for: (kind, micro-batch, sending stage)."""
    if a.op == "RECV_F":
        return "F", a.microbatch, a.stage - 1
    if a.op == "RECV_B":
        return "B", a.microbatch, a.stage + 1
    return a.op[-1], a.microbatch, a.stage


def check_config(name: str, p: int, m: int, v: int = 1, n_layers: int | None = None) -> None:
    """Raise a plain ValueError for a configuration no schedule can run."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1 stages, m >= 1 micro-batches and v >= 1, got p={p}, m={m}, v={v}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"v={v} virtual stages needs the 'interleaved' schedule, not {name!r}")
    if name == "interleaved" and v < 2:
        raise ValueError("interleaved 1F1B needs v >= 2 virtual stages per rank "
                         "(with v=1 it is not 1F1B: use the '1f1b' schedule)")
    if name == "interleaved" and m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches round the ranks in groups of p={p}: "
                         f"m={m} micro-batches is not a multiple of p (try m={p * -(-m // p)})")
    if n_layers is not None and p * v > n_layers:
        raise ValueError(f"{p * v} stages (p={p} x v={v}) but the model has only {n_layers} layers: "
                         "every stage needs at least one layer")


# ------------------------------------------------------------------ compute orders
def gpipe(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (micro-batches in order)."""
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]


# Contract:
# Given: the result is ``rank``'s compute order, a list of ``Action("F", i, rank)`` and
#     ``Action("B", i, rank)`` for the m micro-batches (``rank`` holds stage ``rank``).
# ex04.B.valid: every rank's order has exactly 2m actions, one F and one B of each micro-batch
#     0..m-1 on its own stage, the Fs in micro-batch order and the Bs too, each F before its B;
#     with sends and receives added (``add_comms``) the p ranks' orders run without deadlock
#     (``pipeline.check_schedule``), for every p and m, m < p included.
# ex04.B.bubble: it keeps GPipe's bubble, (p-1)/m of the busy time (``pipeline.bubble``).
# ex04.B.memory: at no point of its order does rank r hold the activations of more than
#     min(p - r, m) micro-batches (held from a micro-batch's F to its B; ``pipeline.peak_stash``).
# ex04.B.own: the order is built here, without calling the library's other schedules
#     (``gpipe``, ``zb_h1``, ``interleaved_1f1b``, or ``make_schedule``, which calls them).
def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """1F1B's compute order on ``rank`` of ``p`` for ``m`` micro-batches: GPipe's bubble, at most
    ``min(p - rank, m)`` micro-batches held."""
    # >>> ex04 B
    warmup = min(p - rank - 1, m)
    out = [Action("F", i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", warmup + i, rank), Action("B", i, rank)]
    out += [Action("B", i, rank) for i in range(m - warmup, m)]
    return out
    # <<< ex04 B


def interleaved_1f1b(p: int, m: int, rank: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B on ``rank``: the micro-batches go round the ranks v times in
    groups of p, forwards through the virtual chunks in order, backwards in reverse. Its order is
    :func:`one_f_one_b`'s over the rank's m·v units of work (unit k: ``unit(k, forward)``), the
    first of those orders with more than ``warmup`` forwards before its first backward (enough for
    every chunk to have work; all of them when m = p)."""
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v if forward else v - 1 - (k // p) % v
        return (k // (p * v)) * p + k % p, chunk * p + rank

    def ahead(order):                       # forwards before the first backward
        return next((k for k, a in enumerate(order) if a.op == "B"), len(order))
    warmup = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = next(o for n in range(1, total + 2) if ahead(o := one_f_one_b(n, total, 0)) > min(warmup, total - 1))
    return [Action(a.op, *unit(a.microbatch, a.op == "F")) for a in order]


def zb_h1(p: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 on ``rank``: :func:`one_f_one_b`'s order with each backward split into B and W. While
    forwards still come, rank r keeps up to r Ws waiting (they fill the bubble a later rank would
    leave); once they stop, each W follows its B. It holds no more micro-batches than 1F1B."""
    order = one_f_one_b(p, m, rank)
    last_f = max((k for k, a in enumerate(order) if a.op == "F"), default=-1)
    paired = any(a.op == "B" for a in order[:last_f])      # a B between forwards: a steady state
    out, pending = [], []
    for k, a in enumerate(order):
        out.append(a)
        if a.op != "B":
            continue
        pending.append(a.microbatch)
        if k > last_f + 1 or not paired or len(pending) > rank:
            out.append(Action("W", pending.pop(0), rank))
    return out + [Action("W", j, rank) for j in pending]


# ------------------------------------------------------------------ the Schedule object
# Contract:
# Given: ``order`` is one rank's compute order over ``n_stages`` stages (stage s on rank s mod p);
#     ``Action(op, microbatch, stage, peer)``, the message kinds ``SEND_F``/``RECV_F`` (an
#     activation leaving/entering ``stage``) and ``SEND_B``/``RECV_B`` (a gradient), with
#     ``stage`` the stage of the compute that produces (SEND) or reads (RECV) the tensor.
# ex04.C.keep: the result holds ``order``'s compute actions unchanged and in their order, and
#     otherwise only sends and receives.
# ex04.C.comms: every tensor that crosses a stage boundary (an F's output to the next stage, a
#     B's input gradient to the previous one) has exactly one send, after the compute that
#     produced it and before the rank's next compute, and exactly one receive, after the
#     receiving rank's previous compute and before the compute that reads it; nothing else is
#     sent (not from the ends of the pipeline, not by W).
# ex04.C.peer: the peer of a message is the rank holding the other stage.
# ex04.C.deadlock: a send never waits, a receive waits for its message: in that model the p
#     ranks' actions finish for every schedule's orders (``pipeline.check_schedule``).
def add_comms(order: list[Action], p: int, n_stages: int) -> list[Action]:
    """``order`` with the sends and receives of its stage boundaries: the rank's actions, ready
    for :class:`Schedule`."""
    # >>> ex04 C
    out = []
    for a in order:
        before = after = []
        if a.op in ("F", "B"):
            src, dst = (a.stage - 1, a.stage + 1) if a.op == "F" else (a.stage + 1, a.stage - 1)
            before = [Action("RECV_" + a.op, a.microbatch, a.stage, src % p)] if 0 <= src < n_stages else []
            after = [Action("SEND_" + a.op, a.microbatch, a.stage, dst % p)] if 0 <= dst < n_stages else []
        out += before + [a] + after
    return out
    # <<< ex04 C


@dataclass
class Schedule:
    """``actions[r]``: what rank r does, in order, for one training step."""
    name: str
    p: int
    m: int
    v: int = 1
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    @property
    def split_backward(self) -> bool:
        return any(a.op == "W" for acts in self.actions for a in acts)

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.op in COMPUTE]

    def __repr__(self) -> str:
        return f"Schedule({self.name}, p={self.p}, m={self.m}, v={self.v})"

    def table(self) -> str:
        """One line per rank, compute actions only: ``rank 0: F0 F1 B0 ...``."""
        return "\n".join(f"rank {r}: " + " ".join(f"{a.op}{a.microbatch}" +
                                                  (f".{a.stage // self.p}" if self.v > 1 else "")
                                                  for a in self.compute(r))
                         for r in range(self.p))


def make_schedule(name: str, p: int, m: int, v: int = 1, n_layers: int | None = None) -> Schedule:
    """Build schedule ``name`` ("gpipe", "1f1b", "interleaved", "zb-h1") for p ranks and m
    micro-batches (v >= 2 virtual stages per rank for "interleaved")."""
    check_config(name, p, m, v, n_layers)
    fns = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1,
           "interleaved": lambda p, m, r: interleaved_1f1b(p, m, r, v)}
    return Schedule(name, p, m, v, [add_comms(list(fns[name](p, m, r)), p, p * v) for r in range(p)])
