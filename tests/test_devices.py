"""Device-generic code, proven without a GPU, and the placement of ranks on GPUs.

The meta-device test: the model and the data are built on the CPU in the driver; inside
every rank ``torch.set_default_device("meta")`` makes any tensor created without naming a
device land on ``meta``, where it has no values, so a strategy that allocates a buffer
without following its model's device fails its step (a ``meta`` tensor given to a
collective is an error naming it). One step of every strategy (and of context and expert
parallelism where present) runs in one launch of 4 ranks.

Placement is tested with simulated GPU counts (:func:`minipar.runtime.backend.place` takes
``gpus=``), host staging with CPU tensors forced through the staging path, and the
out-of-memory report with a simulated ``torch.cuda.OutOfMemoryError``.
"""
import copy

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import comm
from minipar.runtime import staging, trace
from minipar.runtime import transport as transport_mod
from minipar.runtime.backend import BackendError, place
from minipar.data import batches as make_batches
from minipar.data import synthetic_tokens
from minipar.models import GPT
from minipar.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)


# ZeRO-3's per-parameter design too (its gather and reduce buffers are its own), with and
# without prefetch, in bf16 (reduced in fp32), and with small parameters kept whole
ZERO3_DESIGNS = {
    "zero-3 per-parameter": dict(stage=3, sharding="per-parameter"),
    "zero-3 per-parameter no prefetch": dict(stage=3, sharding="per-parameter", prefetch=False),
    "zero-3 per-parameter bf16": dict(stage=3, sharding="per-parameter", param_dtype=torch.bfloat16,
                                      reduce_dtype=torch.float32, dtype=torch.bfloat16),
    "zero-3 flat no prefetch": dict(stage=3, prefetch=False),
    "zero-3 flat bf16": dict(stage=3, param_dtype=torch.bfloat16, dtype=torch.bfloat16),
    "zero-3 flat persist_below": dict(stage=3, persist_below=100),
    "zero-3 per-parameter persist_below": dict(stage=3, sharding="per-parameter", persist_below=100),
}


def _cases():
    from minipar import data_parallel, pipeline, tensor_parallel, zero
    from minipar.data_parallel import VERSIONS
    gpt = GPT(CONFIG, seed=0)
    out = {f"ddp {v}": (data_parallel.train, gpt, dict(opts)) for v, opts in VERSIONS.items()}
    out["ddp accumulation"] = (data_parallel.train, gpt, dict(accumulation=2))
    out.update({f"zero-{s}": (zero.train, gpt, dict(stage=s)) for s in (0, 1, 2, 3)})
    out.update({name: (zero.train, gpt, dict(opts)) for name, opts in ZERO3_DESIGNS.items()})
    for s in ("gpipe", "1f1b", "zb-h1", "interleaved"):
        v = 2 if s == "interleaved" else 1
        out[f"pipeline {s}"] = (pipeline.train, gpt, dict(schedule=s, microbatches=2, virtual_stages=v,
                                                          pair=True))
    out["tp vocab-parallel loss"] = (tensor_parallel.train, gpt, dict())
    out["tp sequence-parallel"] = (tensor_parallel.train, gpt, dict(sequence_parallel=True))
    try:  # the newer chapters, where present
        from minipar import context_parallel, expert_parallel
    except ImportError:
        return out
    for v in context_parallel.VARIANTS:
        out[f"cp {v}"] = (context_parallel.train, gpt, dict(variant=v))
    fused = GPT(GPTConfig(**{**CONFIG.__dict__, "attention": "sdpa"}), seed=0)   # PyTorch's fused kernels
    out["ddp sdpa"] = (data_parallel.train, fused, dict(recompute="selective"))
    out["tp sdpa"] = (tensor_parallel.train, fused, dict())
    out.update({f"cp {v} sdpa": (context_parallel.train, fused, dict(variant=v)) for v in context_parallel.VARIANTS})
    moe = GPT(GPTConfig(**{**CONFIG.__dict__, "moe_every": 1, "n_experts": 4, "top_k": 2}), seed=0)
    out["ep 4"] = (expert_parallel.train, moe, dict(ep=4))
    out["ep 2 x tp 2"] = (expert_parallel.train, moe, dict(ep=2, tp=2))
    return out


def _hybrid_step(gpt, dp, pp, tp, x, y, **options):
    from minipar import hybrid
    from minipar.mesh import ProcessMesh
    mesh = ProcessMesh(dp=dp, pp=pp, tp=tp).build()
    model = hybrid.build(copy.deepcopy(gpt), mesh, microbatches=2, **options)
    return [model.train_step(x, y)]


