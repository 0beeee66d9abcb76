"""The options of ``python -m minipar.train`` and their validation, before any rank starts.

Every option is checked in the driver: a value that cannot be right (zero, negative, not a
number, infinite, out of range, or inconsistent with another option) is one line on stderr
naming the option, and exit status 2, before any process starts or any file is written::

    $ python -m minipar.train --lr nan
    python -m minipar.train: error: --lr must be > 0 (a finite number), got nan

The checks come in two layers: each option's own range, in its argparse ``type`` (:func:`integer`,
:func:`real`), and the options against each other, in :func:`check_options`; the layout itself is
then :func:`minipar.hybrid.check`'s.
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from ..adapt import Layout, check_layout, parse_slow, parse_switches, same_step
from ..context_parallel.attention import VARIANTS
from ..context_parallel.sharding import LAYOUTS
from ..data import corpus_tokens
from ..hybrid import check as check_mesh
from ..models.gpt import GPTConfig
from ..pipeline.schedules import SCHEDULES

VOCAB_MULTIPLE = 8  # the corpus's 63 characters padded to 64: any tp up to 8 divides it


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block): ``prog: error: message``."""

    def error(self, message):
        line = re.sub(r"^argument (--[\w-]+): must", r"\1 must", message.splitlines()[0])
        self.exit(2, f"{self.prog}: error: {line}\n")


