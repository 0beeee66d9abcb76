"""``python -m minipar.train``: train the course GPT on a dp × cp × pp × tp mesh (with ep, a
mixture of experts, and ZeRO), with checkpoints that survive dead ranks, preemption, hangs,
corrupt files and NaNs.

The same command runs three ways, because :func:`minipar.runtime.launch` runs the rank function
in place when ``torchrun`` started the process::

    python -m minipar.train --dp 2 --pp 2 --tp 2 --steps 50          # 8 local ranks
    python -m minipar.train --dp 2 --cp 2 --pp 2 --ep 2 --n-experts 4 --microbatches 2 --zero 1
    torchrun --standalone --nproc_per_node 8 -m minipar.train --dp 2 --pp 2 --tp 2
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --max-restarts 3 \\
             --rdzv_endpoint HOST:29500 -m minipar.train --dp 2 --pp 2 --tp 2   # each node

Every rank builds its part of the model (:func:`minipar.hybrid.build`) and runs its step
(``HybridModel.step``) in :func:`minipar.strategy.loop` on the global batch
``minipar.data.get_batch(tokens, step)`` (the data position is the step number, nothing else); the
loop's ``after`` callback does the rest of every step (one loop per layout). With ``--checkpoint-dir`` it saves a sharded checkpoint
(:mod:`minipar.production.checkpoint`) every ``--save-every`` steps and at the end, and **continues from the
latest one by itself** (after a ``torchrun --max-restarts`` restart or a Slurm requeue), on any
mesh, with the losses the uninterrupted run would have had; ``--resume`` insists on one. Rank 0
shows a tqdm progress bar; ``--out`` writes the losses (``history``: every step's, across restarts).

Faults (:mod:`minipar.production.faults`, :mod:`minipar.runtime.flight`): ``SIGTERM``/``SIGUSR1`` finish the step in
flight, checkpoint and exit 75; a NaN/Inf loss stops at that step (exit 3, the last good
checkpoint stays ``latest``) or, with ``--nonfinite skip``, undoes the step and counts it; a rank
without progress for ``--hang-timeout`` seconds stops (exit 124) naming the collective every rank
last started. The configuration and an existing checkpoint are checked before any process starts
(a plain error, exit code 2). The trace recorder is off, so memory stays flat over long runs.
"""
from __future__ import annotations

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

from .. import hybrid, reference, strategy
from ..adapt import Adaptive, parse_slow, parse_switches, propose, fit, decide
from ..data import corpus_tokens, get_batch
from ..hybrid import check as check_mesh
from ..models.gpt import GPT
from ..plan import measure_machine
from ..runtime import flight, trace
from ..runtime import launch as launching   # called as launching.launch: looked up when called (tests replace it)
from ..runtime.backend import place
from ..runtime.launch import RankError
from . import checkpoint
from .checkpoint import CheckpointError, verify
from .faults import EXIT_HUNG, EXIT_NONFINITE, EXIT_PREEMPTED, forward_to_ranks, StopSignals, Snapshot, agree, rss_bytes
from .train_options import check_options, given_layout, model_config, parse, parser  # noqa: F401


def data_signature(args) -> dict:
    """What decides the batches: a resumed run must use the same, or its data changes."""
    return {"batch_size": args.batch_size, "block_size": args.block_size, "data_seed": args.data_seed}


