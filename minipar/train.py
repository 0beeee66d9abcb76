"""``python -m minipar.train``: train the course GPT on a dp × pp × tp mesh, with checkpoints
that survive dead ranks, preemption, hangs, corrupt files and NaNs.

The same command runs three ways, because :func:`minipar.launch` runs the rank function
in place when ``torchrun`` started the process::

    python -m minipar.train --dp 2 --pp 2 --tp 2 --steps 50          # 8 local ranks
    torchrun --standalone --nproc_per_node 8 -m minipar.train --dp 2 --pp 2 --tp 2
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --max-restarts 3 \\
             --rdzv_endpoint HOST:29500 -m minipar.train --dp 2 --pp 2 --tp 2   # each node

Every rank builds its part of the model (:func:`minipar.hybrid.build`) and calls ``train_step``
on the global batch ``minipar.data.get_batch(tokens, step)`` (the data position is the step
number, nothing else). With ``--checkpoint-dir`` it saves a sharded checkpoint
(:mod:`minipar.checkpoint`) every ``--save-every`` steps and at the end, and **continues from the
latest one by itself** (after a ``torchrun --max-restarts`` restart or a Slurm requeue), on any
mesh, with the losses the uninterrupted run would have had; ``--resume`` insists on one. Rank 0
shows a tqdm progress bar; ``--out`` writes the losses (``history``: every step's, across restarts).

Faults (:mod:`minipar.faults`, :mod:`minipar.flight`): ``SIGTERM``/``SIGUSR1`` finish the step in
flight, checkpoint and exit 75; a NaN/Inf loss stops at that step (exit 3, the last good
checkpoint stays ``latest``) or, with ``--nonfinite skip``, undoes the step and counts it; a rank
without progress for ``--hang-timeout`` seconds stops (exit 124) naming the collective every rank
last started. The configuration and an existing checkpoint are checked before any process starts
(a plain error, exit code 2). The trace recorder is off, so memory stays flat over long runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from .faults import EXIT_HUNG, EXIT_NONFINITE, EXIT_PREEMPTED, forward_to_ranks

VOCAB_MULTIPLE = 8  # the corpus's 63 characters padded to 64: any tp up to 8 divides it


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minipar.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mesh = p.add_argument_group("mesh")
    for dim, what in (("dp", "data"), ("pp", "pipeline"), ("tp", "tensor")):
        mesh.add_argument(f"--{dim}", type=int, default=1, help=f"{what}-parallel size")
    mesh.add_argument("--zero1", action="store_true", help="shard optimizer state over dp (ZeRO-1)")
    mesh.add_argument("--schedule", default="1f1b", help="pipeline schedule")
    mesh.add_argument("--microbatches", type=int, default=1, help="micro-batches per dp shard")
    mesh.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                      help="compute dtype (bf16: autocast, fp32 master weights and optimizer state)")
    mesh.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                      help="activation recomputation in every block")
    model = p.add_argument_group("model and data")
    for flag, default in (("--n-layer", 2), ("--n-head", 4), ("--n-embd", 32), ("--block-size", 32)):
        model.add_argument(flag, type=int, default=default)
    model.add_argument("--seed", type=int, default=0, help="model initialisation")
    model.add_argument("--data-seed", type=int, default=0, help="which batches")
    model.add_argument("--batch-size", type=int, default=8, help="global batch")
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=20, help="train until this many steps are done")
    run.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    run.add_argument("--weight-decay", type=float, default=0.1)
    run.add_argument("--checkpoint-dir", type=Path, default=None,
                     help="save here, and continue from its latest checkpoint if there is one")
    run.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    run.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    run.add_argument("--resume", action="store_true", help="require a checkpoint to continue from")
    run.add_argument("--out", type=Path, default=None, help="write the losses here (JSON)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="where the ranks compute (minipar.launch's placement: NCCL with a GPU per "
                          "rank, ranks sharing GPUs over Gloo, or the CPU)")
    run.add_argument("--timeout", type=float, default=1800.0, help="seconds (minipar.launch only)")
    faults = p.add_argument_group("faults")
    faults.add_argument("--hang-timeout", type=float, default=600.0,
                        help="seconds without progress before a rank stops, naming the collectives (0: never)")
    faults.add_argument("--nonfinite", choices=("stop", "skip"), default="stop",
                        help="at a NaN/Inf loss: stop (keep the last good checkpoint) or undo the step and go on")
    return p


def gpt_config(args):
    from .data import corpus_tokens
    from .models.gpt import GPTConfig
    vocab = -(-corpus_tokens()[1].vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE  # rounded up
    return GPTConfig(vocab_size=vocab, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)


def data_signature(args) -> dict:
    """What decides the batches: a resumed run must use the same, or its data changes."""
    return {"batch_size": args.batch_size, "block_size": args.block_size, "data_seed": args.data_seed}


def _writable(directory: Path) -> None:
    probe = directory / f".minipar-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {directory} is not writable ({e.strerror or e}); "
                         "give a directory every rank can write to") from None


def check_resume(args, config) -> dict | None:
    """The meta of the checkpoint this run will continue from (``None``: starts fresh), after
    checking every file of it and that it was trained on this model and these batches."""
    from .checkpoint import CheckpointError, verify
    root = args.checkpoint_dir
    if root is None or not (root / "latest").exists():
        if args.resume:
            raise ValueError(f"--resume: there is no checkpoint in {root} (no {root}/latest); "
                             "drop --resume to start a new run there")
        return None
    try:
        meta = verify(root)
    except CheckpointError as e:
        raise ValueError(f"cannot continue from the checkpoint: {e}") from None
    extra, have = meta["extra"], meta["extra"].get("config", {})
    diff = [f"{k}={have.get(k)} (this run: {v})" for k, v in asdict(config).items() if have.get(k) != v]
    if diff:
        raise ValueError(f"{root}/latest holds a checkpoint of another model configuration: "
                         f"{', '.join(diff)}; use another --checkpoint-dir or the same model")
    if extra.get("data") != data_signature(args):
        raise ValueError(f"the checkpoint in {root} was trained on other batches {extra.get('data')}; "
                         f"this run asks for {data_signature(args)}")
    return meta


def check(args, world_size: int | None) -> None:
    """Every problem with the arguments (and an existing checkpoint) as a ValueError, before launch."""
    from .hybrid import check as check_mesh
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir")
    if args.steps < 1 or args.save_every < 0 or args.keep < 1:
        raise ValueError("--steps and --keep must be positive, --save-every >= 0")
    if args.hang_timeout < 0:
        raise ValueError("--hang-timeout must be >= 0 seconds (0: no watchdog)")
    check_mesh(gpt_config(args), None, world_size, args.dp, args.pp, args.tp, args.microbatches,
               args.schedule, batch_size=args.batch_size)
    if args.checkpoint_dir is not None:
        _writable(args.checkpoint_dir)
    check_resume(args, gpt_config(args))


def _stop_message(stopped: dict) -> str:
    if stopped["reason"] == "preempted":
        saved = (f"checkpoint {stopped['checkpoint']}" if stopped.get("checkpoint")
                 else "no --checkpoint-dir: nothing saved")
        return (f"stopped by {stopped['signal']} after step {stopped['step']} ({saved}); run the same "
                f"command again to continue (exit code {EXIT_PREEMPTED})")
    ranks = stopped["ranks"]
    where = "on every rank" if ranks is None else f"on rank(s) {ranks} only (the others: finite)"
    return (f"the loss of step {stopped['step']} is {stopped['value']} {where}: stopped; "
            f"the last good checkpoint stays `latest` (exit code {EXIT_NONFINITE}; "
            "--nonfinite skip undoes such steps instead)")


def rank_main(args) -> dict:
    """Every rank: build the mesh and the model, resume, train, save. Returns the losses."""
    from . import flight, trace
    from .faults import StopSignals
    with trace.recording(False), StopSignals() as signals, \
            flight.Watchdog(args.hang_timeout, dist.get_rank()):
        flight.reset()
        return _train(args, signals)


def _train(args, signals) -> dict:
    from . import checkpoint, flight, hybrid, reference
    from .data import corpus_tokens, get_batch
    from .faults import Snapshot, agree, rss_bytes
    from .mesh import ProcessMesh
    from .models.gpt import GPT
    config, tokens = gpt_config(args), corpus_tokens()[0]
    mesh = ProcessMesh(dp=args.dp, pp=args.pp, tp=args.tp).build()
    with torch.device("cpu"):  # seeded on the CPU, identically on every rank; build() places it
        gpt = GPT(config, seed=args.seed)
    model = hybrid.build(gpt, mesh, zero1=args.zero1, schedule=args.schedule,
                         microbatches=args.microbatches, dtype=args.dtype, recompute=args.recompute,
                         optimizer=reference.adamw(args.lr, args.weight_decay))
    start, resumed_from, history = 0, None, []
    if args.checkpoint_dir and (args.checkpoint_dir / "latest").exists():
        meta = checkpoint.load(args.checkpoint_dir, model, model.optimizer)
        if meta["extra"].get("data") != data_signature(args):
            raise ValueError(f"the checkpoint was trained on other batches {meta['extra'].get('data')}; "
                             f"this run asks for {data_signature(args)}")
        start, resumed_from = meta["extra"]["next_step"], meta["mesh"]
        history = list(meta["extra"].get("losses", []))[:start]
    tqdm.set_lock(threading.RLock())  # tqdm's default lock is a process-shared semaphore
    bar = tqdm(total=args.steps, initial=start, desc=f"dp={args.dp} pp={args.pp} tp={args.tp}",
               unit="step", file=sys.__stderr__, disable=args.no_progress or dist.get_rank() != 0,
               mininterval=0.5)
    snapshot = Snapshot(model, model.optimizer) if args.nonfinite == "skip" else None
    every = max(1, args.steps // 10)
    losses, skipped, rss, stopped = [], [], [], None
    t0, saved = time.perf_counter(), None
    flight.arm()  # the hang watchdog counts from here
    for step in range(start, args.steps):
        if snapshot is not None:
            snapshot.take()
        loss = model.train_step(*get_batch(tokens, args.batch_size, args.block_size, step,
                                           args.data_seed))
        everyone, stop = agree(loss, signals.requested)  # one verdict for all ranks
        bad = [r for r, v in enumerate(everyone) if not math.isfinite(v)]
        if bad and snapshot is None:
            stopped = {"reason": "nonfinite", "step": step, "value": str(everyone[bad[0]]),
                       "ranks": bad if len(bad) < len(everyone) else None}
            break
        if bad:
            snapshot.restore()  # the step never happened; its batch is not seen again
            skipped.append(step)
        losses.append(loss)
        flight.beat()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        done = step + 1
        if done % every == 0 or done == args.steps:
            rss.append([done, rss_bytes()])
        if args.checkpoint_dir and (done == args.steps or stop or
                                    args.save_every and done % args.save_every == 0):
            saved = checkpoint.save(args.checkpoint_dir, model, model.optimizer, step=done, keep=args.keep,
                                    extra={"next_step": done, "data": data_signature(args),
                                           "config": asdict(config), "losses": history + losses})
        if stop:
            stopped = {"reason": "preempted", "step": step, "signal": signals.received or "a signal",
                       "checkpoint": str(saved) if saved else None}
            break
    bar.close()
    return {"losses": losses, "first_step": start, "resumed_from": resumed_from,
            "history": history + losses, "skipped": skipped, "stopped": stopped, "rss": rss,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "seconds": time.perf_counter() - t0, "checkpoint": str(saved) if saved else None}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = args.dp * args.pp * args.tp
    try:
        check(args, int(os.environ["WORLD_SIZE"]) if under_torchrun else world)
        from .backend import place  # --device cuda without a GPU: a plain error here
        place(int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun else world, args.device)
    except ValueError as e:
        parser().error(str(e))  # exit code 2, before any process starts
    from . import train as this  # the workers import the rank function by name
    from .launch import RankError, launch
    before = {} if under_torchrun else forward_to_ranks(world)
    try:
        results = launch(this.rank_main, None if under_torchrun else world, device=args.device,
                         args=(args,), timeout=args.timeout)
    except RankError as e:
        if f"exit code {EXIT_HUNG}" not in str(e):
            raise
        print(f"minipar.train: {str(e).splitlines()[0]} (stopped by the hang watchdog; "
              "its report is above)", file=sys.stderr)
        return EXIT_HUNG
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    if not under_torchrun or dist.get_rank() == 0:
        r = results[0]
        where = "torchrun" if under_torchrun else "minipar.launch"
        m = r["resumed_from"]
        came = f", resumed from a dp={m['dp']} pp={m['pp']} tp={m['tp']} checkpoint" if m else ""
        losses = f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}" if r["losses"] else "nothing to do"
        skipped = f", skipped {len(r['skipped'])} non-finite step(s) {r['skipped']}" if r["skipped"] else ""
        print(f"trained steps {r['first_step']}..{r['first_step'] + len(r['losses'])} on dp={args.dp} "
              f"pp={args.pp} tp={args.tp} ({world} rank{'s' * (world > 1)}, {where}, {results.backend}"
              f"{came}): {losses}{skipped} in {r['seconds']:.1f} s")
        if r["checkpoint"]:
            print(f"checkpoint: {r['checkpoint']}")
        if r["stopped"]:
            print(f"minipar.train: {_stop_message(r['stopped'])}", file=sys.stderr)
        if args.out:
            args.out.write_text(json.dumps({**r, "steps": args.steps, "world_size": world,
                                            "rss_by_rank": [x["rss"] for x in results],
                                            "mesh": {"dp": args.dp, "pp": args.pp, "tp": args.tp},
                                            "launcher": where, "backend": results.backend}))
    stopped = results[0]["stopped"]
    code = (EXIT_PREEMPTED if stopped["reason"] == "preempted" else EXIT_NONFINITE) if stopped else 0
    if under_torchrun:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
