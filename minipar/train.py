"""``python -m minipar.train``: train the course GPT on a dp × pp × tp mesh, with checkpoints.

The same command runs three ways, because :func:`minipar.launch` runs the rank function
in place when ``torchrun`` started the process::

    python -m minipar.train --dp 2 --pp 2 --tp 2 --steps 50          # 8 local ranks
    torchrun --standalone --nproc_per_node 8 -m minipar.train --dp 2 --pp 2 --tp 2
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d \\
             --rdzv_endpoint HOST:29500 -m minipar.train --dp 2 --pp 2 --tp 2   # each node

Every rank builds its part of the model (:func:`minipar.hybrid.build`), draws the same
global batch ``minipar.data.get_batch(tokens, step)`` for every step (the data position is
the step number, nothing else) and calls ``train_step``. With ``--checkpoint-dir`` it saves
a sharded checkpoint every ``--save-every`` steps and at the end (:mod:`minipar.checkpoint`);
``--resume`` continues from the latest one, on any mesh, with the losses the uninterrupted
run would have had. Global rank 0 shows a tqdm progress bar; ``--out`` writes the losses.

The configuration is checked before any process starts (a plain error, exit code 2).
The models compute on CPU tensors, so the backend is Gloo even where GPUs are present.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

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
    model = p.add_argument_group("model and data")
    model.add_argument("--n-layer", type=int, default=2)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--n-embd", type=int, default=32)
    model.add_argument("--block-size", type=int, default=32)
    model.add_argument("--seed", type=int, default=0, help="model initialisation")
    model.add_argument("--data-seed", type=int, default=0, help="which batches")
    model.add_argument("--batch-size", type=int, default=8, help="global batch")
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=20, help="train until this many steps are done")
    run.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    run.add_argument("--weight-decay", type=float, default=0.1)
    run.add_argument("--checkpoint-dir", type=Path, default=None)
    run.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    run.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    run.add_argument("--out", type=Path, default=None, help="write the losses here (JSON)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--timeout", type=float, default=1800.0, help="seconds (minipar.launch only)")
    return p


def gpt_config(args):
    from .data import corpus_tokens
    from .models.gpt import GPTConfig
    vocab = corpus_tokens()[1].vocab_size
    vocab = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return GPTConfig(vocab_size=vocab, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)


def check(args, world_size: int | None) -> None:
    """Every problem with the arguments, as a ``ValueError``, before any process starts."""
    from .hybrid import check_config
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir")
    if args.steps < 1 or args.save_every < 0 or args.keep < 1:
        raise ValueError("--steps and --keep must be positive, --save-every >= 0")
    check_config(gpt_config(args), args.dp, args.pp, args.tp, world_size, args.microbatches,
                 args.batch_size, args.schedule)


def data_signature(args) -> dict:
    """What decides the batches: a resumed run must use the same, or its data changes."""
    return {"batch_size": args.batch_size, "block_size": args.block_size, "data_seed": args.data_seed}


def rank_main(args) -> dict:
    """Every rank: build the mesh and the model, resume, train, save. Returns the losses."""
    from . import checkpoint, hybrid
    from .data import corpus_tokens, get_batch
    from .mesh import ProcessMesh
    config, tokens = gpt_config(args), corpus_tokens()[0]
    mesh = ProcessMesh(dp=args.dp, pp=args.pp, tp=args.tp).build()
    model = hybrid.build(config, mesh, seed=args.seed, zero1=args.zero1, schedule=args.schedule,
                         microbatches=args.microbatches, optimizer_cls=torch.optim.AdamW,
                         optimizer_kwargs={"lr": args.lr, "weight_decay": args.weight_decay})
    start, resumed_from = 0, None
    if args.resume and checkpoint.committed(args.checkpoint_dir):
        meta = checkpoint.load(args.checkpoint_dir, model, model.optimizer)
        if meta["extra"].get("data") != data_signature(args):
            raise ValueError(f"the checkpoint was trained on other batches {meta['extra'].get('data')}; "
                             f"this run asks for {data_signature(args)}")
        start, resumed_from = meta["extra"]["next_step"], meta["mesh"]
    rank0 = dist.get_rank() == 0
    tqdm.set_lock(threading.RLock())  # tqdm's default lock is a process-shared semaphore
    bar = tqdm(total=args.steps, initial=start, desc=f"dp={args.dp} pp={args.pp} tp={args.tp}",
               unit="step", file=sys.__stderr__, disable=args.no_progress or not rank0,
               mininterval=0.5)
    losses, t0, saved = [], time.perf_counter(), None
    for step in range(start, args.steps):
        losses.append(model.train_step(*get_batch(tokens, args.batch_size, args.block_size, step,
                                                  args.data_seed)))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        done = step + 1
        if args.checkpoint_dir and (done == args.steps or args.save_every and done % args.save_every == 0):
            saved = checkpoint.save(args.checkpoint_dir, model, model.optimizer, step=done, keep=args.keep,
                                    extra={"next_step": done, "data": data_signature(args),
                                           "config": asdict(config)})
    bar.close()
    return {"losses": losses, "first_step": start, "resumed_from": resumed_from,
            "seconds": time.perf_counter() - t0, "checkpoint": str(saved) if saved else None}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = args.dp * args.pp * args.tp
    try:
        check(args, int(os.environ["WORLD_SIZE"]) if under_torchrun else world)
    except ValueError as e:
        parser().error(str(e))  # exit code 2, before any process starts
    from . import launch
    from . import train as this  # the workers import the rank function by name
    results = launch(this.rank_main, None if under_torchrun else world, backend="gloo",
                     args=(args,), timeout=args.timeout)
    if not under_torchrun or dist.get_rank() == 0:
        r = results[0]
        where = "torchrun" if under_torchrun else "minipar.launch"
        m = r["resumed_from"]
        came = f", resumed from a dp={m['dp']} pp={m['pp']} tp={m['tp']} checkpoint" if m else ""
        losses = f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}" if r["losses"] else "nothing to do"
        print(f"trained steps {r['first_step']}..{args.steps} on dp={args.dp} pp={args.pp} tp={args.tp} "
              f"({world} rank{'s' * (world > 1)}, {where}, {results.backend}{came}): {losses} in {r['seconds']:.1f} s")
        if r["checkpoint"]:
            print(f"checkpoint: {r['checkpoint']}")
        if args.out:
            args.out.write_text(json.dumps({**r, "steps": args.steps, "world_size": world,
                                            "mesh": {"dp": args.dp, "pp": args.pp, "tp": args.tp},
                                            "launcher": where, "backend": results.backend}))
    if under_torchrun:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
