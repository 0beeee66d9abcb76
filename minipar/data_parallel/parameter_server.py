"""Asynchronous data parallelism: a parameter server and workers that never wait for each other.

Where data parallelism started (Dean et al., "Large Scale Distributed Deep Networks" (Downpour
SGD), 2012; Li et al., "Scaling Distributed Machine Learning with the Parameter Server", 2014).
Group rank 0, the **server**, owns the weights and the optimizer. Ranks 1..W, the **workers**,
loop: pull the weights (version v), compute a gradient on their own batch, push it. The server
applies each gradient as it arrives, so no worker waits for a slower one, at the price of
**staleness**: a gradient computed at version v is applied to the weights at version t,

    w_{t+1} = w_t - η · ∇L(w_{t-τ}),      τ = t - v  (the staleness)

With W equally fast workers τ ≈ W-1 on average (:func:`minipar.cost.expected_staleness`).
``max_staleness=s`` drops a gradient with τ > s (its worker gets fresh weights).
``synchronous=True`` is the classic alternative: the server averages one gradient from every
worker and applies one step (τ = 0; single-process SGD on the W batches together). Messages are
flat fp32 tensors, worker -> server ``[v, loss, grad...]`` and server -> worker
``[version, stop, weights...]``; the server receives from *any* worker (Gloo's any-source receive:
NCCL has none, so pushes travel as CPU tensors, which a ``cpu:gloo,cuda:nccl`` group gives Gloo).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import comm, strategy
from ..data import shard
from ..runtime import trace, transport
from ..reference import sgd
from .naive import flatten, unflatten_into, broadcast_module, trainable


def parameter_server(model, batch_fn, steps: int, make_optimizer=None, group=None, synchronous: bool = False,
                     max_staleness: int | None = None, delays=None, eval_batch=None, dtype=None) -> dict:
    """Run on every rank of ``group``: rank 0 serves, the others work, for ``steps`` updates.
    ``batch_fn(i) -> (x, y)`` gives batch i; worker w (1..W) uses batches ``k·W + w-1``, k = 0,
    1, ... ``delays[w-1]``: extra seconds worker w sleeps per gradient (a simulated straggler).
    ``eval_batch``: the server records the loss on it after every update. Returns, on the
    server, ``losses`` (workers' training losses of the applied gradients), ``eval_losses``,
    ``times`` (seconds since start), ``staleness`` and ``workers`` per applied update,
    ``dropped``, ``updates``, ``seconds``, ``params``; on a worker, ``{"gradients": k}``; on both
    ``memory`` (:func:`minipar.strategy.state_memory`) and ``last_step``, the ``seconds`` and
    ``bytes_by_dim`` of the rank's last step (a worker's last gradient; the server's time from
    the update before the last to the last). ``dtype``: the forwards' compute dtype."""
    n, r = comm.group_size(group), comm.group_rank(group)
    if n < 2:
        raise ValueError("a parameter server needs at least 2 ranks: one server, one worker")
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be None or >= 0, got {max_staleness}")
    broadcast_module(model, src=0, group=group)
    params = trainable(model.parameters())
    if r == 0:
        return _serve(model, params, steps, make_optimizer or sgd(), group, n - 1,
                      synchronous, max_staleness, eval_batch, dtype)
    delay = (delays or [0.0] * (n - 1))[r - 1]
    return _work(model, params, batch_fn, group, n - 1, r, delay, dtype)


def _work(model, params, batch_fn, group, W: int, r: int, delay: float, dtype) -> dict:
    inbox = torch.empty(2 + sum(p.numel() for p in params), device=params[0].device)
    comm.recv(inbox, 0, group, name="pull", dim="dp")
    k, last = 0, {"seconds": 0.0, "bytes_by_dim": {"total": 0}}
    while inbox[1] == 0:  # not told to stop
        mark, t0 = trace.mark(), time.perf_counter()
        version = inbox[0].item()
        unflatten_into(params, inbox[2:])
        x, y = batch_fn(k * W + r - 1)
        for p in params:
            p.grad = None
        with strategy.forward(dtype, inbox, "forward", step=k):
            loss = model(x, y)
        with trace.region("backward", step=k):
            loss.backward()
        if delay:
            with trace.region("straggling", step=k):
                time.sleep(delay)
        msg = torch.cat([torch.tensor([version, loss.item()], device=inbox.device),
                         flatten(p.grad if p.grad is not None else torch.zeros_like(p) for p in params)]).cpu()
        pushed = comm.isend(msg, 0, group, name="push", step=k, dim="dp")
        comm.recv(inbox, 0, group, name="pull", dim="dp")
        pushed.wait()
        k += 1
        last = {"seconds": time.perf_counter() - t0, "bytes_by_dim": trace.bytes_by_dim(trace.since(mark))}
    return {"gradients": k, "memory": strategy.state_memory(model), "last_step": last}


def _recv_any(buf: torch.Tensor, group) -> int:
    """Receive into the CPU tensor ``buf`` from whichever rank sends first (traced); return
    its group rank. Only Gloo receives from any source (``src=None``; NCCL cannot), and a
    ``cpu:gloo,cuda:nccl`` group gives CPU tensors to Gloo: so the pushes are CPU tensors."""
    if not transport.gloo_receives_any(buf, group):
        raise ValueError(f"a receive from any source needs a CPU tensor on a group with Gloo; got "
                         f"a tensor on {buf.device} on a {transport.group_backend(group)} group")
    start = trace.now()
    work = dist.irecv(buf, src=None, group=group)
    comm.Handle([work], "push", start, 0, comm.p2p.nbytes(buf), {"dim": "dp"}).wait()
    return work._source_rank()


