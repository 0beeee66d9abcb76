"""NCCL's point-to-point rule played on the CPU, for the pipeline's posts.

NCCL runs a rank's sends and receives in posting order on one stream; past its buffers a send
completes only when the peer's matching receive (the n-th receive from this rank for the n-th
send to it: tags are not matched) runs at the same time; the operations of one
``batch_isend_irecv`` progress together. :func:`stuck` plays that rule (the worst case, every
message larger than the buffers) on what :class:`minipar.pipeline.Pipeline` really posts, with
``torch.distributed`` replaced by a recorder.
"""
import types
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

from minipar import pipeline as pp
from minipar.comm import p2p
from minipar.pipeline import executor
from minipar.runtime import trace


def stuck(programs):
    """The ranks that never finish when rank r posts ``programs[r]`` (a list of posts, each a
    list of ``("send"|"recv", peer)`` progressing together) under NCCL's rule."""
    n, pc = len(programs), [0] * len(programs)
    seq = []  # seq[r][k][j]: which send to / receive from that peer operation j of post k is
    for prog in programs:
        count, numbered = {}, []
        for post in prog:
            numbered.append([count.setdefault(op, 0) for op in post])
            for op in post:
                count[op] += 1
        seq.append(numbered)
    done = [set() for _ in range(n)]
    moved = True
    while moved:
        moved = False
        for r in range(n):
            if pc[r] == len(programs[r]):
                continue
            for j, (kind, q) in enumerate(programs[r][pc[r]]):
                if kind != "send" or j in done[r] or pc[q] == len(programs[q]):
                    continue
                for jj, op in enumerate(programs[q][pc[q]]):
                    if op == ("recv", r) and jj not in done[q] and seq[q][pc[q]][jj] == seq[r][pc[r]][j]:
                        done[r].add(j), done[q].add(jj)
                        moved = True
                        break
            for q in range(n):
                if pc[q] < len(programs[q]) and len(done[q]) == len(programs[q][pc[q]]):
                    pc[q], done[q], moved = pc[q] + 1, set(), True
    return [r for r in range(n) if pc[r] < len(programs[r])]


def test_the_rule_itself():
    """Two ranks that each send before receiving wait for ever; batched, or in matching orders,
    they finish; the n-th send meets the n-th receive."""
    assert stuck([[[("send", 1)], [("recv", 1)]], [[("send", 0)], [("recv", 0)]]]) == [0, 1]
    assert stuck([[[("send", 1), ("recv", 1)]], [[("send", 0), ("recv", 0)]]]) == []
    assert stuck([[[("send", 1)], [("recv", 1)]], [[("recv", 0)], [("send", 0)]]]) == []
    assert stuck([[[("send", 1)], [("send", 1)]], [[("recv", 0)]]]) == [0]


class Work:
    def wait(self):
        pass

    def is_completed(self):
        return True


def recording_dist(log):
    """``torch.distributed`` as the executor's posts reach it: each post logged, in order."""
    d = types.SimpleNamespace(group=types.SimpleNamespace(WORLD=None))
    d.isend = lambda t, dst, group=None, tag=0: (log.append([("send", dst)]), Work())[1]
    d.irecv = lambda t, src, group=None, tag=0: (log.append([("recv", src)]), Work())[1]
    d.P2POp = lambda op, t, peer, group=None, tag=0: ("send" if op is d.isend else "recv", peer)
    d.batch_isend_irecv = lambda ops: (log.append(list(ops)), [Work() for _ in ops])[1]
    d.get_global_rank = lambda group, r: r
    return d


class Event:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True


def posts(monkeypatch, name, p, m, v=1, batch=True):
    """What every rank of a ``name`` pipeline posts for one step, its tensors taken for CUDA
    tensors on an NCCL group (``batch=False``: the executor as it was, one post per action)."""
    schedule = pp.make_schedule(name, p, m, v)
    programs = []
    for r in range(p):
        log = []
        monkeypatch.setattr(p2p, "dist", recording_dist(log))
        monkeypatch.setattr(p2p, "moved_by_nccl", lambda t, g: True)
        monkeypatch.setattr(p2p.staging, "must_stage", lambda t, g, op: False)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(executor, "group_rank", lambda g, r=r: r)
        monkeypatch.setattr(executor, "group_size", lambda g: p)
        monkeypatch.setattr(executor, "batched", p2p.batched if batch else nullcontext)
        torch.manual_seed(0)
        stages = {s: nn.Linear(3, 3) for s in range(r, p * v, p)}
        pipe = executor.Pipeline(stages, schedule, (1, 3), loss_fn=lambda out, y: out.square().mean())
        with trace.recording(False):
            pipe.step(torch.randn(m, 3), torch.zeros(m))
        programs.append(log)
    return programs


CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zb-h1") for p in range(2, 9) for m in (p, 2 * p + 1)]


def test_every_pipeline_schedule_posts_what_nccl_can_pair(monkeypatch):
    """GPipe, 1F1B and ZB-H1 (p = 2..8) and interleaved 1F1B with m = p: the batches the
    executor posts always finish. One post per action, as before, leaves 1F1B and ZB-H1 stuck
    at every p (a send queued before the receive its neighbour's send waits for), and
    interleaved too. Interleaved with m > p stays stuck even batched: its receives come in an
    order NCCL's rule cannot pair past the buffers (Megatron reorders that schedule's
    messages); it relies on messages below NCCL's buffer size."""
    for name, p, m, v in CASES + [("interleaved", p, p, 2) for p in range(2, 9)]:
        new, old = posts(monkeypatch, name, p, m, v), posts(monkeypatch, name, p, m, v, batch=False)
        assert sum(map(len, new)) <= sum(map(len, old)) and all(len(x) == 1 for prog in old for x in prog)
        assert stuck(new) == [], (name, p, m)
        assert stuck(old) != [] or name == "gpipe", (name, p, m)
    assert stuck(posts(monkeypatch, "interleaved", 4, 8, 2)) != []


def test_outside_nccl_the_executor_posts_as_before(monkeypatch):
    """On Gloo (CPU tensors) ``batched`` collects nothing: one post per send or receive."""
    log = []
    monkeypatch.setattr(p2p, "dist", recording_dist(log))
    monkeypatch.setattr(p2p.staging, "group_backend", lambda g: "gloo")
    with p2p.batched():
        p2p.isend(torch.zeros(2), 1)
        h = p2p.irecv(torch.zeros(2), 1)
    assert log == [[("send", 1)], [("recv", 1)]] and not h.deferred and h.works