def integer(low: int):
    """An argparse type: an int ≥ ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be >= {low} (an integer), got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} (an integer), got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def real(low: float, strict: bool):
    """An argparse type: a finite float > ``low`` (``strict``) or ≥ ``low``."""
    sign = ">" if strict else ">="

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {sign} {low:g} (a finite number), got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {sign} {low:g} (a finite number), got {text}")
        return value
    parse.__name__ = f"number {sign} {low:g}"
    return parse


POSITIVE, NATURAL = integer(1), integer(0)


DESCRIPTION = "The course GPT on any mesh of dp, cp, pp, tp and ep, resumable from its checkpoints."


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m minipar.train", description=DESCRIPTION,
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mesh = p.add_argument_group("mesh")
    for dim, what in (("dp", "data"), ("pp", "pipeline"), ("tp", "tensor"), ("cp", "context"),
                      ("ep", "expert")):
        mesh.add_argument(f"--{dim}", type=POSITIVE, default=1,
                          help=f"{what}-parallel size" + (" (carved out of dp·cp)" if dim == "ep" else ""))
    mesh.add_argument("--dp-shard", type=POSITIVE, default=None,
                      help="HSDP: ZeRO-3 within blocks of this many data-parallel ranks (dp = R·S)")
    mesh.add_argument("--dp-replicate", type=POSITIVE, default=None,
                      help="HSDP: the blocks' replicas, their gradient shards all-reduced (dp = R·S)")
    mesh.add_argument("--cp-variant", choices=VARIANTS, default="ring", help="context-parallel attention")
    mesh.add_argument("--cp-layout", choices=LAYOUTS, default="zigzag", help="how sequences are cut over cp")
    mesh.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                      help="ZeRO stage (dense parameters sharded over dp·cp, experts' over expert-dp)")
    mesh.add_argument("--sharding", choices=("flat", "per-parameter"), default="flat",
                      help="ZeRO-3's storage: flat units (FSDP1) or per-parameter shards (fully_shard, FSDP2)")
    mesh.add_argument("--reshard-after-forward", choices=("auto", "always", "never"), default="auto",
                      help="ZeRO-3: free a layer's gathered weights after each use (always) or keep them "
                           "across the step's micro-batches (never); auto: never with --pp, else always")
    mesh.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    mesh.add_argument("--virtual-stages", type=POSITIVE, default=1, help="stages per rank (interleaved)")
    mesh.add_argument("--microbatches", type=POSITIVE, default=1, help="micro-batches per dp shard")
    mesh.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                      help="compute dtype (bf16: autocast, fp32 master weights and optimizer state)")
    mesh.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                      help="activation recomputation in every block")
    model = p.add_argument_group("model and data")
    for flag, default in (("--n-layer", 2), ("--n-head", 4), ("--n-embd", 32), ("--block-size", 32)):
        model.add_argument(flag, type=POSITIVE, default=default)
    model.add_argument("--n-experts", type=NATURAL, default=0, help="experts per MoE layer (0: a dense GPT)")
    model.add_argument("--moe-every", type=POSITIVE, default=1, help="every k-th block's MLP is an MoE layer")
    model.add_argument("--top-k", type=POSITIVE, default=2, help="experts per token")
    model.add_argument("--capacity-factor", type=real(0, strict=True), default=None,
                       help="expert capacity C = ceil(k·S/E · factor) per micro-batch (default: dropless)")
    model.add_argument("--seed", type=NATURAL, default=0, help="model initialisation")
    model.add_argument("--data-seed", type=NATURAL, default=0, help="which batches")
    model.add_argument("--batch-size", type=POSITIVE, default=8, help="global batch")
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=POSITIVE, default=20, help="train until this many steps are done")
    run.add_argument("--lr", type=real(0, strict=True), default=1e-2, help="AdamW learning rate")
    run.add_argument("--weight-decay", type=real(0, strict=False), default=0.1)
    run.add_argument("--checkpoint-dir", type=Path, default=None,
                     help="save here, and continue from its latest checkpoint if there is one")
    run.add_argument("--save-every", type=NATURAL, default=0, help="steps between checkpoints (0: at the end only)")
    run.add_argument("--keep", type=POSITIVE, default=2, help="checkpoints to keep")
    run.add_argument("--resume", action="store_true", help="require a checkpoint to continue from")
    run.add_argument("--out", type=Path, default=None, help="write the losses here (JSON)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="where the ranks compute (minipar.runtime.launch's placement: NCCL with a GPU per "
                          "rank, ranks sharing GPUs over Gloo, or the CPU)")
    run.add_argument("--switch-at", action="append", default=[], metavar="STEP=LAYOUT",
                     help="after STEP, move live to LAYOUT (e.g. 4=pp=2,tp=2,zero=1); repeatable")
    run.add_argument("--adapt-every", type=POSITIVE, default=None, metavar="N",
                     help="every N steps, re-cut the pipeline from measured layer times if it pays")
    run.add_argument("--elastic", action="store_true",
                     help="take a layout for the ranks found at each (re)start, e.g. under torchrun --nnodes 3:4; "
                          "the mesh flags give the first world")
    run.add_argument("--layout", choices=("given", "auto"), default="given",
                     help="auto: train --probe-steps on each of the planner's --candidates best layouts "
                          "of the mesh's ranks, then on the fastest measured")
    run.add_argument("--candidates", type=POSITIVE, default=3, help="layouts --layout auto measures")
    run.add_argument("--probe-steps", type=POSITIVE, default=3, help="steps per candidate (the first: warm-up)")
    run.add_argument("--timeout", type=real(0, strict=True), default=1800.0, help="seconds (minipar.runtime.launch only)")
    faults = p.add_argument_group("faults")
    faults.add_argument("--hang-timeout", type=real(0, strict=False), default=600.0,
                        help="seconds without progress before a rank stops, naming the collectives (0: never)")
    faults.add_argument("--slow-rank", default=None, metavar="R:FACTOR",
                        help="fault injection: rank R computes FACTOR times slower (a straggler)")
    faults.add_argument("--nonfinite", choices=("stop", "skip"), default="stop",
                        help="at a NaN/Inf loss: stop (keep the last good checkpoint) or undo the step and go on")
    return p


def parse(argv=None) -> argparse.Namespace:
    """The arguments (exit 2 on a bad option); ``zero`` is 0 when not given."""
    p = parser()
    args = p.parse_args(argv)
    args.zero = args.zero or 0
    if args.dp_shard is not None or args.dp_replicate is not None:   # HSDP: dp = R·S
        shard, replicas = args.dp_shard or 1, args.dp_replicate or 1
        if args.dp != 1 and args.dp != shard * replicas:
            p.error(f"argument --dp: --dp {args.dp} but --dp-replicate {replicas} × --dp-shard {shard} "
                    f"= {shard * replicas}; give one or the other")
        args.dp, args.dp_shard, args.dp_replicate = shard * replicas, shard, replicas
    return args


def model_config(args):
    """The course GPT these options describe (a mixture of experts with ``--n-experts``)."""
    vocab = -(-corpus_tokens()[1].vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE  # rounded up
    moe = dict(moe_every=args.moe_every, n_experts=args.n_experts, top_k=args.top_k,
               capacity_factor=args.capacity_factor) if args.n_experts else {}
    return GPTConfig(vocab_size=vocab, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd, **moe)


def check_options(args) -> None:
    """The options against each other: a ``ValueError`` naming them."""
    if args.n_embd % args.n_head:
        raise ValueError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if not args.n_experts:
        for flag, value, default in (("--ep", args.ep, 1), ("--capacity-factor", args.capacity_factor, None)):
            if value != default:
                raise ValueError(f"{flag} {value} needs experts: give --n-experts (0 is a dense GPT)")
    else:
        if args.n_experts < 2:
            raise ValueError(f"--n-experts {args.n_experts}: a mixture needs at least 2 experts (0: dense)")
        if args.top_k > args.n_experts:
            raise ValueError(f"--top-k {args.top_k} exceeds --n-experts {args.n_experts}")
        if args.n_experts % args.ep:
            raise ValueError(f"--n-experts {args.n_experts} cannot be split evenly over --ep {args.ep}")
        if args.moe_every > args.n_layer:
            raise ValueError(f"--moe-every {args.moe_every} > --n-layer {args.n_layer}: no block would be MoE")
    if (args.dp * args.cp) % args.ep:
        raise ValueError(f"--ep {args.ep} must divide --dp × --cp = {args.dp * args.cp} "
                         "(the expert groups are carved out of the data and context ranks)")
    if args.sharding == "per-parameter" and args.zero != 3:
        raise ValueError(f"--sharding per-parameter is ZeRO-3's storage: it needs --zero 3 (got --zero {args.zero})")
    if getattr(args, "dp_shard", None) is not None and args.zero != 3:
        raise ValueError(f"--dp-shard {args.dp_shard} × --dp-replicate {args.dp_replicate} is HSDP, ZeRO-3 within "
                         f"blocks of ranks: it needs --zero 3 (got --zero {args.zero})")
    if args.reshard_after_forward != "auto" and args.zero != 3:
        raise ValueError(f"--reshard-after-forward {args.reshard_after_forward} is ZeRO-3's policy: "
                         f"it needs --zero 3 (got --zero {args.zero})")
    if args.zero == 3 and args.nonfinite == "skip":
        raise ValueError("--nonfinite skip with --zero 3: the undo snapshot needs whole parameters; "
                         "use --zero 1 or 2")
    if args.virtual_stages > 1 and args.schedule != "interleaved":
        raise ValueError(f"--virtual-stages {args.virtual_stages} needs --schedule interleaved")
    if args.out is not None and not args.out.parent.is_dir():
        raise ValueError(f"--out {args.out}: the directory {args.out.parent} does not exist")
    if args.out is not None and args.out.is_dir():
        raise ValueError(f"--out {args.out} is a directory; give a file name")
    if args.switch_at:
        check_switches(args)
    if args.layout == "auto":
        check_auto(args)
    if args.elastic and (getattr(args, "dp_shard", None) or args.n_experts or args.layout == "auto"):
        raise ValueError("--elastic chooses a dense GPT's dp × pp × tp layout for the ranks it finds: "
                         "it does not combine with --dp-shard, --n-experts or --layout auto")
    if args.slow_rank is not None:
        try:
            rank, _ = parse_slow(args.slow_rank)
        except ValueError as e:
            raise ValueError(f"--slow-rank: {e}") from None
        if rank >= args.dp * args.cp * args.pp * args.tp:
            raise ValueError(f"--slow-rank {args.slow_rank}: the job has ranks 0..{args.dp * args.cp * args.pp * args.tp - 1}")
    if args.adapt_every is not None and (args.n_experts or args.dtype != "fp32" or getattr(args, "dp_shard", None)):
        raise ValueError("--adapt-every re-cuts a dense GPT's fp32 pipeline: drop --n-experts, "
                         f"--dtype {args.dtype} or --dp-shard")


def check_auto(args) -> None:
    """``--layout auto``: any GPT the command trains (experts and bf16 included), the probes inside
    the run, nothing it would override."""
    if args.switch_at or args.checkpoint_dir or args.nonfinite != "stop":
        raise ValueError("--layout auto measures live switches from step 0: it does not "
                         "combine with --switch-at, --checkpoint-dir or --nonfinite skip")
    world = args.dp * args.cp * args.pp * args.tp
    if world < 2:
        raise ValueError("--layout auto measures the layouts of several ranks and keeps the fastest; one rank "
                         "has a single layout: give the ranks to share (e.g. --dp 4) or drop --layout auto")
    if args.probe_steps < 2:
        raise ValueError(f"--probe-steps {args.probe_steps}: a candidate needs 2 steps (the first is a warm-up)")
    if args.candidates * args.probe_steps > args.steps:
        raise ValueError(f"--candidates {args.candidates} × --probe-steps {args.probe_steps} exceed --steps {args.steps}")


def given_layout(args):
    """The run's first layout, as the flags give it (:class:`minipar.adapt.Layout`)."""
    return Layout(dp=args.dp, pp=args.pp, tp=args.tp, cp=args.cp, ep=args.ep, zero=args.zero or 0,
                  sharding=args.sharding, dp_shard=getattr(args, "dp_shard", None),
                  m=None if args.microbatches == args.pp else args.microbatches)


