"""The ranks' side of :mod:`minipar.runtime.ranks`: a process that stays a rank across cells.

One process per rank, forked from the same forkserver as the pool behind ``launch`` (torch
already imported). It joins the process group once, as a launched rank does (device, backend,
trace, the course's rank setup), then serves the driver's requests until told to stop:

* ``run``: execute a cell's source in this rank's own namespace, which persists from cell to
  cell. Like a notebook, the value of the last expression comes back (its ``repr``, or the
  object itself when it is a figure), with what the cell printed and, on an exception, the
  traceback and the cell line it came from;
* ``pull`` / ``push``: names of the namespace sent back (tensors on the CPU) or set;
* ``trace``: the events recorded since the rank started (:mod:`minipar.runtime.trace`).

A second thread answers ``where`` while the main thread is busy, even stuck inside a
collective: the last operation the flight recorder (:mod:`minipar.runtime.flight`) saw start
and whether it finished, and the cell line the main thread is on. It also ends the process
when the driver goes away (its pipe closes, or its process is gone), so a kernel that dies
leaves no rank behind.
"""
from __future__ import annotations

import ast
import io
import linecache
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from . import flight, rank_setup
from . import trace as _trace
from .backend import init_options, process_group_backend
from .pool import IN_RANK, deterministic_cuda, to_cpu

CELL = "<rank cell {}>"  # the file name of cell k's code, in tracebacks and reports
VALUE_CHARS = 4000       # a value's repr is cut to this many characters


def is_figure(value) -> bool:
    """A Plotly or Matplotlib figure: drawn by the driver once, not printed by every rank."""
    kind = type(value)
    return (kind.__module__.startswith("plotly") and hasattr(value, "to_plotly_json")) or \
        (kind.__name__ == "Figure" and kind.__module__.startswith("matplotlib"))


def main(cmd, ctl, rank: int, job: dict) -> None:
    """Body of a rank: join the group, then serve ``cmd`` until ``None`` or the driver is gone."""
    os.environ[IN_RANK] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is the driver's to handle
    threading.Thread(target=_control, args=(ctl, job["driver_pid"]), daemon=True,
                     name="minipar-rank-control").start()
    sys.path[:] = job["sys_path"]
    here = job["devices"][rank]
    os.environ.update(job["env"], RANK=str(rank), LOCAL_RANK=str(rank), MINIPAR_DEVICE=here)
    torch.set_num_threads(job["threads"])
    try:
        if here.startswith("cuda"):
            torch.cuda.set_device(torch.device(here))
            deterministic_cuda()
        _trace.synchronize_on(here)
        timeout = timedelta(hours=24)  # the driver ends hangs itself (its own timeout)
        store = dist.TCPStore("127.0.0.1", job["port"], is_master=False, timeout=timedelta(seconds=60))
        backend = process_group_backend(job["backend"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=job["world_size"],
                                timeout=timeout, **init_options(backend, here))
        _trace.enable(True)
        _trace.set_origin(job["t0"])
        _trace.start(rank)
        flight.reset()
        cmd.send(("ready", rank))
    except BaseException:  # noqa: BLE001 - the driver says why the ranks did not start
        cmd.send(("failed", traceback.format_exc()))
        os._exit(1)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    while True:
        try:
            request = cmd.recv()
        except (EOFError, OSError):
            os._exit(0)
        if request is None:
            break
        try:
            cmd.send(_serve(request, namespace))
        except (EOFError, OSError):
            os._exit(0)
    dist.destroy_process_group()
    os._exit(0)


def _serve(request: tuple, ns: dict):
    verb = request[0]
    if verb == "run":
        return run_cell(*request[1:], ns=ns)
    if verb == "pull":
        missing = [n for n in request[1] if n not in ns]
        if missing:
            return ("error", f"name(s) {missing} not defined on rank {dist.get_rank()}")
        try:
            return ("ok", cloudpickle.dumps({n: to_cpu(ns[n]) for n in request[1]}))
        except Exception as e:  # noqa: BLE001 - unpicklable: say which
            return ("error", f"rank {dist.get_rank()} cannot send {request[1]}: {type(e).__name__}: {e}")
    if verb == "push":
        ns.update(cloudpickle.loads(request[1]))
        return ("ok", None)
    if verb == "trace":
        events = _trace.events()
        if request[1]:  # reset: the next pull starts from here
            _trace.start(dist.get_rank(), barrier=False)
        return ("ok", events)
    return ("error", f"unknown request {verb!r}")


def run_cell(k: int, source: str, setup: bytes, sources: dict, ns: dict) -> dict:
    """Execute cell ``k`` in ``ns``; what it printed, its last expression and any error."""
    filename = CELL.format(k)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    linecache.cache.update(sources)  # the driver's cells, for functions pushed from there
    out, reply = io.StringIO(), {"out": "", "value": None, "figure": None, "error": None}
    _state["cell"] = filename
    try:
        tree = ast.parse(source, filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        with redirect_stdout(out), redirect_stderr(out), rank_setup.entered(setup):
            exec(compile(tree, filename, "exec"), ns)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), filename, "eval"), ns)
                if value is not None:
                    ns["_"] = value
                    _describe(value, reply)
    except BaseException as e:  # noqa: BLE001 - the driver shows it, labelled by rank
        reply["error"], reply["line"] = _traceback(e), _line_in(e.__traceback__, filename)
        reply["exc"] = "".join(traceback.format_exception_only(type(e), e)).strip()
    finally:
        _state["cell"] = None
    reply["out"] = out.getvalue()
    return reply


