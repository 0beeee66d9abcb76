"""Checked point-to-point: a send and a receive of different sizes, said in words.

Gloo aborts the whole process when a send and its matching receive differ in size (the
rank dies of SIGABRT, its Python traceback lost). Inside :func:`required` (which
``minipar.exercise(...)`` enters while a learner's code runs, in the driver and in every rank
it launches) or while grading (``MINIPAR_CHECKED_COMM=1``), :func:`minipar.comm.exchange`
first calls :func:`check_sizes`:
the two ranks of each transfer swap the element counts they are about to send and receive
(two tiny messages each way, recorded in the flight recorder but not in the trace, so the
bytes a test counts stay the algorithm's own) and, on a mismatch, both raise a
``ValueError`` naming the exchange, its step, both ranks and both sizes. Every send and receive
first goes through :func:`check_peer`: a peer outside the group, or the rank itself (Gloo's
"Pair is not connected"), is a ``ValueError`` that says peers are group ranks. Off otherwise:
:func:`enabled` costs a dictionary look-up.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from . import flight
from .transport import carried_by_nccl

ENV = "MINIPAR_CHECKED_COMM"
_TAG_SENDS, _TAG_EXPECTS = 31_001, 31_002
TAGS = (_TAG_SENDS, _TAG_EXPECTS)  # the size checks' own messages (a grader counting messages skips them)
_required = 0   # how many required() blocks are open


@contextmanager
def required():
    """Check every exchange's sizes inside the block (blocks nest)."""
    global _required
    _required += 1
    try:
        yield
    finally:
        _required -= 1


def enabled() -> bool:
    """True while grading or inside :func:`required` (an exercise is active)."""
    return _required > 0 or os.environ.get(ENV) == "1"


def _where(name: str, labels: dict) -> str:
    extra = ", ".join(f"{k} {labels[k]}" for k in ("phase", "step") if labels.get(k) is not None)
    return f"exchange {name!r}" + (f" ({extra})" if extra else "")


def check_peer(peer: int, group, what: str, name: str, labels: dict) -> None:
    """Before a transfer with group rank ``peer`` (``what``: "sends to", "receives from"): a peer
    that is not a rank of ``group``, or is this rank itself, raises in words (a ring that numbers
    a sub-group's ranks by their world ranks ends here)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if 0 <= peer < n and peer != me:
        return
    whose = "the world" if group is None or group is dist.group.WORLD else f"its group of {n} ranks"
    why = "itself" if peer == me else f"no rank of {whose} (group ranks are 0..{n - 1})"
    raise ValueError(f"{_where(name, labels)}: rank {dist.get_rank()} (group rank {me} of {whose}) "
                     f"{what} group rank {peer}: {why}. Peers passed to minipar.comm are group "
                     f"ranks, numbered within the group (group_rank(group)), not world ranks.")


def check_sizes(send_buf: torch.Tensor, g_dst: int, recv_buf: torch.Tensor, g_src: int, group,
                name: str, labels: dict) -> None:
    """Before ``exchange(send_buf -> g_dst, recv_buf <- g_src)`` (global ranks, as ``dist.isend``
    takes them): tell ``g_dst`` how many elements it will get and ``g_src`` how many this rank
    expects; raise on both sides of a mismatch."""
    me = dist.get_rank()
    cuda = carried_by_nccl(send_buf, group)
    dev = send_buf.device if cuda else torch.device("cpu")
    sends = torch.tensor([send_buf.numel()], dtype=torch.int64, device=dev)
    expects = torch.tensor([recv_buf.numel()], dtype=torch.int64, device=dev)
    src_sends, dst_expects = torch.empty_like(sends), torch.empty_like(expects)
    about = dict(step=labels.get("step"), phase=labels.get("phase"),
                 peers=f"sends to rank {g_dst}, receives from rank {g_src}")
    entry = flight.started("exchange", f"{name} (size check)", labels.get("dim"), **about)
    ops = [(dist.isend, sends, g_dst, _TAG_SENDS), (dist.irecv, src_sends, g_src, _TAG_SENDS),
           (dist.isend, expects, g_src, _TAG_EXPECTS), (dist.irecv, dst_expects, g_dst, _TAG_EXPECTS)]
    if cuda:  # NCCL: one batch, as minipar.comm.start_exchange posts (separate first posts deadlock)
        works = dist.batch_isend_irecv([dist.P2POp(op, t, peer, group, tag) for op, t, peer, tag in ops])
    else:
        works = [op(t, peer, group=group, tag=tag) for op, t, peer, tag in ops]
    for w in works:
        w.wait()
    flight.completed(entry)
    flight.detail(**about)  # the exchange itself, started next, is recorded with its step and peers
    problems = []
    if int(src_sends) != recv_buf.numel():
        problems.append(f"rank {me} receives from rank {g_src}: expected {recv_buf.numel()} elements "
                        f"(rank {me}'s buffer), got {int(src_sends)} (what rank {g_src} sends)")
    if int(dst_expects) != send_buf.numel():
        problems.append(f"rank {me} sends to rank {g_dst}: expected {int(dst_expects)} elements "
                        f"(rank {g_dst}'s buffer), got {send_buf.numel()} (what rank {me} sends)")
    if problems:
        raise ValueError(f"{_where(name, labels)}: sizes differ: " + "; ".join(problems) +
                         ". A send and its receive must have the same number of elements: "
                         "do both ranks mean the same chunk at this step?")