def _writable(directory: Path) -> None:
    """``directory`` can be created (or written) here; nothing is created before launch."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--checkpoint-dir {directory} is a file; give a directory")
    existing = next(d for d in (directory, *directory.absolute().parents) if d.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--checkpoint-dir {directory} is not writable ({existing} is not a writable "
                         "directory); give a directory every rank can write to")


def check_resume(args, config) -> dict | None:
    """The meta of the checkpoint this run will continue from (``None``: starts fresh), after
    checking every file of it and that it was trained on this model and these batches."""
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


LAYOUT_OPTIONS = ("dp", "cp", "pp", "tp", "ep", "batch_size", "microbatches", "schedule", "virtual_stages",
                  "block_size", "n_layer", "n_head", "n_embd", "n_experts", "capacity_factor", "cp_variant",
                  "cp_layout", "recompute", "zero", "sharding", "reshard_after_forward", "dp_shard", "dtype")  # named in the layout's errors


def check(args, world_size: int | None) -> None:
    """Every problem with the arguments (and an existing checkpoint) as a ValueError, before launch."""
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir")
    check_options(args)   # each option's range was argparse's; here the options against each other
    defaults = parser()
    flags = " ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in LAYOUT_OPTIONS
                     if k in ("batch_size", "microbatches")   # always: the batch is cut by both
                     or getattr(args, k) != (0 if k == "zero" else defaults.get_default(k)))
    try:
        check_mesh(model_config(args), None, world_size, args.dp, args.pp, args.tp, args.microbatches,
                   args.schedule, args.virtual_stages, batch_size=args.batch_size, cp=args.cp,
                   layout=args.cp_layout, variant=args.cp_variant, ep=args.ep, zero=args.zero,
                   recompute=args.recompute, seq_len=args.block_size, sharding=args.sharding,
                   reshard_after_forward=args.reshard_after_forward, dp_shard=getattr(args, "dp_shard", None),
                   dtype=args.dtype)
    except ValueError as e:   # name the options: the layout's rule speaks of dp=, tp=, ...
        raise ValueError(f"{flags}: {e}") from None
    check_resume(args, model_config(args))
    if args.checkpoint_dir is not None:
        _writable(args.checkpoint_dir)


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
    with trace.recording(False), StopSignals() as signals, \
            flight.Watchdog(args.hang_timeout, dist.get_rank()):
        flight.reset()
        return _train(args, signals)


def _train(args, signals) -> dict:
    started_at, t_start = time.time(), time.perf_counter()
    config, tokens = model_config(args), corpus_tokens()[0]

    def build(lay, bounds=None):
        """A model of layout ``lay`` (with the pipeline cut ``bounds``)."""
        with torch.device("cpu"):  # seeded on the CPU, identically on every rank; build() places it
            gpt = GPT(config, seed=args.seed)
        return hybrid.build(gpt, lay.mesh(), **lay.options(), reshard_after_forward=args.reshard_after_forward,
                            schedule=args.schedule, bounds=bounds, virtual_stages=args.virtual_stages,
                            dtype=args.dtype, recompute=args.recompute, layout=args.cp_layout,
                            variant=args.cp_variant, optimizer=reference.adamw(args.lr, args.weight_decay))
    adaptive = Adaptive(build, args.steps, parse_switches(args.switch_at, args.steps),
                        getattr(args, "proposed", None) or [], args.probe_steps, parse_slow(args.slow_rank),
                        args.adapt_every)
    # --layout auto: the first candidate (the others are switched to); else the flags' layout
    model = adaptive.into(adaptive.first_layout(None) if adaptive.proposed else given_layout(args), 0)
    start, resumed_from, history, earlier = 0, None, [], []
    recovery = {"started_at": started_at, "world": dist.get_world_size(), "layout": layout_name(args),
                "build_s": time.perf_counter() - t_start, "load_s": 0.0}
    if args.checkpoint_dir and (args.checkpoint_dir / "latest").exists():
        t_load = time.perf_counter()
        meta = checkpoint.load(args.checkpoint_dir, model, model.optimizer)
        recovery["load_s"] = time.perf_counter() - t_load
        if meta["extra"].get("data") != data_signature(args):
            raise ValueError(f"the checkpoint was trained on other batches {meta['extra'].get('data')}; "
                             f"this run asks for {data_signature(args)}")
        start, resumed_from = meta["extra"]["next_step"], meta["mesh"]
        history = list(meta["extra"].get("losses", []))[:start]
        earlier = list(meta["extra"].get("recoveries", []))   # every start of this run so far
    due = [s for s in adaptive.switches if s <= start]   # resumed past a switch: its layout first
    if due:
        model = adaptive.into(adaptive.switches[max(due)], start)
    tqdm.set_lock(threading.RLock())  # tqdm's default lock is a process-shared semaphore
    bar = tqdm(total=args.steps, initial=start, desc=layout_name(args),
               unit="step", file=sys.__stderr__, disable=args.no_progress or dist.get_rank() != 0,
               mininterval=0.5)
    snapshot = Snapshot(model, model.optimizer) if args.nonfinite == "skip" else None
    every = max(1, args.steps // 10)
    losses, skipped, rss, stopped = [], [], [], None
    t0, saved = time.perf_counter(), None
    flight.arm()  # the hang watchdog counts from here
    step = start

    def after(i, loss, seconds) -> bool:
        """What the command does after every step of :func:`minipar.strategy.loop`; True ends the
        loop: a stop (a NaN without --nonfinite skip, a preemption) or another model (a switch)."""
        nonlocal model, snapshot, saved, stopped, recovery, step
        everyone, stop = agree(loss, signals.requested)  # one verdict for all ranks
        bad = [r for r, v in enumerate(everyone) if not math.isfinite(v)]
        if bad and snapshot is None:
            stopped = {"reason": "nonfinite", "step": step, "value": str(everyone[bad[0]]),
                       "ranks": bad if len(bad) < len(everyone) else None}
            return True
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
        if step == start:
            recovery |= {"step": start, "first_step_s": seconds, "first_step_at": time.time()}
        before = model
        model = adaptive.after(done, seconds)   # probe, switch, re-partition
        if model is not before and snapshot is not None:
            snapshot = Snapshot(model, model.optimizer)
        if args.checkpoint_dir and (done == args.steps or stop or
                                    args.save_every and done % args.save_every == 0):
            saved = checkpoint.save(args.checkpoint_dir, model, model.optimizer, step=done, keep=args.keep,
                                    extra={"next_step": done, "data": data_signature(args),
                                           "config": asdict(config), "losses": history + losses,
                                           "recoveries": earlier + [recovery]})
        step = done
        if stop:
            stopped = {"reason": "preempted", "step": done - 1, "signal": signals.received or "a signal",
                       "checkpoint": str(saved) if saved else None}
        if stop or model is not before:
            return True
        if snapshot is not None:
            snapshot.take()     # before the next step, off its timed body
        return False

    while step < args.steps and stopped is None:   # one loop per model: a switch starts the next
        now = model
        if snapshot is not None:
            snapshot.take()
        batches = (get_batch(tokens, args.batch_size, args.block_size, s, args.data_seed)
                   for s in range(step, args.steps))
        strategy.loop(batches, lambda i, batch: now.step(*batch), **now.loss_groups, after=after)
    bar.close()
    return {"losses": losses, "first_step": start, "resumed_from": resumed_from,
            "history": history + losses, "skipped": skipped, "stopped": stopped, "rss": rss,
            "recoveries": earlier + [recovery],
            **{k: v for k, v in adaptive.log().items() if k in ("switches", "decisions", "repartitions")},
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "seconds": time.perf_counter() - t0, "checkpoint": str(saved) if saved else None}


def layout_name(args) -> str:
    """``dp=2 cp=2 pp=2 tp=1 ep=2`` (and the ZeRO stage, if any)."""
    zero = f" zero={args.zero}" if args.zero else ""
    return " ".join(f"{k}={getattr(args, k)}" for k in ("dp", "cp", "pp", "tp", "ep")) + zero


def propose_layouts(args, world: int) -> list[dict]:
    """``--layout auto``: this machine measured (:func:`minipar.plan.measure_machine`), then
    the planner's ``--candidates`` best layouts (:func:`minipar.adapt.auto.propose`)."""
    config = model_config(args)
    cluster = measure_machine(config, world)["cluster"]
    return [{"layout": str(r["layout"]), "predicted_ms": r["predicted_ms"]}
            for r in propose(config, args.batch_size, world, cluster, k=args.candidates, dtype=args.dtype)]


