"""Run one Python function on several ranks: ``minipar.launch(fn, world_size)``.

Each rank is a process with the default process group initialised and a device to compute
on (:func:`minipar.device`), placed by :func:`minipar.runtime.backend.place`: NCCL with one GPU per
rank, ranks sharing the GPUs over Gloo, or Gloo on the CPU (printed once, with its reason).
``launch`` returns ``fn(*args)`` of every rank in rank order (tensors moved to the CPU), with
the ranks' event traces as ``results.trace``. How it works, and why:

* ``fn`` is serialised **by value** with cloudpickle, so a function defined in a notebook
  cell works (the plain ``spawn`` start method would look for it in ``__main__`` and fail).
* Ranks live in a **pool** of worker processes forked from a forkserver that has already
  imported torch: the first launch pays for that import, later ones cost a rendezvous. A
  worker is never reused after a failure, and the pool restarts when a source file the
  workers imported has changed (so an edited exercise is picked up); ``reuse=False`` gives
  fresh processes every time.
* The rendezvous is a ``TCPStore`` served by the launching process on 127.0.0.1, on a port
  the OS chooses; Gloo is told to use the loopback device.
* A rank that raises (or runs out of GPU memory: then with the allocator's figures and what
  to try) makes ``launch`` raise :class:`RankError` with its traceback within a second; the
  other ranks are killed and the next launch starts clean. A run that exceeds ``timeout``
  (counted from when every rank has started: a loaded machine may be slow to start them, and
  has :data:`STARTUP` seconds for that) raises :class:`LaunchTimeout` naming the ranks still running.
* Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) ``launch`` runs ``fn`` in this process
  instead, so the same script scales to several nodes.
"""
from __future__ import annotations

import itertools
import os
import sys
import time
from datetime import timedelta
from multiprocessing.connection import wait

import cloudpickle
import torch
import torch.distributed as dist

from . import rank_setup
from . import trace as _trace
from .backend import (DEVICE_ENV, default_device, default_transport, gpu_identity, init_options, place,
    process_group_backend, refuse_shared_gpus, set_current)
from .pool import (IN_RANK, Pool, cell_sources, deterministic_cuda, get_pool, kill_pool, loopback, shutdown,
    to_cpu)
from .rendezvous import STARTUP, serve_store

__all__ = ["launch", "shutdown", "RankError", "LaunchTimeout", "Results"]
_announced: set = set()


class RankError(RuntimeError):
    """A rank raised (or died); ``.rank`` is the first to fail, ``.remote_traceback`` its trace."""

    def __init__(self, rank: int, world_size: int, remote_traceback: str, others: dict | None = None,
                 printed: str = "", note: str = ""):
        self.rank, self.remote_traceback, self.others = rank, remote_traceback, others or {}
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else "?"
        msg = [f"rank {rank} of {world_size} failed: {last}", ""]
        if printed:
            msg += [f"--- rank {rank} printed ---", printed.rstrip()]
        msg += [f"--- traceback from rank {rank} ---", remote_traceback.rstrip()]
        if note:
            msg += ["", note.rstrip()]
        lost = [r for r, tb in sorted(self.others.items()) if _is_peer_error(tb)]
        msg += [f"(rank {r} also failed: {tb.strip().splitlines()[-1][:160]})"
                for r, tb in sorted(self.others.items()) if r not in lost]
        if lost:
            msg.append(f"(rank(s) {lost} then failed too: they lost their connection to rank {rank})")
        msg.append("The other ranks were stopped.")
        super().__init__("\n".join(msg))


class LaunchTimeout(TimeoutError):
    """The run took longer than ``timeout`` once every rank had started (or the ranks did not all
    start within :data:`STARTUP`); ``.running`` lists the ranks that never finished."""

    def __init__(self, timeout: float, running: list[int], world_size: int, starting: list[int] | None = None):
        self.running, self.starting = running, starting or []
        if self.starting:
            super().__init__(f"rank(s) {self.starting} of {world_size} had not started after {STARTUP:g} s "
                             "(a worker process forked, its imports, the function loaded, the process group "
                             "joined): an import or a module-level statement that never returns, or a machine "
                             "too loaded to start processes. All ranks were stopped.")
            return
        super().__init__(f"timed out after {timeout:g} s: rank(s) {running} of {world_size} still running. "
                         "A collective that not every rank calls, a send without its matching recv, or a send "
                         "or exchange whose handle is never waited on (its .wait() missing) is the "
                         "usual cause. All ranks were stopped.")


class Results(list):
    """Per-rank return values in rank order, plus ``.trace``, ``.backend`` and ``.placement``."""

    trace: _trace.Trace
    backend: str
    seconds: float
    placement: object = None


