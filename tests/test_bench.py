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


def test_every_benchmark_refuses_fewer_gpus_than_ranks_before_any_rank_starts(monkeypatch, capsys):
    """``--device cuda`` on a machine with fewer GPUs than the benchmark's ranks: every
    benchmark stops with exit code 2 and one plain line (the shared
    :func:`minipar.bench.common.one_gpu_per_rank`), not a traceback, and launches nothing."""
    import minipar.runtime.backend as backend
    import minipar.runtime.launch as launch_module
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    monkeypatch.setattr(launch_module, "launch", lambda *a, **k: pytest.fail("a rank was launched"))
    for name in bench.available():
        with pytest.raises(SystemExit) as stop:
            bench.main([name, "--smoke", "--device", "cuda"])
        err = capsys.readouterr().err
        assert stop.value.code == 2, name
        assert "--device cuda runs one GPU per rank over NCCL" in err and "this machine has 0" in err, (name, err)
        assert "Traceback" not in err
