"""Where the code asks which device or transport it runs on, counted from the source.

The placement is decided once, at launch (:class:`minipar.runtime.backend.Placement`), and
:mod:`minipar.runtime.transport` is the one place that routes a tensor by it. So:

* outside ``runtime/``, every line that asks which device or transport is in use (a device-type
  test, ``is_cuda``, an environment read of the device or transport, the group's backend string, a
  question to the transport) is named here with its reason, per file and counted: none in
  ``comm/``'s own logic beyond asking the transport, none in ``strategy.py`` or a strategy's
  training step;
* the lines no CPU mode can execute (calls into ``torch.cuda``: events, streams, the allocator's
  figures, device properties) live in a short list of functions, each with its reason, and none
  is in a strategy's package: everything a strategy runs, the CPU runs too
  (``transport="gloo-staged"`` takes the shared GPU's path).

A new site fails here until it is named (or moved behind the placement). ``course/`` and
``bench/`` are left out: the GPU run's tooling and the benchmarks ask the device on purpose
(what to run, which clock, PyTorch's own device meshes for the baselines).
"""
import ast
import re
from pathlib import Path

# collected through tests/test_gpu_paths.py (the devices job of course.py test --gpu)
__all__ = ["test_every_site_asking_the_device_or_transport_outside_runtime_is_named",
           "test_the_lines_only_a_gpu_executes_are_few_named_and_off_every_strategy",
           "test_the_counters_see_a_new_site"]

ROOT = Path(__file__).resolve().parents[1] / "minipar"
TOOLING = ("course/", "bench/")

ASKS = re.compile(r"\.is_cuda\b|\.device\.type\b|\)\.type\b|\bhere\.type\b|environ\S*\(?\S*(DEVICE|TRANSPORT)"
                  r"|get_backend\(|group_backend\(|moved_by_nccl\(|carried_by_nccl\(|\btransport\.\w+\("
                  r"|backend\.current\(")
GPU_ONLY = re.compile(r"torch\.cuda\.(?!is_available\b|device_count\b|OutOfMemoryError\b|is_built\b)\w+")

# file -> (lines that ask, why)
ASKING = {
    "comm/p2p.py": (3, "asks runtime.transport whether NCCL carries a tensor: NCCL's sends and receives "
                       "are posted in one batch (the pipeline's and the ring's cycles)"),
    "pipeline/executor.py": (1, "under NCCL the schedule is walked in lockstep (pipeline/posting.py): "
                                "NCCL pairs a rank's posts in order"),
    "data_parallel/parameter_server.py": (2, "a receive from any source is Gloo's alone (NCCL has none): "
                                             "asks runtime.transport, and names the group's backend in the error"),
    "models/attention.py": (2, "the attention kernel: PyTorch's fused SDPA on a GPU, written out on the CPU "
                               "('auto'), and whether a tensor takes the CUDA kernel"),
    "precision.py": (1, "torch.autocast takes the device type"),
    "adapt/cut.py": (1, "a switch keeps its send and receive buffer on the CPU, where a fresh one's first touch "
                        "costs several times the copy; a GPU's caching allocator keeps freed blocks already"),
    "plan/calibrate.py": (1, "the calibration names the backend that moved the all-reduces it timed (nccl or gloo)"),
    "reference.py": (4, "the single-process reference runs where the ranks did (a result's placement's "
                        "device type, the current GPU's index) and its tolerances are per device type "
                        "(reference.TOLERANCES: the table and the floor)"),
}

# (file, function) -> why only a GPU executes its torch.cuda lines
GPU_FUNCTIONS = {
    ("runtime/backend.py", "device"): "the current GPU's index",
    ("runtime/backend.py", "gpu_identity"): "which physical GPU (its UUID), to refuse two NCCL ranks on one",
    ("runtime/backend.py", "describe_machine"): "the GPUs' names",
    ("runtime/backend.py", "summary"): "the GPUs' names and memory",
    ("runtime/gpu.py", "synchronize"): "waits for the GPU's queued kernels",
    ("runtime/gpu.py", "max_allocated"): "the caching allocator's peak",
    ("runtime/gpu.py", "reset_max_allocated"): "resets the caching allocator's peak",
    ("runtime/gpu.py", "peak_memory"): "the caching allocator's figures around a block",
    ("runtime/gpu.py", "elapsed"): "CUDA events time kernels the host only queued",
    ("runtime/launch.py", "_launch_in_place"): "under torchrun: binds the rank to its GPU",
    ("runtime/pool.py", "_run_job"): "binds a launched rank to its GPU",
    ("runtime/pool.py", "oom_report"): "the allocator's figures when a rank ran out of GPU memory",
    ("runtime/rank_loop.py", "main"): "binds a persistent rank (%%ranks) to its GPU",
    ("runtime/pool.py", "_begin_gpu_job"): "what the GPU held when a job began, so the GPU run credits only what it allocated",
    ("runtime/staging.py", "to_host"): "a copy out waits for the kernels that made the tensor",
    ("runtime/trace.py", "synchronize_on"): "regions wait for the GPU's stream",
    ("runtime/transport.py", "device_event"): "NCCL's work is timed with CUDA events",
    ("models/attention.py", "compute_capability"): "which fused kernels this GPU has",
    ("reference.py", "place"): "the current GPU's index for the reference's device",
}
STRATEGIES = ("strategy.py", "comm/", "data_parallel/", "model_parallel/", "pipeline/", "tensor_parallel/",
              "zero/", "context_parallel/", "expert_parallel/", "hybrid/", "autograd/")


