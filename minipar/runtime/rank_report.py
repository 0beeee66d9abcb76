"""What each rank was doing when a ``%%ranks`` cell was stopped, in words.

When a cell of :class:`minipar.runtime.ranks.Ranks` does not end by itself (a rank raised and the
others wait for it, a hang, an interrupt), every rank is asked where it is
(:func:`minipar.runtime.rank_loop.where`). :func:`describe` turns the answers into one line per
rank: finished, raised (with the cell line), or waiting inside an operation the flight recorder
saw start (:mod:`minipar.runtime.flight`) at a cell line; and, when some ranks wait inside one
operation, the ranks that never started it.
"""
from __future__ import annotations

__all__ = ["describe", "operation"]


def describe(ranks, outcome) -> list[str]:
    """One line per rank of ``ranks`` (a ``Ranks``): what it was doing when ``outcome``'s cell was
    stopped, then the ranks that never started the operation others wait in (module docstring)."""
    lines = []
    for r in range(ranks.world_size):
        w = outcome.where[r] if r < len(outcome.where) else None
        reply = outcome.replies[r]
        if reply is not None and reply.get("error"):
            line = f" at cell line {reply['line']}" if reply.get("line") else ""
            lines.append(f"rank {r}: {'died' if reply.get('died') else 'raised'} {reply['exc']}{line}")
            continue
        op = (w or {}).get("op")
        last = "no minipar.comm operation yet" if not op else operation(op)
        if reply is not None:
            lines.append(f"rank {r}: finished the cell; " +
                         (f"the last operation it started: {last}, finished" if op else
                          "it started no minipar.comm operation"))
        elif w is None:
            lines.append(f"rank {r}: did not answer (stuck holding the interpreter?)")
        else:
            at = f" at cell line {w['at'][1]}: {ranks.source_line(w['at'])}" if w.get("at") else ""
            inner = (f" (inside {w['inner'][0].strip('<>')} line {w['inner'][1]}: "
                     f"{ranks.source_line(w['inner'])})") if w.get("inner") else ""
            state = (f"waiting inside {last} for {op['for']:.1f} s" if op and not op["finished"]
                     else f"still running; its last operation, {last}, finished")
            lines.append(f"rank {r}: {state}{at}{inner}")
    return lines + _culprits(outcome.where)


def operation(op: dict) -> str:
    """``all_reduce on dp (seq 3)``; with its name when the caller gave one (``send 'activation'``)."""
    name = "" if op["name"] == op["op"] else f" {op['name']!r}"
    return f"{op['op']}{name} on {op['dim'] or 'an unnamed group'} (seq {op['seq']})"


def _culprits(where: list) -> list[str]:
    """When some ranks wait inside one operation: the ranks that never started it."""
    ops = [(w or {}).get("op") for w in where]
    waited = {(o["op"], o["dim"], o["seq"]) for o in ops if o and not o["finished"]}
    if len(waited) != 1:
        return []
    op, dim, seq = waited.pop()
    inside = [r for r, o in enumerate(ops) if o and not o["finished"]]
    never = [r for r, o in enumerate(ops) if not o or (o["dim"] == dim and o["seq"] < seq)]
    if not never:
        return []
    return [f"{_ranks(inside)} wait{'s' * (len(inside) == 1)} inside {op} on {dim or 'an unnamed group'} "
            f"(seq {seq}), which {_ranks(never)} never started."]


def _ranks(rs: list[int]) -> str:
    return f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}"