_launches = itertools.count()


def launch_labels() -> dict:
    """What a rank's logged GPU peak is labelled with (:func:`minipar.runtime.pool.log_peak_memory`):
    which launch of this driver, and the test that made it (pytest's ``PYTEST_CURRENT_TEST``)."""
    return {"MINIPAR_LAUNCH_ID": f"{os.getpid()}-{next(_launches)}",
            "MINIPAR_LAUNCHED_BY": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]}


def launch(fn, world_size: int, *, device: str | None = None, backend: str = "auto", args=(),
           kwargs=None, timeout: float = 120.0, threads: int = 1, reuse: bool = True,
           grace: float = 1.0, transport: str | None = None) -> Results:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``device``: ``"auto"`` (NCCL with one GPU per rank when there are enough GPUs, ranks sharing
    the GPUs over Gloo when there are fewer, else the CPU), ``"cpu"`` or ``"cuda"``; the default
    is ``"auto"`` unless ``MINIPAR_DEVICE`` says otherwise. Inside a rank :func:`minipar.device`
    is where to compute. ``backend``: ``"auto"``, ``"gloo"`` (with ``device="auto"``: the CPU) or
    ``"nccl"``; the choice and its reason are printed once. ``transport``: how messages travel,
    ``"auto"`` (what the devices need) or ``"gloo"``, ``"gloo-staged"`` (through a host copy out
    and back: a shared GPU's path, which the CPU can take too), ``"nccl"``; the default is
    ``"auto"`` unless ``MINIPAR_TRANSPORT`` says otherwise. Everything that differs between
    placements is decided here, once, into the :class:`~minipar.runtime.backend.Placement` that
    every rank reads (:func:`minipar.runtime.backend.current`). ``timeout``: seconds before the whole
    run is stopped. ``threads``: torch intra-op threads per rank (1 avoids oversubscribing a
    laptop). ``reuse``: run in the warm pool of ranks (fast) or in fresh processes.
    """
    if os.environ.get(IN_RANK):
        raise RuntimeError("minipar.runtime.launch was called inside a rank; call it from the driver")
    device = default_device() if device is None else device
    transport = default_transport() if transport is None else transport
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _launch_in_place(fn, world_size, device, backend, args, kwargs or {}, transport)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    placement = place(world_size, device, backend, transport=transport)
    if placement.reason not in _announced:
        _announced.add(placement.reason)
        print(f"minipar.runtime.launch: {placement.reason}")
    payload = cloudpickle.dumps((fn, tuple(args), kwargs or {}))
    pool = get_pool(world_size, reuse)
    store, port = serve_store(world_size, max(timeout, STARTUP))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), **launch_labels()}
    if loopback():
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = loopback()
    job = {"payload": payload, "port": port, "backend": placement.backend, "world_size": world_size,
           "placement": placement,
           "devices": [str(placement.device_for_rank(r)) for r in range(world_size)],
           "timeout": max(timeout, STARTUP), "threads": threads, "sys_path": list(sys.path), "env": env,
           "setup": rank_setup.collect(), "sources": cell_sources(), "t0": time.perf_counter()}
    try:
        replies = _collect(pool, job, world_size, timeout, grace)
    except BaseException:
        kill_pool()  # failed, timed out or interrupted: never reuse these processes
        raise
    finally:
        del store  # closes the listening socket
    for r, reply in enumerate(replies):
        pool.files.update(reply[3])  # the source files this rank imported
        for line in reply[4].splitlines():  # what it printed, each line prefixed with its rank
            print(f"[rank {r}] {line}")
    results = Results(cloudpickle.loads(r[1]) for r in replies)
    results.trace = _trace.Trace([r[2] for r in replies])
    results.backend, results.placement = placement.backend, placement
    results.seconds = time.perf_counter() - job["t0"]
    if not reuse:
        shutdown()
    return results


def _collect(pool: Pool, job: dict, n: int, timeout: float, grace: float) -> list:
    for conn in pool.conns[:n]:
        conn.send(job)
    replies, errors, printed, notes = [None] * n, {}, {}, {}
    # the run's timeout counts from when every rank has started (each says so once it has joined
    # the process group); until then the ranks have STARTUP seconds
    pending, started, err_deadline = set(range(n)), set(), None
    deadline = time.monotonic() + max(timeout, STARTUP)
    while pending:
        remaining = min(deadline, err_deadline or deadline) - time.monotonic()
        handles = {pool.conns[r]: r for r in pending} | {pool.procs[r].sentinel: r for r in pending}
        ready = wait(list(handles), timeout=remaining) if remaining > 0 else []
        if not ready:
            if errors:
                break
            raise LaunchTimeout(timeout, sorted(pending), n, starting=sorted(set(range(n)) - started))
        for h in ready:
            r = handles[h]
            if r not in pending:
                continue
            try:
                msg = pool.conns[r].recv() if h is pool.conns[r] else None
            except (EOFError, OSError):
                msg = None
            if msg == ("started",):
                started.add(r)
                if len(started) == n:
                    deadline = time.monotonic() + timeout
                continue
            if msg is None:
                pool.procs[r].join(timeout=1)
                msg = ("error", f"rank {r} died without a result (exit code {pool.procs[r].exitcode}; "
                                "a negative code is the signal that killed it, e.g. -9 out of memory)\n",
                       None, None, "")
            pending.discard(r)
            if msg[0] == "ok":
                replies[r] = msg
            else:
                errors[r], printed[r], notes[r] = msg[1], msg[4], msg[2] or ""
                err_deadline = err_deadline or time.monotonic() + grace
    if errors:
        first = _root_cause(errors)
        raise RankError(first, n, errors.pop(first), errors, printed.get(first, ""),
                        notes.get(first, ""))
    for conn in pool.conns[:n]:
        conn.send("release")
    return replies


_PEER_ERRORS = ("Connection closed by peer", "Connection reset", "Read error", "Broken pipe",
                "Timed out", "pair.cc", "communicator was aborted")


def _is_peer_error(tb: str) -> bool:
    """An error that only says a peer went away (Gloo/NCCL transport messages)."""
    return any(s in tb for s in _PEER_ERRORS)


def _root_cause(errors: dict[int, str]) -> int:
    """The failing rank to report: a rank's own exception first, then a rank that died,
    and only then a rank that merely lost its connection to a failed peer."""
    def kind(tb: str) -> int:
        return 1 if "died without a result" in tb else 2 if _is_peer_error(tb) else 0
    return min(errors, key=lambda r: (kind(errors[r]), r))


def _init_under_torchrun(backend: str, here="cpu") -> None:
    """The default group from torchrun's environment. After a restart (``--max-restarts``)
    the agents' store still holds the previous round's keys, and Gloo would connect to the
    dead ranks' addresses (the restart counts of the agents may differ: one that restarts
    for another's failure does not count it). So each round's keys get their own prefix:
    the ``k``-th group of ``WORLD_SIZE`` processes to arrive is round ``k`` of that world size
    (an elastic job shrinks and grows: each size counts its own rounds). With several
    agents (``WORLD_SIZE > LOCAL_WORLD_SIZE``) under NCCL, two ranks on one GPU are refused first
    (ranks that share GPUs over Gloo do so on purpose)."""
    extra = init_options(backend, here)  # under NCCL: device_id, the rank's GPU
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, **extra)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=30))
    round_ = (store.add(f"minipar/arrived/{world}", 1) - 1) // world   # by world: an elastic job's
    mine = dist.PrefixStore(f"minipar/round_{world}_{round_}", store)   # rounds differ in size
    if "nccl" in backend and world > int(os.environ.get("LOCAL_WORLD_SIZE", world)):  # several agents
        refuse_shared_gpus(mine, rank, world, gpu_identity(here), here)
    dist.init_process_group(backend, store=mine, rank=rank, world_size=world, **extra)


def _launch_in_place(fn, world_size, device, backend, args, kwargs, transport="auto") -> Results:
    """Under torchrun: this process is one rank; gather every rank's result to every rank."""
    env_ws = int(os.environ["WORLD_SIZE"])
    if world_size not in (None, env_ws):
        raise ValueError(f"launch(world_size={world_size}) but torchrun started {env_ws} ranks")
    placement = place(int(os.environ.get("LOCAL_WORLD_SIZE", env_ws)), device, backend, transport=transport)
    set_current(placement)
    here = placement.device_for_rank(int(os.environ.get("LOCAL_RANK", 0)))
    os.environ[DEVICE_ENV] = str(here)
    _trace.synchronize_on(here)
    if here.type == "cuda":
        torch.cuda.set_device(here)
        deterministic_cuda()
    if not dist.is_initialized():
        _init_under_torchrun(process_group_backend(placement.backend), here)
    _trace.start(dist.get_rank())
    t_start = time.perf_counter()
    out = to_cpu(fn(*args, **kwargs))
    gathered, traces = [None] * env_ws, [None] * env_ws
    dist.all_gather_object(gathered, out)
    dist.all_gather_object(traces, _trace.events())
    results = Results(gathered)
    results.trace, results.placement = _trace.Trace(traces), placement
    results.backend = "nccl" if "nccl" in str(dist.get_backend()) else str(dist.get_backend())
    results.seconds = time.perf_counter() - t_start
    return results