def _serve(model, params, steps, make_optimizer, group, W, synchronous, max_staleness, eval_batch, dtype) -> dict:
    opt = make_optimizer(params)
    numel = sum(p.numel() for p in params)
    version = 0
    out = {"losses": [], "eval_losses": [], "times": [], "staleness": [], "workers": [], "dropped": 0,
           "last_step": {"seconds": 0.0, "bytes_by_dim": {"total": 0}}}

    def reply(dst: int, stop: bool) -> None:
        msg = torch.cat([torch.tensor([float(version), float(stop)], device=params[0].device), flatten(params)])
        comm.isend(msg, dst, group, name="pull", dim="dp").wait()

    def apply(grad: torch.Tensor, loss: float, staleness: list[int], worker: int) -> None:
        nonlocal version
        with trace.region("update", version=version):
            for p, g in zip(params, grad.split([p.numel() for p in params])):
                p.grad = g.view_as(p).to(p.device, copy=True)
            opt.step()
        version += 1
        out["times"].append(time.perf_counter() - t0)
        if eval_batch is not None:
            with torch.no_grad(), strategy.forward(dtype, params[0]):
                out["eval_losses"].append(model(*eval_batch).item())
        out["losses"].append(loss)
        out["staleness"] += staleness
        out["workers"].append(worker)
        previous = marks[-1]
        marks.append((trace.mark(), time.perf_counter()))
        out["last_step"] = {"seconds": marks[-1][1] - previous[1],
                            "bytes_by_dim": trace.bytes_by_dim(trace.since(previous[0]))}

    t0 = time.perf_counter()
    marks = [(trace.mark(), t0)]            # the end of every update (the start first)
    for w in range(1, W + 1):
        reply(w, False)
    inbox = torch.empty(2 + numel, device="cpu")  # pushes arrive on the CPU (see _recv_any)
    if synchronous:
        for step in range(steps):
            total, loss = torch.zeros(numel, device=params[0].device), 0.0
            for w in range(1, W + 1):  # wait for every worker: the slowest sets the pace
                comm.recv(inbox, w, group, name="push", dim="dp")
                total += inbox[2:].to(total.device)
                loss += inbox[1].item() / W
            apply(total / W, loss, [0] * W, 0)
            for w in range(1, W + 1):
                reply(w, step == steps - 1)
    else:
        stopped, applied = 0, 0
        while stopped < W:
            src = _recv_any(inbox, group)
            if applied < steps:
                tau = version - int(inbox[0].item())
                if max_staleness is not None and tau > max_staleness:
                    out["dropped"] += 1
                else:
                    apply(inbox[2:], inbox[1].item(), [tau], src)
                    applied += 1
            stop = applied >= steps
            reply(src, stop)
            stopped += stop
    out.update(seconds=time.perf_counter() - t0, updates=version, memory=strategy.state_memory(model, opt),
               params={k: v.detach().clone() for k, v in model.named_parameters()})
    return out


@strategy.checks
def check(model, batches, world_size: int, synchronous: bool = False, max_staleness: int | None = None,
          delays=None, eval_batch=None, dtype=None, recompute=None) -> None:
    """Plain errors before launch: one server and at least one worker, batches the W workers
    split evenly, a known staleness bound, one delay per worker, a known dtype and recompute."""
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"a parameter server needs world_size >= 2 (one server, one worker), got {world_size!r}")
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be None or >= 0, got {max_staleness}")
    if delays is not None and len(delays) != world_size - 1:
        raise ValueError(f"{len(delays)} delays for {world_size - 1} workers")
    for i, (x, _) in enumerate(batches):
        if x.shape[0] % (world_size - 1):
            raise ValueError(f"global batch {i} has {x.shape[0]} samples, which {world_size - 1} workers "
                             "cannot split evenly")
    strategy.check_options(model, dtype, recompute)


def train(model, batches, optimizer=None, group=None, synchronous: bool = False, max_staleness: int | None = None,
          delays=None, eval_batch=None, dtype=None, recompute=None) -> dict:
    """The strategy's API (:mod:`minipar.strategy`) over :func:`parameter_server` on the global
    ``batches``: worker w's k-th gradient is on shard w-1 of global batch k mod len(batches), of the
    W workers' shards. ``synchronous``: one update per global batch, the mean of its W shards'
    gradients (single-process SGD on the global batches); else one update per shard, W per global
    batch, each applied as it arrives. The server (group rank 0) returns the ``losses`` of the
    applied updates and the ``params``; every rank its :class:`~minipar.strategy.Measured`."""
    dtype = strategy.prepare(model, dtype, recompute)   # the options every strategy takes, decided once
    W = comm.group_size(group) - 1

    def batch_fn(j):
        x, y = batches[j // W % len(batches)]
        return shard(x, j % W, W), shard(y, j % W, W)

    steps = len(batches) * (1 if synchronous else W)
    out = parameter_server(model, batch_fn, steps, optimizer, group, synchronous, max_staleness, delays,
                           eval_batch, dtype)
    server = comm.group_rank(group) == 0
    names = ("eval_losses", "times", "staleness", "workers", "dropped", "updates") if server else ("gradients",)
    measured = strategy.Measured(out["last_step"]["seconds"], out["last_step"]["bytes_by_dim"], out["memory"],
                                 {k: out[k] for k in names})
    return {"losses": out["losses"] if server else None,
            "params": strategy.full_params(model.named_parameters()) if server else None, "measured": measured}


def run(model, batches, world_size: int, optimizer=None, **options) -> strategy.TrainResult:
    """Driver: :func:`check`, then :func:`train` on ``world_size`` ranks (one server, the rest workers)."""
    return strategy.run(train, model, batches, world_size, check=check, optimizer=optimizer, **options)
