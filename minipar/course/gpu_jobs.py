"""The jobs of ``python3 course.py test --gpu`` run side by side (standard library only: loaded by
``course.py`` before any environment exists).

:func:`run` starts each job (a pytest run of a chapter or a notebook, or one of ``--first``'s
checks) as soon as :func:`minipar.course.gpu_run.next_job` says it fits beside the running ones,
most work first; a job over its time is stopped with its whole process group (pytest and the ranks
it started); each finished job's result, seconds and peak GPU memory per rank (the ranks' logged
peaks) make one row. :func:`table` is the report.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path


def start(py, cmd: list[str], root: Path, env: dict, out: Path):
    """One job's process, in its own session (so it can be stopped with its ranks)."""
    return subprocess.Popen([str(py), *cmd], cwd=root, env=env, stdout=open(out, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc) -> None:
    """A job over its time: its whole process group (pytest and the ranks it started)."""
    try:
        os.killpg(proc.pid, 9)
    except (OSError, AttributeError):
        proc.kill()


def run(gpu, py, tasks: list[tuple], root: Path, environ, cores: int, gib: float, last: dict,
        quick: bool) -> list[tuple]:
    """Run ``tasks`` (``(name, command, seconds allowed, is pytest)``) with ``py``; ``gpu`` is
    :mod:`minipar.course.gpu_run`; ``environ(**extra)`` the environment of a job. Returns the
    rows ``(name, result, seconds, peaks)`` in the tasks' order."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        running, todo = {}, gpu.longest_first([t[0] for t in tasks], last, quick)
        ranks = {i: gpu.ranks_of(t[0]) for i, t in enumerate(tasks)}
        while todo or running:
            while (i := gpu.next_job(todo, ranks, [ranks[j] for j in running], cores, gib)) is not None:
                todo.remove(i)
                env = environ(MINIPAR_DEVICE="cuda", MINIPAR_MEMORY_LOG=f"{tmp}/{i}.jsonl")
                running[i] = (start(py, tasks[i][1], root, env, Path(f"{tmp}/{i}.out")), time.perf_counter())
                print(f"started  {tasks[i][0]}", flush=True)
            time.sleep(0.5)
            for i, (proc, t) in list(running.items()):
                name, _, limit, is_pytest = tasks[i]
                over = proc.poll() is None and time.perf_counter() - t > limit
                if over:
                    stop(proc)
                    proc.wait()
                elif proc.poll() is None:
                    continue
                del running[i]
                rows[i] = _finished(gpu, name, proc.returncode, is_pytest, over, limit, time.perf_counter() - t,
                                    Path(f"{tmp}/{i}.jsonl"), Path(f"{tmp}/{i}.out"))
    return [rows[i] for i in sorted(rows)]


def _finished(gpu, name, returncode, is_pytest, over, limit, seconds, log_path: Path, out: Path) -> tuple:
    """A finished job's row, printed with its findings and, when it failed (or is a check), the
    end of what it printed."""
    log = gpu.read_log(log_path)
    result, findings = (gpu.job_result(name, returncode, log) if is_pytest else
                        ("pass" if returncode == 0 else f"FAIL ({returncode})", []))
    result = f"FAIL (over {limit} s)" if over else result
    print(f"finished {name}: {result} in {seconds:.0f} s", flush=True)
    if findings:
        print("\n".join(f"  {f}" for f in findings[:10]), flush=True)
    if result.startswith("FAIL") or not is_pytest:
        text = out.read_text().splitlines()
        print("\n".join(f"  {line}" for line in text[-(30 if result.startswith("FAIL") else 14):]), flush=True)
    return name, result, seconds, gpu.peaks(log)


def table(rows: list[tuple], title: str) -> list[str]:
    """The report's lines: per job its result, seconds and peak GPU memory per rank (MiB)."""
    out = [title, f"{'job':<34} {'result':<18} {'seconds':>8}  peak GPU memory per rank (MiB)"]
    for name, result, secs, peaks in rows:
        mem = ", ".join(f"r{r} {b / 2**20:.0f}" for r, b in sorted(peaks.items())) or "-"
        out.append(f"{name:<34} {result:<18} {secs:>8.1f}  {mem}")
    return out
