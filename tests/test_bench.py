"""Every benchmark runs: ``python -m minipar.bench NAME --smoke --json`` for every NAME the
command lists, in this one process (each module's ``main(argv)``, as the command calls it; the
launches share one pool), and each prints one JSON object whose ``ratio`` is a finite positive
number and whose rows speak the shared vocabulary (``minipar ms/step``, ``baseline ms/step``,
``ratio``: :func:`minipar.bench.common.row`)."""
import json
import math

import pytest

from minipar.bench import __main__ as bench
from minipar.bench.common import BASELINE, MINIPAR, RATIO


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow   # every benchmark
def test_every_benchmark_runs_at_its_smallest_size_and_reports_its_ratio(capsys):
    names = bench.available()
    assert {"collectives", "ddp", "pipeline", "planner", "zero", "mesh5d"} <= set(names), names
    bad = {}
    for name in names:
        try:
            assert bench.main([name, "--smoke", "--json"]) == 0
        except Exception as e:   # noqa: BLE001 - every benchmark's failure, not only the first
            bad[name] = f"{type(e).__name__}: {e}"
            continue
        out = capsys.readouterr().out.strip().splitlines()
        result = json.loads(out[-1])
        if not _positive(result.get("ratio")):
            bad[name] = f"ratio {result.get('ratio')!r}"
        elif not result.get("baseline") or not result.get("rows"):
            bad[name] = f"no baseline or no rows: {sorted(result)}"
        for i, r in enumerate(result.get("rows", [])):
            keys = (RATIO,) if name == "planner" and "rho" in r else (MINIPAR, BASELINE, RATIO)
            wrong = {k: r.get(k) for k in keys if not _positive(r.get(k))}
            if wrong:
                bad[name] = f"row {i}: {wrong} (row {r})"
            elif RATIO in keys and MINIPAR in keys and not math.isclose(
                    r[RATIO], r[MINIPAR] / r[BASELINE], rel_tol=1e-9):
                bad[name] = f"row {i}: ratio {r[RATIO]} is not minipar / baseline ({r})"
    assert not bad, bad


@pytest.mark.slow   # ten strategies ranked
def test_the_planners_ranking_runs_at_its_smallest_size(capsys):
    """``bench planner --rho``: chapter 07's strategies ranked, one round, one run."""
    from minipar.bench import planner
    result = planner.main(["--rho", "--smoke", "--json"])
    assert len(result["rows"]) == 1 and -1 <= result["rows"][0]["rho"] <= 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ratio"] == pytest.approx(result["ratio"])


def test_without_a_gpu_every_benchmark_refuses_cuda_before_any_rank_starts(monkeypatch, capsys):
    """``--device cuda`` on a machine with no GPU: every benchmark stops with exit code 2 and one
    plain line (:func:`minipar.bench.common.placement`), not a traceback, and launches nothing."""
    import minipar.runtime.backend as backend
    import minipar.runtime.launch as launch_module
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    monkeypatch.setattr(launch_module, "launch", lambda *a, **k: pytest.fail("a rank was launched"))
    for name in bench.available():
        with pytest.raises(SystemExit) as stop:
            bench.main([name, "--smoke", "--device", "cuda"])
        err = capsys.readouterr().err
        assert stop.value.code == 2, name
        assert "--device cuda: device='cuda' was requested but no CUDA GPU is visible" in err, (name, err)
        assert "Traceback" not in err


def _declared(name):
    import importlib
    module = importlib.import_module(f"minipar.bench.{name}")
    return getattr(module, "SHARED_GPU", None), getattr(module, "NEEDS_GPU", None)


def test_each_benchmark_says_whether_its_ranks_can_share_one_gpu():
    """Every benchmark of several ranks declares one of: what its ratio means when its ranks share
    a GPU over Gloo (``SHARED_GPU``), or why it cannot (``NEEDS_GPU``: PyTorch's pipelining sends
    CUDA tensors point to point, which Gloo cannot). On simulated machines
    (:func:`minipar.bench.common.decide` with ``gpus=``): one GPU per rank is NCCL, no note; fewer
    GPUs share them, with the note, or refuse saying what is needed; the CPU is unchanged."""
    from minipar.bench.common import decide
    single = {"recompute"}   # one rank: its own GPU
    for name in bench.available():
        shares, needs = _declared(name)
        assert (shares is None) != (needs is None) or (name in single and shares is needs is None), name
        if name in single:
            continue
        p, note = decide("cuda", 2, shares, needs, gpus=2)
        assert p.backend == "nccl" and not p.shared and note == "", name
        p, note = decide("cuda", 2, shares, needs, gpus=1)
        if needs:
            assert p is None and needs in note and "needs one GPU per rank (NCCL): 2 ranks need 2 GPUs" in note
        else:
            assert p.shared and p.backend == "gloo" and p.device == "cuda", name
            assert note.startswith("2 ranks share 1 GPU(s): compute on the GPU, messages over Gloo") and shares in note
        p, note = decide("cpu", 2, shares, needs, gpus=1)
        assert p.device == "cpu" and note == ""
    assert [n for n in bench.available() if _declared(n)[1]] == ["pipeline"]


class _Launched(Exception):
    pass


@pytest.mark.parametrize("name", ["collectives", "ddp", "zero", "tp", "moe", "mesh5d", "launch"])
def test_on_one_gpu_a_benchmark_that_can_share_it_launches_there(name, monkeypatch, capsys):
    """With one GPU (simulated) a sharing benchmark no longer refuses ``--device cuda``: it gets
    as far as launching its ranks with ``device="cuda"`` (played; here the launch stops it)."""
    import importlib
    import minipar.runtime.backend as backend
    module = importlib.import_module(f"minipar.bench.{name}")
    monkeypatch.setattr(backend, "gpu_count", lambda: 1)
    seen = []

    def launch(fn, n, *a, device=None, **k):
        seen.append((n, device))
        raise _Launched
    if name != "launch":   # imported at the top, or inside main from the runtime
        import minipar.runtime.launch as launch_module
        monkeypatch.setattr(launch_module, "launch", launch)
        if hasattr(module, "launch"):
            monkeypatch.setattr(module, "launch", launch)
    else:   # the launch benchmark starts its ranks from a fresh process: the script carries the device
        monkeypatch.setattr(module, "_run", lambda code: seen.append((None, "cuda" if 'device="cuda"' in code
                                                                       or '"cuda")' in code else None))
                            or (_ for _ in ()).throw(_Launched))
    with pytest.raises(_Launched):
        module.main(["--smoke", "--device", "cuda"])
    assert seen and seen[0][1] == "cuda", seen


def test_the_pipeline_benchmark_on_one_gpu_refuses_saying_what_it_needs(monkeypatch, capsys):
    """PyTorch's pipelining baseline cannot run with its ranks sharing one GPU: exit code 2,
    why, and what it needs, before any launch."""
    from minipar.bench import pipeline
    import minipar.runtime.backend as backend
    monkeypatch.setattr(backend, "gpu_count", lambda: 1)
    monkeypatch.setattr(pipeline, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit) as stop:
        pipeline.main(["--smoke", "--device", "cuda"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "Gloo's send and recv move host memory only" in err and "2 ranks need 2 GPUs" in err
