"""Run one Python function on several ranks: ``minipar.launch(fn, world_size)``.

Each rank is a process with the default process group initialised (Gloo on CPU, or NCCL
with one GPU per rank). ``fn(*args)`` runs on every rank and ``launch`` returns the list
of return values in rank order, with the ranks' event traces as ``results.trace``.

How it works, and why:

* ``fn`` is serialised **by value** with cloudpickle, so a function defined in a notebook
  cell works (the plain ``spawn`` start method would look for it in ``__main__`` and fail).
* Ranks live in a **pool** of worker processes forked from a forkserver that has already
  imported torch. The first launch pays for that import once; later launches reuse the
  warm workers and cost a rendezvous. A worker is never reused after a failure, and the
  pool restarts by itself when a source file the workers imported has changed (so an
  edited exercise is picked up). ``reuse=False`` gives fresh processes every time.
* The rendezvous is a ``TCPStore`` served by the launching process on a socket bound to
  127.0.0.1 and a free port chosen by the OS; Gloo is told to use the loopback device.
* A rank that raises makes ``launch`` raise :class:`RankError` with that rank's traceback
  within a second; the other ranks are killed and the next launch starts clean. A run that
  exceeds ``timeout`` raises :class:`LaunchTimeout` naming the ranks still running.
* Under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) ``launch`` runs ``fn``
  in the current process instead, so the same script scales to several nodes.
"""
from __future__ import annotations

import atexit
import io
import linecache
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from datetime import timedelta
from multiprocessing.connection import wait

import cloudpickle
import torch
import torch.distributed as dist

from . import trace as _trace
from .backend import pick_backend

_IN_RANK = "MINIPAR_IN_RANK"


class RankError(RuntimeError):
    """A rank raised (or died); ``.rank`` is the first to fail, ``.remote_traceback`` its trace."""

    def __init__(self, rank: int, world_size: int, remote_traceback: str, others: dict | None = None,
                 printed: str = ""):
        self.rank, self.remote_traceback, self.others = rank, remote_traceback, others or {}
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else "?"
        msg = [f"rank {rank} of {world_size} failed: {last}", ""]
        if printed:
            msg += [f"--- rank {rank} printed ---", printed.rstrip()]
        msg += [f"--- traceback from rank {rank} ---", remote_traceback.rstrip()]
        lost = [r for r, tb in sorted(self.others.items()) if _is_peer_error(tb)]
        for r, tb in sorted(self.others.items()):
            if r not in lost:
                msg.append(f"(rank {r} also failed: {tb.strip().splitlines()[-1][:160]})")
        if lost:
            msg.append(f"(rank(s) {lost} then failed too: they lost their connection to rank {rank})")
        msg.append("The other ranks were stopped.")
        super().__init__("\n".join(msg))


class LaunchTimeout(TimeoutError):
    """The run took longer than ``timeout``; ``.running`` lists the ranks that never finished."""

    def __init__(self, timeout: float, running: list[int], world_size: int):
        self.running = running
        super().__init__(
            f"timed out after {timeout:g} s: rank(s) {running} of {world_size} still running. "
            "A collective that not every rank calls, or a send without its matching recv, "
            "is the usual cause. All ranks were stopped.")


class Results(list):
    """Per-rank return values in rank order, plus ``.trace`` and ``.backend``."""

    trace: _trace.Trace
    backend: str
    seconds: float


