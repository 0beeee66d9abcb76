"""NCCL's point-to-point rule played on the CPU, for the pipeline's posts.

NCCL runs a rank's sends and receives in posting order on one stream; past its buffers a send
completes only when the peer's matching receive (the n-th receive from this rank for the n-th
send to it: tags are not matched) runs at the same time; the operations of one
``batch_isend_irecv`` progress together. :func:`stuck` plays that rule (the worst case, every
message larger than the buffers) on what :class:`minipar.pipeline.Pipeline` really posts, with
``torch.distributed`` replaced by a recorder.
"""
import itertools
import types
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

from minipar import pipeline as pp
from minipar.comm import p2p
from minipar.pipeline import executor, posting
from minipar.pipeline.schedules import COMPUTE, message
from minipar.runtime import backend, trace


def stuck(programs):
    """The ranks that never finish when rank r posts ``programs[r]`` (a list of posts, each a
    list of ``("send"|"recv", peer)`` progressing together) under NCCL's rule."""
    n, pc = len(programs), [0] * len(programs)
    seq = []  # seq[r][k][j]: which send to / receive from that peer operation j of post k is
    for prog in programs:
        count, numbered = {}, []
        for post in prog:
            numbered.append([])
            for op in post:  # in one post too, the n-th send to a peer meets its n-th receive
                numbered[-1].append(count.get(op, 0))
                count[op] = numbered[-1][-1] + 1
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
    assert stuck([[[("send", 1), ("send", 1)]], [[("recv", 0)], [("recv", 0)]]]) == []  # 2nd meets 2nd


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


def posts(monkeypatch, name, p, m, v=1, order="lockstep"):
    """What every rank of a ``name`` pipeline posts for one step, its tensors taken for CUDA
    tensors on an NCCL group. ``order``: ``"lockstep"``, the executor's (receives posted by
    rounds, :func:`minipar.pipeline.posting.lockstep`); ``"runs"``, the batches of the schedule's
    own order (each receive right before its compute: the executor before the rounds);
    ``"single"``, one post per action (no batches at all); ``"gloo"``, tensors NCCL does not move."""
    schedule = pp.make_schedule(name, p, m, v)
    programs = []
    for r in range(p):
        log = []
        monkeypatch.setattr(p2p, "dist", recording_dist(log))
        monkeypatch.setattr(p2p, "moved_by_nccl", lambda t, g: order != "gloo")
        monkeypatch.setattr(p2p.staging, "must_stage", lambda t, g, op: False)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(executor, "group_rank", lambda g, r=r: r)
        monkeypatch.setattr(executor, "group_size", lambda g: p)
        monkeypatch.setattr(executor, "batched", nullcontext if order == "single" else p2p.batched)
        monkeypatch.setattr(executor, "lockstep", posting.lockstep if order in ("lockstep", "gloo") else lambda s: s)
        torch.manual_seed(0)
        stages = {s: nn.Linear(3, 3) for s in range(r, p * v, p)}
        pipe = executor.Pipeline(stages, schedule, (1, 3), loss_fn=lambda out, y: out.square().mean())
        with trace.recording(False):
            pipe.step(torch.randn(m, 3), torch.zeros(m))
        programs.append(log)
    return programs


CASES = ([(name, p, m, 1) for name in ("gpipe", "1f1b", "zb-h1") for p in range(2, 9)
          for m in (p, 2 * p, 2 * p + 1, 3 * p)]
         + [("interleaved", p, m, v) for v in (2, 3) for p in range(2, 9) for m in (p, 2 * p, 3 * p)])


def test_every_pipeline_schedule_posts_what_nccl_can_pair(monkeypatch):
    """GPipe, 1F1B, ZB-H1 and interleaved 1F1B (v = 2, 3), p = 2..8, m = p, 2p, 3p: the batches
    the executor posts, receives by rounds, always finish. The batches of the schedule's own
    order (receives right before their computes) leave interleaved 1F1B stuck exactly when
    m > p, at every p and v; one post per action leaves every schedule but GPipe stuck (m < 3p)."""
    for name, p, m, v in CASES:
        new, runs = posts(monkeypatch, name, p, m, v), posts(monkeypatch, name, p, m, v, "runs")
        ops = [sorted(op for prog in x for post in prog for op in post) for x in (new, runs)]
        assert ops[0] == ops[1] and len(ops[0]) == 4 * m * (p * v - 1), (name, p, m, v)
        assert stuck(new) == [], (name, p, m, v)
        assert (stuck(runs) != []) == (name == "interleaved" and m > p), (name, p, m, v)
        if m < 3 * p:  # one post per action: the executor before it batched
            single = posts(monkeypatch, name, p, m, v, "single")
            assert all(len(x) == 1 for prog in single for x in prog) and sum(map(len, single)) == len(ops[0])
            assert (stuck(single) != []) == (name != "gpipe"), (name, p, m, v)
    assert stuck(posts(monkeypatch, "interleaved", 2, 4, 2, "runs")) == [0, 1]


def received_ahead(actions):
    """The most tensors a rank holds received but not yet read by their F or B."""
    held, most = set(), 0
    for a in actions:
        if a.op.startswith("RECV"):
            held.add((a.op[-1], a.microbatch, a.stage))
            most = max(most, len(held))
        held.discard((a.op, a.microbatch, a.stage))
    return most