def elastic(args, world: int) -> int:
    """``--elastic``: set the mesh flags to the layout :func:`minipar.adapt.auto.fit` takes on ``world``
    ranks (a plain error if none fits). Returns ``world``."""
    try:
        lay = fit(model_config(args), world, args.batch_size, zero=min(args.zero or 0, 1))
    except ValueError as e:
        parser().error(f"--elastic: {e}")
    args.dp, args.pp, args.tp, args.cp, args.microbatches = lay.dp, lay.pp, lay.tp, 1, lay.microbatches
    return world


def main(argv=None) -> int:
    args = parse(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = args.dp * args.cp * args.pp * args.tp
    if args.elastic and under_torchrun:   # the world found decides the layout (shrunk or grown)
        world = elastic(args, int(os.environ["WORLD_SIZE"]))
    try:
        check(args, int(os.environ["WORLD_SIZE"]) if under_torchrun else world)
        place(int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun else world, args.device)
    except ValueError as e:
        parser().error(str(e))  # exit code 2, before any process starts
    if args.layout == "auto":     # the planner's k best on this machine, measured here first
        args.proposed = propose_layouts(args, world)
    from . import train as this  # the workers import the rank function by name
    before = {} if under_torchrun else forward_to_ranks(world)
    try:
        results = launching.launch(this.rank_main, None if under_torchrun else world, device=args.device,
                         args=(args,), timeout=args.timeout)
    except RankError as e:
        if f"exit code {EXIT_HUNG}" not in str(e):
            raise
        print(f"minipar.production.train: {str(e).splitlines()[0]} (stopped by the hang watchdog; "
              "its report is above)", file=sys.stderr)
        return EXIT_HUNG
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    if not under_torchrun or dist.get_rank() == 0:
        r = results[0]
        where = "torchrun" if under_torchrun else "minipar.runtime.launch"
        m = r["resumed_from"]
        came = (", resumed from a " + " ".join(f"{k}={v}" for k, v in m.items()) + " checkpoint") if m else ""
        losses = f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}" if r["losses"] else "nothing to do"
        skipped = f", skipped {len(r['skipped'])} non-finite step(s) {r['skipped']}" if r["skipped"] else ""
        ended = f", ended on {r['switches'][-1]['to']}" if r["switches"] else ""
        print(f"trained steps {r['first_step']}..{r['first_step'] + len(r['losses'])} on "
              f"{layout_name(args)}{ended} ({world} rank{'s' * (world > 1)}, {where}, {results.backend}"
              f"{came}): {losses}{skipped} in {r['seconds']:.1f} s")
        if r["decisions"]:
            print("layout auto: " + "; ".join(f"{d['layout']} predicted {d['predicted_ms']:.1f} ms, measured "
                                              f"{d['measured_ms']:.1f} ms" for d in r["decisions"])
                  + f" -> {decide(r['decisions'])['layout']}")
        for sw in r["switches"]:
            print(f"switched to {sw['to']} after step {sw['step']}: {sw['plan_bytes']} bytes moved "
                  f"in {sw['seconds'] * 1e3:.1f} ms, {sw['over_alpha_beta']:.1f}× its all-to-all's α-β time "
                  f"(the rebuild apart: {sw['build_seconds'] * 1e3:.0f} ms)")
        if r["checkpoint"]:
            print(f"checkpoint: {r['checkpoint']}")
        if r["stopped"]:
            print(f"minipar.production.train: {_stop_message(r['stopped'])}", file=sys.stderr)
        if args.out:
            args.out.write_text(json.dumps({**r, "steps": args.steps, "world_size": world,
                                            "rss_by_rank": [x["rss"] for x in results],
                                            "mesh": {k: getattr(args, k) for k in ("dp", "cp", "pp", "tp", "ep")},
                                            "launcher": where, "backend": results.backend}))
    stopped = results[0]["stopped"]
    code = (EXIT_PREEMPTED if stopped["reason"] == "preempted" else EXIT_NONFINITE) if stopped else 0
    if under_torchrun:   # every rank done (rank 0 has written) before any tears down: a rank that exits
        dist.barrier()   # first closes its sockets under the others' teardown, which can abort them
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)   # no static destructors: a C++ thread still joinable there aborted a finished rank
    return code          # ("terminate called without an active exception", exit -6, a restarted worker)


if __name__ == "__main__":
    sys.exit(main())
