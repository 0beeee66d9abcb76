"""The ranks' side of ``minipar.runtime.launch``: a pool of warm worker processes.

Workers are forked from a forkserver that has already imported torch, so starting one costs
a fork, not an interpreter and a torch import. A worker loops: receive a job (the function,
pickled by value with cloudpickle, and the rendezvous port), join the process group, run the
function with its prints captured, send back the result, its trace and its imported source
files, wait to be released, leave the group. The driver (:mod:`minipar.runtime.launch`) kills the
pool after any failure and restarts it when a source file the workers imported has changed.
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
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from . import rank_setup
from . import trace as _trace
from .backend import init_options, process_group_backend, set_current
from .gpu import max_allocated, reset_max_allocated

IN_RANK = "MINIPAR_IN_RANK"


def loopback() -> str:
    names = [n for _, n in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return "lo" if "lo" in names else ("lo0" if "lo0" in names else "")


def cell_sources() -> dict:
    """linecache entries of code that exists only in memory (notebook cells), so tracebacks
    from the ranks can quote the learner's lines."""
    return {f: v for f, v in list(linecache.cache.items())
            if len(v) == 4 and v[1] is None and not os.path.exists(f)}


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def deterministic_cuda() -> None:
    """fp32 matmuls and convolutions in full fp32 (no TF32), so a GPU run can be compared with
    a single-process run on the same device at fp32 tolerances."""
    b = torch.backends                     # the settings of torch >= 2.9 (the allow_tf32 flags
    b.cuda.matmul.fp32_precision = "ieee"  # are deprecated there and warn)
    b.cudnn.conv.fp32_precision = b.cudnn.rnn.fp32_precision = "ieee"


def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None) or getattr(torch, "OutOfMemoryError", ())
    return isinstance(e, oom) or "CUDA out of memory" in str(e)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def oom_report(rank: int, where: str) -> str:
    """What the caching allocator held when ``rank`` ran out of GPU memory, and what to try."""
    lines = [f"rank {rank} ran out of GPU memory on {where}."]
    try:
        dev = torch.device(where) if where.startswith("cuda") else torch.device("cuda", 0)
        free, total = torch.cuda.mem_get_info(dev)
        lines.append(f"allocator: {_gib(torch.cuda.memory_allocated(dev))} allocated by tensors, "
                     f"{_gib(torch.cuda.memory_reserved(dev))} reserved, peak "
                     f"{_gib(torch.cuda.max_memory_allocated(dev))}; the GPU has {_gib(free)} free "
                     f"of {_gib(total)} (other ranks on the same GPU count too).")
    except Exception as e:  # noqa: BLE001 - no CUDA here: say so rather than fail again
        lines.append(f"allocator: figures not available ({type(e).__name__}: {str(e)[:80]}).")
    lines.append("Hint: use fewer ranks (ranks sharing one GPU share its memory), a smaller model "
                 "or batch, or launch(..., device='cpu').")
    return "\n".join(lines)


_allocated_at_start = 0  # what this warm worker still held on its GPU when the job began


def _begin_gpu_job(here: str) -> None:
    """A job starts on ``here``: the peak counter restarts and what is still allocated is noted."""
    global _allocated_at_start
    reset_max_allocated(here)
    _allocated_at_start = torch.cuda.memory_allocated(torch.device(here))


def log_peak_memory(rank: int, where: str) -> None:
    """Append this job's peak allocated GPU memory (:func:`minipar.runtime.gpu.max_allocated`: the
    running maximum, whatever ``peak_memory`` blocks reset) to ``$MINIPAR_MEMORY_LOG`` (one
    JSON line per rank and launch, labelled with the launch and the test that made it;
    ``course.py test --gpu`` reports the peak per rank and fails a job whose ranks never
    allocated above ``start``: what the worker still held from its earlier jobs, such as
    cuBLAS's workspace, which a peak alone would credit to a rank that computed on the CPU)."""
    if path := os.environ.get("MINIPAR_MEMORY_LOG"):
        import json
        with open(path, "a") as f:
            f.write(json.dumps({"rank": rank, "device": where, "peak": max_allocated(where),
                                "start": _allocated_at_start,
                                "launch": os.environ.get("MINIPAR_LAUNCH_ID"),
                                "test": os.environ.get("MINIPAR_LAUNCHED_BY")}) + "\n")


def _user_files() -> dict[str, float]:
    """Source files this process imported from outside the Python installation."""
    roots = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    files = (getattr(m, "__file__", None) for m in list(sys.modules.values()))
    return {f: os.stat(f).st_mtime for f in files
            if f and f.endswith(".py") and not f.startswith(roots) and os.path.exists(f)}


