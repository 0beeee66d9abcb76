"""The rendezvous of ``minipar.runtime.launch``: a ``TCPStore`` served by the launching process.

The store listens on a socket bound to 127.0.0.1 only, on a port the OS chooses, so that a
course machine never exposes it; the ranks connect to it to find each other.
"""
from __future__ import annotations

import os
import socket
from contextlib import suppress
from datetime import timedelta

import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for launchers that need a number)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STARTUP = 300.0
"""Seconds the ranks may take to start (a worker forked and importing, the payload loaded, the
process group joined) before a launch, or ``%%ranks``, gives up on them. A run's own ``timeout``
counts from when every rank has started, so a loaded machine that is slow to start processes
does not eat into it."""


def serve_store(world_size: int, timeout: float):
    """The rendezvous store, served here on a socket bound to 127.0.0.1 only, and its port.
    TCPStore's libuv server (the default since torch 2.4) refuses a listening socket handed to
    it on some releases ("does not support initialization with an listen fd"); the classic
    server accepts one, so that one is used where libuv refuses (decided once)."""
    global _libuv_takes_fd
    for use_libuv in ((True, False) if _libuv_takes_fd else (False,)):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(world_size + 8)
        port = sock.getsockname()[1]
        fd = sock.detach()
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                 master_listen_fd=fd, timeout=timedelta(seconds=timeout),
                                 use_libuv=use_libuv), port
        except (NotImplementedError, RuntimeError) as e:
            with suppress(OSError):
                os.close(fd)
            if not use_libuv or "listen fd" not in str(e):
                raise
            _libuv_takes_fd = False  # torch < 2.9 or so: the classic server from now on
    raise AssertionError("unreachable")


_libuv_takes_fd = True


def connect(address: str, timeout: float = 120.0):
    """A client of the store at ``"HOST:PORT"`` (a job that changes its members keeps one)."""
    host, port = address_of(address)
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, OSError) as e:    # DistNetworkError: nothing listens there
        raise ConnectionError(f"no store answers at {address} within {timeout:g} s ({e})") from None


def address_of(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` as ``(host, port)``; a plain error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"store address {address!r}: give HOST:PORT, e.g. 127.0.0.1:29500")
    return host, int(port)


def form_group(store, generation: int, rank: int, world: int, backend: str = "gloo",
               timeout: float = 120.0) -> None:
    """Make this process rank ``rank`` of a default process group of ``world`` ranks, generation
    ``generation`` of a job whose members change: the previous group (and every group made from it)
    is destroyed first, and each generation's keys live under their own prefix of the one store, so
    a new group never reads an old one's addresses. Every member of the new generation calls it."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore(f"minipar/generation_{generation}", store),
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
