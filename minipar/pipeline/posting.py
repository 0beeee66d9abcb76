"""Where a pipeline rank posts its receives under NCCL: in rounds, so that no pairing can cycle.

NCCL runs a rank's point-to-point operations in posting order; it pairs the n-th send from
rank a to rank b with b's n-th receive from a (tags are not matched); past its buffers a send
completes only while that receive runs; the operations of one ``batch_isend_irecv`` progress
together. :class:`~minipar.pipeline.Pipeline` posts each run of sends and receives between two
computes as one batch (:func:`minipar.comm.p2p.batched`). With every receive right before the
compute that needs it (:func:`~.schedules.add_comms`) that is enough for GPipe, 1F1B and
ZB-H1, but not for interleaved 1F1B with m > p. There (p = 2, m = 4, v = 2) rank 0 posts the
gradient of B0 on stage 2 alone: its next compute, F3 on stage 0, receives nothing, so the
receive of the gradient rank 1 is sending meanwhile (B1 of stage 3) comes a batch later.
Rank 1's batch with that send never completes, and its receive of rank 0's gradient is queued
behind it: each send waits for a receive posted behind the other's. With p > 2 the same wait
runs round the ring of gradient sends, rank 0 to p-1 to ... to 1 to 0.

:func:`rounds` plays the schedule in lock-step, every compute one round: in round t each rank
runs its next compute if every message it needs was sent in a round before t. A message's
round is that of the compute that produced it. :func:`lockstep` keeps every compute and send
where it was and moves each receive *up*, to just after the receiver's last compute of a round
no later than the message's (Megatron's interleaved schedule, too, posts each receive ahead,
in one call with the sends of the step before). Sorted by
``(round, compute < send < receive)``, rank r's actions are then

    [receives of rounds < t_0]  F/B/W (round t_0)  [sends of t_0, receives of rounds t_0 .. t_1 - 1]
    F/B/W (round t_1)  [sends of t_1, receives of rounds t_1 .. t_2 - 1]  ...

and each bracket is one batch. Every receive still precedes the compute that reads it (that
compute's round is later than the message's), and a channel (sender, receiver, kind) delivers
in the order it is read (both follow the rounds).

Why it cannot cycle. A rank's batches cover disjoint, increasing ranges of rounds, and a
message's send and receive lie in the batches whose ranges hold its round. Suppose every
operation of the rounds before T has completed, and with it every batch whose range ends
before T. On each rank the batch holding round T is then the one posted (what precedes it is
done, computes need nothing from others), so the send and the receive of every round-T message
are posted at once; a rank sends at most one message per round, so between two ranks the
n-th send of the round order meets the n-th receive. Round T completes, and by induction the
step. The rounds are computed once per :class:`~minipar.pipeline.Pipeline`, on the host,
from the schedule alone: nothing is read from the device. The price is memory for tensors
received ahead: a rank holds up to 2 received tensors not yet read in 1F1B and ZB-H1, 4 in
interleaved 1F1B (p <= 8, m <= 3p; GPipe 1), where the schedule's own order holds 1.
"""
from __future__ import annotations

from dataclasses import replace

from .schedules import COMPUTE, Schedule, message
from .simulate import Deadlock


def rounds(schedule: Schedule) -> tuple[list[list[int]], dict]:
    """Lock-step play of ``schedule``: per rank the round of each compute (in order), and the
    round each message is sent in (its producer's)."""
    units = []  # per rank: [compute, messages it needs, messages it sends]
    for acts in schedule.actions:
        need, mine = [], []
        for a in acts:
            if a.op in COMPUTE:
                mine.append([a, need, []])
                need = []
            elif a.op.startswith("RECV"):
                need.append(message(a))
            else:
                mine[-1][2].append(message(a))  # a send follows the compute that made its tensor
        units.append(mine)
    at, got, sent, t = [0] * schedule.p, [[] for _ in units], {}, 0
    while any(k < len(u) for k, u in zip(at, units)):
        ready = [r for r, u in enumerate(units)
                 if at[r] < len(u) and all(sent.get(msg, t) < t for msg in u[at[r]][1])]
        if not ready:
            raise Deadlock(f"{schedule}: no rank can compute in round {t}")
        for r in ready:
            got[r].append(t)
            sent.update((msg, t) for msg in units[r][at[r]][2])
            at[r] += 1
        t += 1
    return got, sent


def lockstep(schedule: Schedule) -> Schedule:
    """``schedule`` with every receive moved into the batch of the round its message is sent
    in (module docstring); computes and sends keep their order."""
    got, sent = rounds(schedule)
    actions = []
    for r, acts in enumerate(schedule.actions):
        key, computes = [], iter(got[r])
        for k, a in enumerate(acts):
            if a.op in COMPUTE:
                t = next(computes)
                key.append((t, 0, k))
            elif a.op.startswith("SEND"):
                key.append((t, 1, k))
            else:
                key.append((sent[message(a)], 2, k))
        actions.append([acts[k] for *_, k in sorted(key)])
    return replace(schedule, actions=actions)