def check_switches(args) -> None:
    """``--switch-at``: every layout fits the world, the global batch and the mesh's rules (experts,
    ZeRO, HSDP), every step the run; any layout the command trains can be switched to, with the
    run's dtype (:mod:`minipar.adapt`), except where the step after the switch would be another
    model's (:func:`minipar.adapt.layout.same_step`: a mixture of experts whose micro-batches change)."""
    try:
        switches = parse_switches(args.switch_at, args.steps)
    except ValueError as e:
        raise ValueError(f"--switch-at: {e}") from None
    world, config, old = args.dp * args.cp * args.pp * args.tp, model_config(args), given_layout(args)
    for step, layout in switches:
        try:
            check_layout(layout, world, args.batch_size)
            check_mesh(config, None, world, layout.dp, layout.pp, layout.tp, layout.microbatches, args.schedule,
                       args.virtual_stages, batch_size=args.batch_size, cp=layout.cp, layout=args.cp_layout,
                       variant=args.cp_variant, ep=layout.ep, zero=layout.zero, recompute=args.recompute,
                       seq_len=args.block_size, sharding=layout.sharding,
                       reshard_after_forward=args.reshard_after_forward, dp_shard=layout.dp_shard,
                       dtype=args.dtype)
            why = same_step(old, layout, config)
            if why is not None:
                raise ValueError(f"from {old}: {why}")
        except ValueError as e:
            raise ValueError(f"--switch-at {step}={layout}: {e}") from None
        old = layout