# --------------------------------------------------------------------------- the rank side
def _loopback() -> str:
    names = [n for _, n in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return "lo" if "lo" in names else ("lo0" if "lo0" in names else "")


def _cell_sources() -> dict:
    """linecache entries of code that exists only in memory (notebook cells), so tracebacks
    from the ranks can quote the learner's lines."""
    return {f: v for f, v in list(linecache.cache.items())
            if len(v) == 4 and v[1] is None and not os.path.exists(f)}


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _user_files() -> dict[str, float]:
    """Source files this process imported from outside the Python installation."""
    roots = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    out = {}
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f and f.endswith(".py") and not f.startswith(roots) and os.path.exists(f):
            out[f] = os.stat(f).st_mtime
    return out


def _run_job(job: dict, rank: int, seed: int, conn) -> None:
    """Run one job and reply; on success keep the group up until the driver releases us, so a
    rank that finishes early never breaks a peer still waiting on it (that peer *hangs*, as
    it would on a cluster, and the driver's timeout names it)."""
    sys.path[:] = job["sys_path"]
    os.environ.update(job["env"], RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(job["threads"])
    torch.manual_seed(seed)  # a reused worker starts like a fresh process
    _trace.enable(True)
    out = io.StringIO()  # what the rank prints comes back to the driver
    linecache.cache.update(job["sources"])  # notebook cells' source, for readable tracebacks
    try:
        fn, args, kwargs = cloudpickle.loads(job["payload"])
        if job["backend"] == "nccl":
            torch.cuda.set_device(rank)
        pg_timeout = timedelta(seconds=job["timeout"] + 60)  # the driver's timeout fires first
        store = dist.TCPStore("127.0.0.1", job["port"], is_master=False, timeout=pg_timeout)
        dist.init_process_group(job["backend"], store=store, rank=rank,
                                world_size=job["world_size"], timeout=pg_timeout)
        _trace.start(rank)
        with redirect_stdout(out), redirect_stderr(out):
            value = fn(*args, **kwargs)
        reply = ("ok", cloudpickle.dumps(_to_cpu(value)), _trace.events(), _user_files())
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
        # drop this function's own frame: the learner's code starts at the next one
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        reply = ("error", tb, None, None)
    conn.send(reply + (out.getvalue(),))
    if reply[0] == "ok":
        conn.recv()  # "release": every rank has finished
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(conn, rank: int) -> None:
    """Body of a pool process: run jobs until told to stop or the parent goes away."""
    seed = torch.initial_seed()
    os.environ[_IN_RANK] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C/interrupt is the driver's to handle
    while True:
        try:
            job = conn.recv()
            if job is None:
                os._exit(0)
            _run_job(job, rank, seed, conn)
        except (EOFError, OSError):
            os._exit(0)


# ------------------------------------------------------------------------- the pool
@contextmanager
def _main_not_reimported():
    """Hide ``__main__``'s origin while starting workers, so they do not re-run the caller's
    script or notebook kernel module: ``fn`` travels by value and never needs it."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class _Pool:
    def __init__(self):
        methods = mp.get_all_start_methods()
        self.ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self.ctx.get_start_method() == "forkserver":
            self.ctx.set_forkserver_preload(["minipar.launch"])
        self.procs, self.conns, self.files = [], [], {}

    def grow(self, n: int) -> None:
        with _main_not_reimported():
            self._grow(n)

    def _grow(self, n: int) -> None:
        while len(self.procs) < n:
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=_worker, args=(child, len(self.procs)),
                                 name=f"minipar-rank{len(self.procs)}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def healthy(self) -> bool:
        if not all(p.is_alive() for p in self.procs):
            return False
        try:
            return all(os.stat(f).st_mtime == m for f, m in self.files.items())
        except OSError:
            return False

    def close(self, kill: bool = False) -> None:
        for p, c in zip(self.procs, self.conns):
            if kill:
                p.kill()
            else:
                try:
                    c.send(None)
                except OSError:
                    p.kill()
        for p, c in zip(self.procs, self.conns):
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
            c.close()
        self.procs, self.conns = [], []


_pool: _Pool | None = None
_announced: set = set()


def shutdown() -> None:
    """Stop the pool of warm ranks (it restarts on the next launch)."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(shutdown)


def _get_pool(n: int, reuse: bool) -> _Pool:
    global _pool
    if _pool is not None and (not reuse or not _pool.healthy()):
        _pool.close(kill=not _pool.healthy())
        _pool = None
    if _pool is None:
        _pool = _Pool()
    _pool.grow(n)
    return _pool


def _kill_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close(kill=True)
        _pool = None


# ------------------------------------------------------------------------- launch
def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for launchers that need a number)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, world_size: int, *, backend: str = "auto", args=(), kwargs=None,
           timeout: float = 120.0, threads: int = 1, reuse: bool = True,
           grace: float = 1.0) -> Results:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``backend``: ``"auto"`` (NCCL with one GPU per rank if there are enough GPUs, else
    Gloo), ``"gloo"`` or ``"nccl"``. ``timeout``: seconds before the whole run is stopped.
    ``threads``: torch intra-op threads per rank (1 avoids oversubscribing a laptop).
    ``reuse``: run in the warm pool of ranks (fast) or in fresh processes.
    """
    if os.environ.get(_IN_RANK):
        raise RuntimeError("minipar.launch was called inside a rank; call it from the driver")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _launch_in_place(fn, world_size, backend, args, kwargs or {})
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    chosen, why = pick_backend(backend, world_size)
    if (chosen, why) not in _announced:
        _announced.add((chosen, why))
        print(f"minipar.launch: {why}")
    payload = cloudpickle.dumps((fn, tuple(args), kwargs or {}))
    sources = _cell_sources()
    pool = _get_pool(world_size, reuse)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(world_size + 8)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach(), timeout=timedelta(seconds=timeout))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size)}
    if _loopback():
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = _loopback()
    job = {"payload": payload, "port": port, "backend": chosen, "world_size": world_size,
           "timeout": timeout, "threads": threads, "sys_path": list(sys.path), "env": env,
           "sources": sources}
    t_start = time.perf_counter()
    try:
        replies = _collect(pool, job, world_size, timeout, grace)
    except BaseException:
        _kill_pool()  # failed, timed out or interrupted: never reuse these processes
        raise
    finally:
        del store  # closes the listening socket
    _show_output([r[4] for r in replies])
    results = Results(cloudpickle.loads(r[1]) for r in replies)
    results.trace = _trace.Trace([r[2] for r in replies])
    results.backend, results.seconds = chosen, time.perf_counter() - t_start
    for r in replies:
        pool.files.update(r[3])
    if not reuse:
        shutdown()
    return results


def _collect(pool: _Pool, job: dict, n: int, timeout: float, grace: float) -> list:
    for conn in pool.conns[:n]:
        conn.send(job)
    replies, errors, printed = [None] * n, {}, {}
    pending = set(range(n))
    deadline = time.monotonic() + timeout
    err_deadline = None
    while pending:
        limit = deadline if err_deadline is None else min(deadline, err_deadline)
        remaining = limit - time.monotonic()
        handles = {pool.conns[r]: r for r in pending}
        handles.update({pool.procs[r].sentinel: r for r in pending})
        ready = wait(list(handles), timeout=max(remaining, 0)) if remaining > 0 else []
        if not ready:
            if errors:
                break
            raise LaunchTimeout(timeout, sorted(pending), n)
        for h in ready:
            r = handles[h]
            if r not in pending:
                continue
            try:
                msg = pool.conns[r].recv() if h is pool.conns[r] else None
            except (EOFError, OSError):
                msg = None
            if msg is None:
                pool.procs[r].join(timeout=1)
                code = pool.procs[r].exitcode
                msg = ("error", f"rank {r} died without a result (exit code {code}; a negative "
                                f"code is the signal that killed it, e.g. -9 out of memory)\n",
                       None, None, "")
            pending.discard(r)
            if msg[0] == "ok":
                replies[r] = msg
            else:
                errors[r], printed[r] = msg[1], msg[4]
                err_deadline = err_deadline or time.monotonic() + grace
    if errors:
        first = _root_cause(errors)
        raise RankError(first, n, errors.pop(first), errors, printed.get(first, ""))
    for conn in pool.conns[:n]:
        conn.send("release")
    return replies


def _show_output(texts: list[str]) -> None:
    """Print what the ranks printed, each line prefixed with its rank, in rank order."""
    for r, text in enumerate(texts):
        for line in text.splitlines():
            print(f"[rank {r}] {line}")


_PEER_ERRORS = ("Connection closed by peer", "Connection reset", "Read error", "Broken pipe",
                "Timed out", "pair.cc", "communicator was aborted")


def _is_peer_error(tb: str) -> bool:
    """An error that only says a peer went away (Gloo/NCCL transport messages)."""
    return any(s in tb for s in _PEER_ERRORS)


def _root_cause(errors: dict[int, str]) -> int:
    """The failing rank to report: a rank's own exception first, then a rank that died,
    and only then a rank that merely lost its connection to a failed peer."""
    def kind(tb: str) -> int:
        if "died without a result" in tb:
            return 1
        return 2 if _is_peer_error(tb) else 0
    return min(errors, key=lambda r: (kind(errors[r]), r))


def _launch_in_place(fn, world_size, backend, args, kwargs) -> Results:
    """Under torchrun: this process is one rank; gather every rank's result to every rank."""
    env_ws = int(os.environ["WORLD_SIZE"])
    if world_size not in (None, env_ws):
        raise ValueError(f"launch(world_size={world_size}) but torchrun started {env_ws} ranks")
    if not dist.is_initialized():
        local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", env_ws))
        chosen, _ = pick_backend(backend, local_ws)
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(chosen)
    _trace.start(dist.get_rank())
    t_start = time.perf_counter()
    out = _to_cpu(fn(*args, **kwargs))
    gathered, traces = [None] * env_ws, [None] * env_ws
    dist.all_gather_object(gathered, out)
    dist.all_gather_object(traces, _trace.events())
    results = Results(gathered)
    results.trace, results.backend = _trace.Trace(traces), dist.get_backend()
    results.seconds = time.perf_counter() - t_start
    return results
