"""``%load_ext minipar``, then ``%%ranks 4``: a notebook cell that runs on 4 ranks that stay.

The cell's code runs on every rank of :class:`minipar.runtime.ranks.Ranks`, each rank in its own
namespace, kept from cell to cell, with its process group up (``dist.get_rank()``,
``minipar.device()`` and ``minipar.comm`` work as inside ``launch``). What each rank printed and
its last expression's value are shown side by side, labelled by rank
(:mod:`minipar.course.rank_view`); a figure is drawn once. The same ranks serve every cell until
the number of ranks (or ``--device``/``--backend``) changes or ``%ranks restart``.

Cell options: ``%%ranks N [--rank R[,R...]] [--timeout S] [--device D] [--backend B]``;
``--rank`` shows only those ranks' output (all ranks run). Line verbs:

* ``%ranks pull NAME``: a list by rank (several names: a dict of lists); ``%ranks push NAME``:
  the notebook's ``NAME`` set on every rank;
* ``%ranks trace [--reset]``: what the ranks recorded so far, a ``Trace`` to draw with
  ``minipar.runtime.viz``;
* ``%ranks timeout S``: the default time a cell may take (60 s) before it counts as a hang;
* ``%ranks restart``, ``%ranks stop``, ``%ranks pids``, ``%ranks where``, ``%ranks`` (status).

A rank that raises shows its cell line and traceback and the cell fails; the other ranks get a
moment to finish it. A cell that outlasts its timeout (one rank waits in a collective another
never calls) is stopped with what every rank last started and where it waits, and the ranks
are restarted, without restarting the kernel.
"""
from __future__ import annotations

import argparse
import shlex

from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from ..runtime import ranks as _ranks
from ..runtime.rank_report import describe, operation
from . import rank_view

DEFAULT_TIMEOUT = 60.0
RESTARTED = ("The ranks were restarted: their variables are gone; run the cells that define them "
             "again.")


class RankCellError(RuntimeError):
    """A ``%%ranks`` cell failed on a rank, hung or was interrupted. IPython shows
    :meth:`_render_traceback_`: the rank's own traceback and what the others were doing,
    not the magic's frames."""

    def __init__(self, message: str, traceback_text: str = ""):
        super().__init__(message)
        self.traceback_text = traceback_text

    def _render_traceback_(self):
        return (self.traceback_text.rstrip().splitlines() + [""] if self.traceback_text else []) + \
            [f"RankCellError: {self}"]


def _cell_options(line: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="%%ranks", add_help=False)
    p.add_argument("n", nargs="?", type=int)
    p.add_argument("--rank", default=None, help="ranks whose output is shown, e.g. 0 or 0,2")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"))
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    try:
        return p.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(f"%%ranks {line}: usage: {p.format_usage().split(': ', 1)[1].strip()}") from None


