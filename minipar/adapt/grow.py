"""``python -m minipar.adapt.grow``: one rank of a training run whose members change while it
trains (:mod:`.membership`), the ranks that stay never restarted::

    python -m minipar.adapt.grow --store HOST:PORT --rank R --world 3 --steps 12 --grow-at 4 --out r.pt
    python -m minipar.adapt.grow --store HOST:PORT --join --steps 12 --out joiner.pt
    python -m minipar.adapt.grow --store HOST:PORT --rank 3 --world 4 --steps 12 --leave-at 6 --out r3.pt

The store (a ``TCPStore`` at HOST:PORT) outlives every member: the job's scheduler hosts it, as
an etcd would. The first ``--world`` ranks start with ``--rank``; a ``--join`` rank waits until
the job admits it. ``--grow-at K``: after step K rank 0 waits for a joiner and the job grows by
the joiners waiting (only at those steps; without it, joiners are admitted after any step);
``--leave-at K``: this rank leaves cleanly after step K. Every world trains
the layout :func:`~minipar.adapt.auto.fit` gives it (the most data parallelism the global batch
allows, ZeRO ``--zero``) on the course GPT with AdamW, global batch ``step`` at step ``step``.
``--out`` (``torch.save``): this process's pid at its start and end, its losses by step, its
records of every change, and (rank 0 at the end) the final single-device parameters."""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from .. import hybrid
from ..data import corpus_tokens, get_batch
from ..models.gpt import GPT, GPTConfig
from ..reference import adamw
from .auto import fit
from ..runtime.rendezvous import address_of
from .membership import Member, arrive, change_members, record


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m minipar.adapt.grow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="HOST:PORT of the job's store")
    ap.add_argument("--rank", type=int, help="this rank, one of the first --world")
    ap.add_argument("--world", type=int, help="how many ranks the job starts with")
    ap.add_argument("--join", action="store_true", help="join the running job")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--grow-at", type=int, action="append", default=[], metavar="STEP",
                    help="after STEP, rank 0 waits for a joiner and admits those waiting (repeatable; "
                    "without it: joiners are admitted after any step)")
    ap.add_argument("--leave-at", type=int, metavar="STEP", help="this rank leaves after STEP")
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1))
    for name, value in (("n-layer", 1), ("n-embd", 16), ("n-head", 2), ("block-size", 16), ("batch-size", 12),
                        ("seed", 0), ("data-seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=value)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    ap.add_argument("--out", help="where to torch.save this rank's record")
    return ap


def check(args) -> None:
    """Plain errors before this process joins anything."""
    address_of(args.store)
    if args.join == (args.rank is not None or args.world is not None):
        raise ValueError("give --rank R --world N (one of the first ranks) or --join (a new one), not both")
    if not args.join and not 0 <= args.rank < args.world:
        raise ValueError(f"--rank {args.rank} is not one of the --world {args.world} ranks 0..{args.world - 1}")
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: at least one step")
    for flag, steps in (("--grow-at", args.grow_at), ("--leave-at", [args.leave_at] if args.leave_at else [])):
        bad = [s for s in steps if not 1 <= s < args.steps]
        if bad:
            raise ValueError(f"{flag} {bad[0]}: a change happens after a step 1..{args.steps - 1}, before the last")
    if args.n_embd % args.n_head:
        raise ValueError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if not args.join:
        fit(model_config(args), args.world, args.batch_size, args.zero)   # a plain error if none fits


def model_config(args) -> GPTConfig:
    vocab = -(-corpus_tokens()[1].vocab_size // 8) * 8      # the training command's padding
    return GPTConfig(vocab_size=vocab, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd)


def run(args) -> dict:
    """Train as a member of the job until the last step (or until this rank leaves)."""
    pid = os.getpid()
    member = (Member.join(args.store, args.timeout) if args.join
              else Member.start(args.store, args.rank, args.world, args.timeout))
    config, tokens = model_config(args), corpus_tokens()[0]

    def layout_of(world):
        return fit(config, world, args.batch_size, args.zero)

    def build(lay):
        with torch.device("cpu"):   # seeded on the CPU (the state moves in anyway), placed by the model
            gpt = GPT(config, seed=args.seed)
        return hybrid.HybridModel(gpt, lay.mesh(), optimizer=adamw(args.lr, args.weight_decay), **lay.options())
    records, losses = [], {}
    if member.joined:
        phases = {}
        hm, moved = arrive(member, layout_of, build, None, phases)
        records.append(record(member.joined, {}, moved, phases, layout_of))
    else:
        hm = build(layout_of(member.world))
    step = member.step
    while step < args.steps:
        losses[step] = hm.train_step(*get_batch(tokens, args.batch_size, args.block_size, step, args.data_seed))
        step += 1
        if step == args.steps:
            break
        joiners = "wait" if step in args.grow_at else "none" if args.grow_at else "admit"
        change = member.poll(step, leave=step == args.leave_at, joiners=joiners)
        if change is not None:
            hm, rec = change_members(hm, change, member, layout_of, build)
            records.append(rec)
            if hm is None:
                break
    out = {"pid_at_start": pid, "losses": losses, "records": records, "left": hm is None,
           "rank": member.rank, "world": member.world, "generation": member.generation}
    if hm is not None:
        full = hm.full_state_dict()
        out["params"] = {k: v.cpu() for k, v in full.items()} if member.rank == 0 else None
        dist.barrier()        # every rank done before any tears down (a closed socket aborts the others)
        dist.destroy_process_group()
    return out | {"pid_at_end": os.getpid()}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        parser().error(str(e))    # exit code 2, before this process joins anything
    try:
        out = run(args)
    except (ConnectionError, TimeoutError) as e:    # no store, or a job that never admitted it
        print(f"python -m minipar.adapt.grow: {e}", file=sys.stderr)
        return 1
    if args.out:
        torch.save(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