def _describe(value, reply: dict) -> None:
    if is_figure(value):
        try:
            reply["figure"] = cloudpickle.dumps(value)
            return
        except Exception:  # noqa: BLE001 - shown as text instead
            pass
    text = repr(value)
    reply["value"] = text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS] + " ..."


def _traceback(e: BaseException) -> str:
    """The traceback from the cell's own frames on (this module's frames dropped)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def _line_in(tb, filename: str) -> int | None:
    """The line of cell ``filename`` the traceback went through last (None: not in the cell)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


_state: dict = {"cell": None}


def where() -> dict:
    """What the main thread is doing: the cell line it is on (the innermost frame of code from
    a rank cell, and the running cell's own line), and the flight recorder's last operation."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    cell, inner, outer = _state["cell"], None, None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<rank cell"):
            inner = inner or (name, frame.f_lineno)
            if name == cell:
                outer = (name, frame.f_lineno)
        frame = frame.f_back
    for _ in range(5):  # the main thread may append to the recorder while it is read
        try:
            last = (flight.entries() or [None])[-1]
            break
        except RuntimeError:
            last = None
    op = None
    if last is not None:
        op = {"op": last["op"], "name": last["name"], "dim": last["dim"], "seq": last["seq"],
              "finished": flight.finished(last),  # on the device too, for NCCL work
              "for": time.monotonic() - last["start"]}
    return {"rank": dist.get_rank() if dist.is_initialized() else None, "running": cell is not None,
            "at": outer, "inner": inner if inner != outer else None, "op": op}


def _control(ctl, driver_pid: int) -> None:
    """Answer ``where`` at any time; end the process when the driver is gone."""
    while True:
        try:
            if ctl.poll(0.5) and ctl.recv() == "where":
                try:
                    answer = where()
                except Exception as e:  # noqa: BLE001 - an answer, whatever happens
                    answer = {"rank": None, "running": True, "at": None, "inner": None, "op": None,
                              "error": f"{type(e).__name__}: {e}"}
                ctl.send(answer)
            os.kill(driver_pid, 0)
        except (EOFError, OSError):  # the driver is gone (ProcessLookupError is an OSError)
            os._exit(0)