def _sources():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(TOOLING):
            yield rel, path.read_text()


def _code_lines(text):
    """``(line number, code)`` without comments and docstrings."""
    tree = ast.parse(text)
    doc = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, node.end_lineno + 1))
    for i, line in enumerate(text.splitlines(), 1):
        if i not in doc:
            yield i, line.split("#")[0]


def _function_at(text):
    spans = []

    def visit(node, prefix=""):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.ClassDef):
                visit(ch, f"{prefix}{ch.name}.")
            elif isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                spans.append((ch.lineno, ch.end_lineno, f"{prefix}{ch.name}"))
                visit(ch, f"{prefix}{ch.name}.")
            else:
                visit(ch, prefix)
    visit(ast.parse(text))
    return lambda i: max(((a, q) for a, b, q in spans if a <= i <= b), default=(0, "<module>"))[1]


def asking_sites():
    out = {}
    for rel, text in _sources():
        if rel.startswith("runtime/"):
            continue
        for i, code in _code_lines(text):
            if ASKS.search(code):
                out.setdefault(rel, []).append(f"{rel}:{i}: {code.strip()}")
    return out


def gpu_only_functions():
    out = {}
    for rel, text in _sources():
        where = _function_at(text)
        for i, code in _code_lines(text):
            if GPU_ONLY.search(code):
                out.setdefault((rel, where(i)), []).append(f"{rel}:{i}: {code.strip()}")
    return out


def test_every_site_asking_the_device_or_transport_outside_runtime_is_named():
    found = asking_sites()
    counts = {f: len(lines) for f, lines in found.items()}
    unnamed = {f: found[f] for f in counts if f not in ASKING}
    assert not unnamed, f"new sites asking which device or transport (ask runtime.transport / the placement, or name them): {unnamed}"
    changed = {f: (counts.get(f, 0), n, found.get(f)) for f, (n, _) in ASKING.items() if counts.get(f, 0) != n}
    assert not changed, f"sites per file changed (found, named, lines): {changed}"
    assert not any(f.startswith(("comm/native", "strategy.py", "zero/", "tensor_parallel/", "context_parallel/",
                                 "expert_parallel/", "model_parallel/", "data_parallel/naive", "data_parallel/ddp"))
                   for f in found), found
    assert sum(n for n, _ in ASKING.values()) == 15   # 18 sites in 8 files before one placement was decided at launch (14 then; 15 with the switch's kept buffer)


def test_the_lines_only_a_gpu_executes_are_few_named_and_off_every_strategy():
    found = gpu_only_functions()
    assert set(found) == set(GPU_FUNCTIONS), (
        f"unnamed: {[found[k] for k in set(found) - set(GPU_FUNCTIONS)]}; "
        f"named but gone: {sorted(set(GPU_FUNCTIONS) - set(found))}")
    on_strategies = [k for k in found if k[0].startswith(STRATEGIES)]
    assert on_strategies == [], on_strategies
    outside = sorted(k for k in found if not k[0].startswith("runtime/"))
    assert outside == [("models/attention.py", "compute_capability"), ("reference.py", "place")]
    assert sum(map(len, found.values())) <= 32, sum(map(len, found.values()))


def test_the_counters_see_a_new_site():
    """The counters are not blind: a device test or a CUDA call planted in a strategy is found."""
    planted = "def step(x):\n    if x.is_cuda:\n        torch.cuda.synchronize()\n"
    assert [c for _, c in _code_lines(planted) if ASKS.search(c)] == ["    if x.is_cuda:"]
    assert [c.strip() for _, c in _code_lines(planted) if GPU_ONLY.search(c)] == ["torch.cuda.synchronize()"]
    assert _function_at(planted)(3) == "step"
    assert not GPU_ONLY.search("torch.cuda.is_available()") and ASKS.search('os.environ.get("MINIPAR_DEVICE")')