def _train_loop():
    from minipar.production import train
    args = train.parser().parse_args(["--dp", "2", "--tp", "2", "--steps", "1", "--no-progress",
                                      "--n-embd", "16", "--n-head", "4", "--block-size", "8"])
    return train.rank_main(args)["losses"]


def _torch_optimizers_on_cpu():
    """torch.optim's own state (Adam's ``step`` on torch <= 2.9) follows the default device:
    that is torch's, not minipar's, so optimizer steps run with the CPU as the default.
    Returns the undo."""
    saved = {cls: cls.step for cls in (torch.optim.Adam, torch.optim.AdamW)}
    for cls, step in saved.items():
        def on_cpu(self, *a, _step=step, **kw):
            with torch.device("cpu"):
                return _step(self, *a, **kw)
        cls.step = on_cpu
    return lambda: [setattr(cls, "step", step) for cls, step in saved.items()]


def _on_meta(batches):
    """Rank function: one step of every strategy with ``meta`` as the default device. A
    failing step raises (naming the strategy); the launch then reports that rank."""
    undo = _torch_optimizers_on_cpu()
    try:
        return _every_strategy(batches)
    finally:
        undo()


def _every_strategy(batches):
    r = dist.get_rank()
    pair = dist.new_group([0, 1]), dist.new_group([2, 3])
    results = {}

    def attempt(name, fn):
        torch.set_default_device("meta")
        try:
            losses = fn()
        except Exception as e:
            raise RuntimeError(f"{name} created a tensor without a device (or failed): "
                               f"{type(e).__name__}: {e}") from e
        finally:
            torch.set_default_device(None)
        results[name] = [v for v in losses if v is not None]

    for name, (train, model, opts) in _cases().items():
        group = pair[r // 2] if opts.pop("pair", False) else None
        grp = {} if group is None else {"group": group}   # hybrid and EP train over the world: no group
        attempt(name, lambda: train(copy.deepcopy(model), batches, **grp, **opts)["losses"] or [])
    x, y = batches[0]
    gpt = GPT(CONFIG, seed=0)
    attempt("hybrid 2x1x2 (dp, tp)", lambda: _hybrid_step(gpt, 2, 1, 2, x, y))
    attempt("hybrid 1x2x2 (pp, tp)", lambda: _hybrid_step(gpt, 1, 2, 2, x, y))
    attempt("hybrid 2x2x1 (dp, pp) zero-3", lambda: _hybrid_step(gpt, 2, 2, 1, x, y, zero=3))
    attempt("minipar.production.train loop", _train_loop)
    return results


def test_every_strategy_runs_a_step_with_meta_as_the_default_device():
    batches = make_batches(synthetic_tokens(2_000, CONFIG.vocab_size), 1, 8, CONFIG.block_size)
    res = minipar.launch(_on_meta, 4, args=(batches,), device="cpu", timeout=120)
    expected = {"ddp naive", "ddp bucketed", "ddp overlapped", "ddp accumulation", "zero-0", "zero-1",
                "zero-2", "zero-3", "pipeline gpipe", "pipeline 1f1b", "pipeline zb-h1",
                "pipeline interleaved", "tp vocab-parallel loss", "tp sequence-parallel",
                "hybrid 2x1x2 (dp, tp)", "hybrid 1x2x2 (pp, tp)", "hybrid 2x2x1 (dp, pp) zero-3",
                "minipar.production.train loop", "ddp sdpa",
                "tp sdpa"} | set(ZERO3_DESIGNS)
    assert expected <= set(res[0]), sorted(expected - set(res[0]))
    for name in res[0]:  # real numbers (a meta loss has none), the same on the ranks that hold it
        losses = [r[name] for r in res if r[name]]
        assert losses and all(isinstance(v, float) and 0 < v < 10 for v in losses[0]), (name, losses)


# ------------------------------------------------------------------ placement
def test_placement_for_every_gpu_count():
    p = place(4, gpus=8)
    assert (p.backend, p.device, p.gpus) == ("nccl", "cuda", 4) and "NCCL with one GPU per rank" in p.reason
    assert [str(p.device_for_rank(r)) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    p = place(4, gpus=1)
    assert (p.backend, p.device, p.shared) == ("gloo", "cuda", True)
    assert p.reason == ("4 ranks share 1 GPU: compute on cuda:0, communication over Gloo through "
                        "host memory (correct, not NCCL's speed)")
    p = place(4, gpus=2)
    assert [str(p.device_for_rank(r)) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert "4 ranks share 2 GPUs" in p.reason and "Gloo through host memory" in p.reason
    p = place(4, gpus=0)
    assert (p.backend, p.device) == ("gloo", "cpu") and "no CUDA GPU" in p.reason
    p = place(4, device="cpu", gpus=8)
    assert (p.backend, p.device) == ("gloo", "cpu") and str(p.device_for_rank(3)) == "cpu"
    p = place(2, backend="gloo", gpus=8)  # backend= keeps its meaning: Gloo on the CPU
    assert (p.backend, p.device) == ("gloo", "cpu")
    with pytest.raises(BackendError, match="device='cuda' was requested but no CUDA GPU"):
        place(2, device="cuda", gpus=0)
    with pytest.raises(BackendError, match="one GPU per rank: 4 ranks requested but 2"):
        place(4, backend="nccl", gpus=2)
    with pytest.raises(BackendError, match="device must be one of"):
        place(2, device="tpu")
    from minipar.runtime.backend import device_for_rank  # the older helper still answers
    assert str(device_for_rank("nccl", 3)) == "cuda:3" and str(device_for_rank("gloo", 3)) == "cpu"


def test_cuda_without_a_gpu_fails_before_any_process_starts(monkeypatch, capsys):
    monkeypatch.setattr(minipar.runtime.backend, "gpu_count", lambda: 0)
    with pytest.raises(BackendError, match="no CUDA GPU is visible"):
        minipar.launch(_where, 2, device="cuda")
    assert "minipar.runtime.launch" not in capsys.readouterr().out  # nothing was launched


def _where():
    return str(minipar.device()), torch.empty(0).device.type  # where a bare tensor lands


def test_ranks_know_where_to_compute_and_the_choice_is_printed_once(capsys):
    a = minipar.launch(_where, 2, device="cpu")
    minipar.launch(_where, 2, device="cpu")
    assert list(a) == [("cpu", "cpu"), ("cpu", "cpu")] and a.placement.device == "cpu"
    assert capsys.readouterr().out.count("minipar.runtime.launch: Gloo on CPU (device='cpu' asked for)") <= 1
    # the driver: the CPU, unless MINIPAR_DEVICE=cuda (course.py test --gpu) puts it on the GPU
    gpu_driver = minipar.runtime.backend.default_device() == "cuda" and minipar.runtime.backend.gpu_count() > 0
    assert minipar.device().type == ("cuda" if gpu_driver else "cpu")


# ------------------------------------------------------------------ staging and device errors
def _staged_collectives():
    """Every collective and point-to-point call; on ranks launched with
    ``transport="gloo-staged"`` each goes through a host copy out and back (CPU tensors take a
    shared GPU's path), otherwise straight to Gloo."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    m = trace.mark()
    a = torch.full((6,), float(r + 1))
    comm.all_reduce(a, op="avg", name="ar")
    rs = torch.empty(3)
    comm.reduce_scatter(rs, torch.arange(6.0) * (r + 1), name="rs")
    ag = torch.empty(6)
    comm.all_gather(ag, torch.full((3,), float(r)), name="ag")
    a2a = torch.empty(4)
    comm.all_to_all_single(a2a, torch.arange(4.0) + 10 * r, name="a2a")
    got = torch.empty(2)
    comm.exchange(torch.full((2,), float(r)), (r + 1) % n, got, (r - 1) % n, name="ring")
    h = comm.all_reduce(torch.ones(2), async_op=True, name="async")
    h.wait()
    if r == 0:
        comm.send(torch.tensor([7.0, 8.0]), 1, name="p2p")
    else:
        comm.recv(p2p := torch.empty(2), 0, name="p2p")
        out["p2p"] = p2p.tolist()
    evs = trace.since(m)
    out.update(values=[a.tolist(), rs.tolist(), ag.tolist(), a2a.tolist(), got.tolist()],
               bytes=sum(e["bytes_sent"] for e in evs),
               ops=sorted(e["name"] for e in evs if e["kind"] == "comm"),
               unlabelled=[e["name"] for e in evs if (e["kind"] == "staging") != ("staged" in e["labels"])],
               staging=sorted({(e["name"], e["labels"]["staged"]) for e in evs if e["kind"] == "staging"}))
    errors = []
    for bad in (torch.ones(2, device="meta"),):
        try:
            comm.all_reduce(bad, name="bad")
        except ValueError as e:
            errors.append(str(e))
    return out, errors


def test_staging_through_host_gives_the_same_results_and_bytes_and_is_traced():
    plain = minipar.launch(_staged_collectives, 2, device="cpu", transport="gloo")
    res = minipar.launch(_staged_collectives, 2, device="cpu", transport="gloo-staged")
    assert res.placement.transport == "gloo-staged" and plain.placement.transport == "gloo"
    for (out, errors), (was, _) in zip(res, plain):
        assert out["values"] == was["values"]
        assert out["bytes"] == was["bytes"] > 0  # bytes on the wire as unstaged
        assert out["ops"] == was["ops"]  # the same operations: a staging copy is not one
        assert was["staging"] == [] and out["unlabelled"] == []
        kinds = {name for name, _ in out["staging"]}
        assert kinds == {"stage to host", "stage to device"}, out["staging"]
        ops = {op for _, op in out["staging"]}
        assert ops == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all_single", "exchange",
                       "isend" if out is res[0][0] else "irecv"}, ops
        assert "on meta" in errors[0] and "gloo" in errors[0]
    assert res[1][0]["p2p"] == plain[1][0]["p2p"] == [7.0, 8.0]
    assert res[0][0]["values"][0] == [1.5] * 6  # the mean of 1 and 2


def test_a_cuda_tensor_on_cpu_placed_ranks_is_a_clear_error(monkeypatch):
    class FakeCuda:  # stands in for a CUDA tensor: only its device is read
        device = torch.device("cuda", 0)
    for transport in ("gloo", "gloo-staged"):
        monkeypatch.setattr(minipar.runtime.backend, "_current", place(2, "cpu", transport=transport))
        with pytest.raises(ValueError, match=r"comm.all_reduce: the tensor is on cuda:0 but the ranks "
                                             r"were placed on the CPU"):
            staging.must_stage(FakeCuda(), None, "all_reduce")
    monkeypatch.setattr(minipar.runtime.backend, "_current", place(2, "cuda", gpus=2))
    monkeypatch.setattr(transport_mod, "group_backend", lambda g: "nccl")
    with pytest.raises(ValueError, match="the tensor is on cpu but this group's backend is nccl"):
        staging.must_stage(torch.ones(1), None, "send")
    monkeypatch.setattr(transport_mod, "group_backend", lambda g: "cpu:gloo,cuda:nccl")
    assert staging.must_stage(torch.ones(1), None, "send") is False
    assert staging.must_stage(FakeCuda(), None, "send") is False  # straight to NCCL
    assert transport_mod.route(FakeCuda(), None, "send") == "nccl"
    monkeypatch.setattr(minipar.runtime.backend, "_current", place(4, "cuda", gpus=1))  # a shared GPU
    assert staging.must_stage(FakeCuda(), None, "send") is True
    assert staging.must_stage(torch.ones(1), None, "send") is False  # a CPU tensor goes to Gloo as it is


# ------------------------------------------------------------------ out of memory
def _oom():
    if dist.get_rank() == 1:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    dist.barrier()


def test_a_rank_out_of_gpu_memory_is_reported_with_the_allocator_and_a_hint():
    with pytest.raises(minipar.RankError) as info:
        minipar.launch(_oom, 2, device="cpu", timeout=30)
    msg = str(info.value)
    assert info.value.rank == 1
    assert msg.splitlines()[0].startswith("rank 1 of 2 failed:") and "CUDA out of memory" in msg.splitlines()[0]
    assert "rank 1 ran out of GPU memory" in msg
    assert "allocator:" in msg  # the figures, or why there are none (no CUDA here)
    assert "Hint: use fewer ranks" in msg and "device='cpu'" in msg


# ------------------------------------------------------------------ allocator figures
def test_allocator_peaks_join_a_memory_figure_only_on_a_gpu():
    import plotly.graph_objects as go
    from minipar.runtime import gpu
    cpu_run = [{"bytes_sent": 4}, {"bytes_sent": 4}]
    fig = go.Figure(go.Bar(x=["rank 0", "rank 1"], y=[1, 2]))
    assert gpu.allocator_peaks(cpu_run) is None and gpu.allocator_peaks([None, None]) is None
    assert len(gpu.add_allocator_peaks(fig, ["rank 0", "rank 1"], cpu_run).data) == 1   # the CPU figure as it was
    gpu_run = [{"gpu_peak_bytes": 3 * 2**20}, {"gpu_peak_bytes": 2**20}]
    assert gpu.allocator_peaks(gpu_run) == [3 * 2**20, 2**20]
    assert gpu.allocator_peaks([2048, None]) == [2048, None]
    gpu.add_allocator_peaks(fig, ["rank 0", "rank 1"], gpu_run, scale=2**20, secondary="MiB")
    assert len(fig.data) == 2 and list(fig.data[1].y) == [3.0, 1.0] and fig.data[1].yaxis == "y2"