def test_lockstep_moves_only_receives_and_keeps_the_schedule_valid():
    """``lockstep`` keeps each rank's computes and sends in their order and moves receives
    only up; the result is a valid schedule (channels deliver in the order read, no deadlock
    on paper). In each batch the sends are those of one round t, its receives those of rounds
    t up to the rank's next compute's, and that compute reads none sent later. The price: a
    few tensors received ahead (4 at most in interleaved 1F1B, 2 in 1F1B, where a receive
    right before its compute holds 1)."""
    for name, p, m, v in [("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 3, 9, 3),
                          ("1f1b", 4, 8, 1), ("zb-h1", 3, 7, 1), ("gpipe", 3, 3, 1)]:
        s = pp.make_schedule(name, p, m, v)
        new, (got, sent) = posting.lockstep(s), posting.rounds(s)
        pp.check_schedule(new)
        for r in range(p):
            old, acts = s.actions[r], new.actions[r]
            assert sorted(map(repr, old)) == sorted(map(repr, acts))
            assert [a for a in acts if not a.op.startswith("RECV")] == [a for a in old if not a.op.startswith("RECV")]
            where = {a: k for k, a in enumerate(acts)}
            for k, a in enumerate(old):  # a receive follows no more computes than before: moved up only
                if a.op.startswith("RECV"):
                    assert sum(x.op in COMPUTE for x in acts[:where[a]]) <= sum(x.op in COMPUTE for x in old[:k])
            t = iter(got[r] + [float("inf")])
            now, nxt = -1, next(t)
            for compute, run in itertools.groupby(acts, lambda a: a.op in COMPUTE):
                run = list(run)
                if compute:
                    for _ in run:
                        now, nxt = nxt, next(t)
                    continue
                sends = [sent[message(a)] for a in run if a.op.startswith("SEND")]
                recvs = [sent[message(a)] for a in run if a.op.startswith("RECV")]
                assert len(sends) <= 1 and all(x == now for x in sends), (name, r, run)
                assert all(max(now, 0) <= x < nxt for x in recvs) and recvs == sorted(recvs), (name, r, run)
    for name, p, m, v, most in [("interleaved", 8, 24, 3, 4), ("1f1b", 8, 24, 1, 2), ("gpipe", 8, 24, 1, 1)]:
        s = pp.make_schedule(name, p, m, v)
        assert max(map(received_ahead, posting.lockstep(s).actions)) == most
        assert max(map(received_ahead, s.actions)) == 1
    s = pp.make_schedule("interleaved", 2, 4, 2)
    # F0s0 F1s0 F0s2 F1s2 F2s0 B0s2 ...: a compute one round after the one that sent what it reads
    assert posting.rounds(s)[0] == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 16, 17],
                                    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


def test_outside_nccl_the_executor_posts_as_before(monkeypatch):
    """On Gloo (CPU tensors) ``batched`` collects nothing: one post per send or receive, and the
    executor walks the schedule as given (a receive blocks there: posted when it is needed)."""
    log = []
    monkeypatch.setattr(p2p, "dist", recording_dist(log))
    monkeypatch.setattr(backend, "_current", backend.place(2, "cpu"))  # Gloo on the CPU
    with p2p.batched():
        p2p.isend(torch.zeros(2), 1)
        h = p2p.irecv(torch.zeros(2), 1)
    assert log == [[("send", 1)], [("recv", 1)]] and not h.deferred and h.works
    gloo = posts(monkeypatch, "interleaved", 2, 4, 2, "gloo")
    assert gloo == posts(monkeypatch, "interleaved", 2, 4, 2, "single") and stuck(gloo) == [0, 1]


def _both_orders():
    """Rank function: the small GPT trained with each schedule's own order, then with its
    lockstep order (here on Gloo, whose receives block: every receive ahead must still come)."""
    from minipar import data, reference
    from minipar.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
    batches = data.batches(data.synthetic_tokens(1000), 2, 8, cfg.block_size)
    out = []
    for name, m, v in (("interleaved", 4, 2), ("zb-h1", 4, 1)):
        s = pp.make_schedule(name, 2, m, v)
        out.append([pp.train(GPT(cfg, seed=0), batches, reference.sgd(0.5), schedule=order)
                    for order in (s, posting.lockstep(s))])
    return out


def test_the_lockstep_order_trains_bit_for_bit_as_the_schedule():
    """On 2 ranks, interleaved 1F1B (m = 4, v = 2) and ZB-H1 walked in the lockstep order give
    the very losses and parameters of the schedule's own order: receiving ahead changes when a
    tensor arrives, never what is computed."""
    import minipar
    for rank, runs in enumerate(minipar.launch(_both_orders, 2, device="cpu", timeout=120)):
        for own, ahead in runs:
            assert (own["losses"] is None) == (rank == 0) and own["losses"] == ahead["losses"]
            assert own["params"].keys() == ahead["params"].keys() and len(own["params"]) > 0
            assert all(torch.equal(own["params"][k], ahead["params"][k]) for k in own["params"])
            assert own["measured"]["peak_stash"] == ahead["measured"]["peak_stash"] > 0