@magics_class
class RanksMagics(Magics):
    timeout = DEFAULT_TIMEOUT

    @line_cell_magic
    def ranks(self, line: str = "", cell: str | None = None):
        if cell is None:
            return self._verb(line)
        opts = _cell_options(line)
        header = ""
        if opts.n is None:
            ranks = _ranks.current()
            if ranks is None:
                raise ValueError("no ranks yet: say how many, %%ranks 4")
        else:
            ranks, header = _ranks.start(opts.n, opts.device, opts.backend)
        shown = None if opts.rank is None else [int(r) for r in opts.rank.split(",")]
        if shown is not None and not all(0 <= r < ranks.world_size for r in shown):
            raise ValueError(f"--rank {opts.rank}: there are ranks 0..{ranks.world_size - 1}")
        # the line "%%ranks ..." counted, so that line numbers are those the notebook shows
        outcome = ranks.run("\n" + cell, timeout=opts.timeout or self.timeout,
                            cell=self.shell.execution_count)
        self._show(ranks, outcome, shown, "; ".join(x for x in (header, outcome.note) if x))

    # ------------------------------------------------------------------ showing a cell
    def _show(self, ranks, outcome, shown, header: str) -> None:
        n = ranks.world_size
        failed = outcome.failed()
        shown = sorted(set(shown or range(n)) | set(failed) | (set(range(n)) if outcome.problem else set()))
        statuses = {}
        if outcome.where:  # stopped: what each rank was doing, in short (the error below says it in full)
            statuses = {r: _status(outcome.where[r], outcome.replies[r]) for r in range(n)
                        if not (outcome.replies[r] or {}).get("error")}
        figures = [r for r in range(n) if outcome.replies[r] and outcome.replies[r].get("figure")]
        figure_from = next((r for r in shown if r in figures), figures[0] if figures else None)
        replies = {r: outcome.replies[r] for r in shown}
        quiet = not header and not outcome.problem and not any(
            (x or {}).get("out", "").strip() or (x or {}).get("value") is not None or (x or {}).get("figure")
            for x in replies.values())
        if not quiet:
            cols = {r: rank_view.column(replies[r], statuses.get(r, ""), figure_from, r) for r in shown}
            display({"text/html": rank_view.to_html(cols, header),
                     "text/plain": rank_view.to_text(replies, statuses, header)}, raw=True)
        if figure_from is not None:
            import cloudpickle
            display(cloudpickle.loads(outcome.replies[figure_from]["figure"]))
        if outcome.problem:
            raise self._error(ranks, outcome)

    @staticmethod
    def _error(ranks, outcome) -> RankCellError:
        failed, n = outcome.failed(), ranks.world_size
        others = describe(ranks, outcome) if outcome.where else []
        if failed:
            r = failed[0]
            reply = outcome.replies[r]
            at = f" at cell line {reply['line']}" if reply.get("line") else ""
            tb = "" if reply.get("died") else f"Traceback from rank {r} of {n}:\n" + reply["error"].split("\n", 1)[-1]
            also = [f"rank {q} also {'died' if outcome.replies[q].get('died') else 'raised'} "
                    f"{outcome.replies[q]['exc']}" for q in failed[1:]]
            if others:  # some ranks did not finish: what they were doing
                told = [x for q, x in enumerate(others) if q not in failed]
            else:
                fine = [str(q) for q in range(n) if q not in failed]
                told = [f"rank{'s' * (len(fine) > 1)} {', '.join(fine)} finished the cell; "
                        "every rank keeps its variables"] if fine else []
            msg = "\n".join([f"rank {r} {'died' if reply.get('died') else 'raised'} {reply['exc']}{at}", *also, *told]
                            + ([RESTARTED] if outcome.restarted else []))
            return RankCellError(msg, tb)
        if outcome.problem == "interrupted":
            head = f"interrupted after {outcome.seconds:.1f} s; what each rank was doing:"
        else:
            head = (f"the cell did not finish on every rank within {outcome.timeout:g} s (the timeout: "
                    f"%%ranks --timeout S, or %ranks timeout S); what each rank was doing:"
                    if outcome.problem == "hang" else "a rank died; what each rank was doing:")
        return RankCellError("\n".join([head, *others] + ([RESTARTED] if outcome.restarted else [])))

    # ------------------------------------------------------------------ line verbs
    def _verb(self, line: str):
        words = shlex.split(line)
        verb, args = (words[0], words[1:]) if words else ("", [])
        if verb.isdigit():
            ranks, header = _ranks.start(int(verb))
            print(header or f"{ranks.world_size} ranks running: {ranks.placement.reason}")
            return None
        if verb == "timeout":
            if args:
                type(self).timeout = float(args[0])
            return self.timeout
        if verb == "stop":
            _ranks.stop()
            return None
        ranks = _ranks.current()
        if ranks is None:
            raise ValueError("no ranks running: start them with %%ranks N")
        if verb == "":
            print(f"{ranks.world_size} ranks (pids {ranks.pids}): {ranks.placement.reason}; "
                  f"a cell may take {self.timeout:g} s")
            return None
        if verb == "restart":
            ranks.restart()
            print(f"restarted {ranks.world_size} ranks: {ranks.placement.reason}")
            return None
        if verb == "pids":
            return ranks.pids
        if verb == "where":
            return ranks.where()
        if verb == "trace":
            return ranks.trace(reset="--reset" in args)
        if verb == "pull":
            if not args:
                raise ValueError("%ranks pull NAME [NAME ...]")
            got = ranks.pull(*args)
            return got[args[0]] if len(args) == 1 else got
        if verb == "push":
            ns = self.shell.user_ns
            missing = [a for a in args if a not in ns]
            if not args or missing:
                raise ValueError(f"%ranks push NAME [NAME ...]: not defined here: {missing}")
            ranks.push(**{a: ns[a] for a in args})
            return None
        raise ValueError(f"%ranks {line}: unknown; use pull, push, trace, timeout, restart, stop, pids, where")


def _status(where: dict | None, reply: dict | None) -> str:
    """One rank's state in a column: finished, or where it was stopped."""
    if reply is not None:
        return "finished the cell"
    if where is None:
        return "did not answer"
    op, at = where.get("op"), where.get("at")
    line = f" at cell line {at[1]}" if at else ""
    if op and not op["finished"]:
        return f"waiting inside {operation(op)}{line}"
    return f"running{line}"


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(RanksMagics)


def unload_ipython_extension(ipython) -> None:
    _ranks.stop()