def _run_job(job: dict, rank: int, seed: int, conn) -> None:
    """Run one job and reply; on success keep the group up until the driver releases us, so a
    rank that finishes early never breaks a peer still waiting on it (that peer *hangs*, as
    it would on a cluster, and the driver's timeout names it)."""
    sys.path[:] = job["sys_path"]
    here = job.get("devices", ["cpu"] * job["world_size"])[rank]
    os.environ.update(job["env"], RANK=str(rank), LOCAL_RANK=str(rank), MINIPAR_DEVICE=here)
    torch.set_num_threads(job["threads"])
    torch.manual_seed(seed)  # a reused worker starts like a fresh process
    set_current(job.get("placement"))  # what rank code asks (backend.current), decided by launch
    _trace.enable(True)
    out = io.StringIO()  # what the rank prints comes back to the driver
    linecache.cache.update(job["sources"])  # notebook cells' source, for readable tracebacks
    try:
        fn, args, kwargs = cloudpickle.loads(job["payload"])
        _trace.synchronize_on(here)
        if here.startswith("cuda"):
            torch.cuda.set_device(torch.device(here))
            deterministic_cuda()
            _begin_gpu_job(here)
        pg_timeout = timedelta(seconds=job["timeout"] + 60)  # the driver's timeout fires first
        store = dist.TCPStore("127.0.0.1", job["port"], is_master=False, timeout=pg_timeout)
        backend = process_group_backend(job["backend"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=job["world_size"],
                                timeout=pg_timeout, **init_options(backend, here))
        conn.send(("started",))  # the driver's timeout for the run counts from every rank's
        _trace.set_origin(job["t0"])
        _trace.start(rank)
        with redirect_stdout(out), redirect_stderr(out), rank_setup.entered(job.get("setup")):
            value = fn(*args, **kwargs)
        reply = ("ok", cloudpickle.dumps(to_cpu(value)), _trace.events(), _user_files())
        if here.startswith("cuda"):
            log_peak_memory(rank, here)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
        # drop this function's own frame: the learner's code starts at the next one
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        reply = ("error", tb, oom_report(rank, here) if _is_oom(e) else None, None)
    conn.send(reply + (out.getvalue(),))
    if reply[0] == "ok":
        conn.recv()  # "release": every rank has finished
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(conn, rank: int) -> None:
    """Body of a pool process: run jobs until told to stop or the parent goes away."""
    seed = torch.initial_seed()
    os.environ[IN_RANK] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C/interrupt is the driver's to handle
    while True:
        try:
            if (job := conn.recv()) is None:
                os._exit(0)
            _run_job(job, rank, seed, conn)
        except (EOFError, OSError):
            os._exit(0)


@contextmanager
def main_not_reimported():
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


def context():
    """How rank processes start: forked from a forkserver that has imported torch (spawned
    where there is no forkserver). The pool and :mod:`minipar.runtime.ranks` share it."""
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    if ctx.get_start_method() == "forkserver":
        # torch.optim imports torch._dynamo (~1 s): pay it once in the forkserver
        ctx.set_forkserver_preload(["minipar.runtime.pool", "torch.optim", "torch._dynamo"])
    return ctx


class Pool:
    def __init__(self):
        self.ctx = context()
        self.procs, self.conns, self.files = [], [], {}

    def grow(self, n: int) -> None:
        with main_not_reimported():
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
        stop(self.procs, self.conns, kill)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []


def stop(procs, conns, kill: bool = False) -> None:
    """End worker processes that serve commands on ``conns`` (``None`` asks one to return):
    at once with ``kill``, else by asking, and past 5 s by killing; waits for each."""
    for p, c in zip(procs, conns):
        if kill or not p.is_alive():
            p.kill()
        else:
            try:
                c.send(None)
            except OSError:
                p.kill()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


_pool: Pool | None = None


def shutdown() -> None:
    """Stop the pool of warm ranks (it restarts on the next launch)."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(shutdown)


def get_pool(n: int, reuse: bool) -> Pool:
    global _pool
    if _pool is not None and (not reuse or not _pool.healthy()):
        _pool.close(kill=not _pool.healthy())
        _pool = None
    if _pool is None:
        _pool = Pool()
    _pool.grow(n)
    return _pool


def rank_pids(n: int) -> list[int]:
    """The process ids of the first ``n`` warm ranks (none while no pool is running)."""
    return [p.pid for p in _pool.procs[:n]] if _pool is not None else []


def kill_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close(kill=True)
        _pool = None
