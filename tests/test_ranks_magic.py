"""``%%ranks``: ranks that live across notebook cells, run headless in a real kernel.

One notebook, made here and executed with nbclient as the book executes the chapters, shows on
4 ranks and then on 2: each rank's variables persisting from cell to cell, the output labelled
by rank (``--rank`` for one), values pulled and pushed, an exception on one rank (the others
finish and keep their variables; or they wait for it in a collective and are restarted), a hang
ended by the timeout with the collective the others wait in and the rank that never started it,
``%ranks restart`` (new processes), a change of world size, a figure drawn once, the trace
pulled; and after the kernel shuts down, no rank process left. A driver killed outright (no
atexit) leaves none either.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbformat import v4

from minipar.course import rank_view

ROOT = Path(__file__).resolve().parent.parent
RAISES = {"tags": ["raises-exception"]}

CELLS = [
    ("load", "%load_ext minipar"),
    ("start4", "%%ranks 4\nimport torch, torch.distributed as dist, minipar\nfrom minipar import comm\n"
               "r = dist.get_rank()\nx = torch.arange(3.0, device=minipar.device()) + 10 * r\n"
               "print('rank', r, 'of', dist.get_world_size(), 'on', minipar.device())\nx"),
    ("persist4", "%%ranks\ncomm.all_reduce(x)\nx"),
    ("one_rank", "%%ranks 4 --rank 1\nprint('only', r)"),
    ("pull", "xs = %ranks pull x\nprint('pulled', [t.tolist() for t in xs])"),
    ("push", "scale = 3.0\n%ranks push scale"),
    ("pushed", "%%ranks --rank 0\nx * scale"),
    ("raise_alone", "%%ranks\nif r == 2:\n    raise ValueError('only rank 2')\ny = r"),
    ("kept", "%%ranks\nx.sum().item()"),
    ("raise_before_collective", "%%ranks\nif r == 2:\n    1 / 0\ncomm.all_reduce(x)"),
    ("fresh", "%%ranks\n'x' in globals()"),
    ("hang4", "%%ranks --timeout 3\nimport torch, torch.distributed as dist\nfrom minipar import comm\n"
              "z = torch.ones(1)\nif dist.get_rank() != 1:\n    comm.all_reduce(z)"),
    ("usable", "%%ranks\nimport torch, torch.distributed as dist\nfrom minipar import comm\n"
               "z = torch.ones(1)\ncomm.all_reduce(z)\nz.item()"),
    ("restart", "before = %ranks pids\n%ranks restart\nafter = %ranks pids\n"
                "print('new processes:', not set(before) & set(after))"),
    ("start2", "%%ranks 2\nimport torch, torch.distributed as dist, minipar\nfrom minipar import comm\n"
               "w = torch.ones(1) * (dist.get_rank() + 1)\ndist.get_world_size()"),
    ("persist2", "%%ranks\ncomm.all_reduce(w)\nw.item()"),
    ("raise2", "%%ranks\nif dist.get_rank() == 1:\n    w.missing_attribute"),
    ("hang2", "%%ranks 2 --timeout 2\nif dist.get_rank() == 0:\n    comm.all_reduce(w)"),
    ("die", "%%ranks\nimport os, torch.distributed as dist\nif dist.get_rank() == 1:\n    os._exit(3)"),
    ("kill_between", "import os, signal, time\nfrom minipar.runtime import ranks as running\n"
                     "os.kill(running.current().pids[1], signal.SIGKILL)\n"
                     "for _ in range(200):  # until the process is seen gone\n"
                     "    if not running.current().alive():\n        break\n    time.sleep(0.05)"),
    ("after_kill", "%%ranks\nimport torch.distributed as dist\ndist.get_world_size()"),
    ("figure", "%%ranks\nimport torch.distributed as dist\nimport plotly.graph_objects as go\n"
               "go.Figure(go.Bar(y=[dist.get_rank()]))"),
    ("trace", "%%ranks\nimport torch\nfrom minipar import comm\ncomm.all_reduce(torch.ones(4))"),
    ("pulled_trace", "t = %ranks trace\nprint('trace', t.world_size, sorted({e['name'] for e in t.events()}))"),
    ("pids", "pids = %ranks pids\nprint('PIDS', pids)"),
]
FAILING = {"raise_alone", "raise_before_collective", "hang4", "raise2", "hang2", "die"}


def _notebook():
    return v4.new_notebook(cells=[v4.new_code_cell(src, metadata=RAISES if name in FAILING else {})
                                  for name, src in CELLS])


def _text(cell) -> str:
    """Everything a cell showed, as text (plain copies of displays, streams, errors)."""
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type == "error":
            out.append("\n".join(o.traceback))
        else:
            out.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def _html(cell) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in cell.get("outputs", []))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def _wait_gone(pids, seconds=20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if not _gone(p)]


def test_ranks_magic_in_a_notebook(tmp_path):
    from nbclient import NotebookClient
    nb = _notebook()
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env_path}" if env_path else str(ROOT)
    t = time.perf_counter()
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    seconds = time.perf_counter() - t
    print(f"the %%ranks notebook ran in {seconds:.1f} s")
    cell = {name: nb.cells[i] for i, (name, _) in enumerate(CELLS)}
    text = {name: _text(c) for name, c in cell.items()}

    # persistent ranks, labelled output, placement said once
    assert "started 4 ranks: Gloo on CPU" in text["start4"], text["start4"]
    for r in range(4):
        assert f"[rank {r}] rank {r} of 4 on cpu" in text["start4"], text["start4"]
        assert f">rank {r}</th>" in _html(cell["start4"])
    assert "started" not in text["persist4"]
    assert text["persist4"].count("tensor([60., 64., 68.])") == 4, text["persist4"]
    assert "[rank 1] only 1" in text["one_rank"] and "[rank 0]" not in text["one_rank"], text["one_rank"]
    assert "pulled [[60.0, 64.0, 68.0], [60.0, 64.0, 68.0]," in text["pull"], text["pull"]
    assert "[rank 0] tensor([180., 192., 204.])" in text["pushed"], text["pushed"]

    # an exception on one rank: named with its line; the others finished and kept their variables
    assert "rank 2 raised ValueError: only rank 2 at cell line 3" in text["raise_alone"], text["raise_alone"]
    assert 'File "<rank cell' in text["raise_alone"] and "ranks 0, 1, 3 finished the cell" in text["raise_alone"]
    assert "restarted" not in text["raise_alone"]
    assert text["kept"].count("192.0") == 4, text["kept"]

    # the others waited for it in a collective: told, and the ranks restarted
    e = text["raise_before_collective"]
    assert "rank 2 raised ZeroDivisionError: division by zero at cell line 3" in e, e
    assert re.search(r"rank 0: waiting inside all_reduce on world \(seq \d+\).* at cell line 4", e), e
    assert "restarted" in e and text["fresh"].count("False") == 4, text["fresh"]

    # a hang: stopped after the timeout, the collective named, the rank that never called it found
    h = text["hang4"]
    assert "the cell did not finish on every rank within 3 s" in h, h
    assert re.search(r"rank 0: waiting inside all_reduce on world \(seq 1\) for [\d.]+ s "
                     r"at cell line 6: comm.all_reduce\(z\)", h), h
    assert "rank 1: finished the cell; it started no minipar.comm operation" in h, h
    assert "ranks 0, 2, 3 wait inside all_reduce on world (seq 1), which rank 1 never started." in h, h
    assert text["usable"].count("4.0") == 4, text["usable"]
    assert "new processes: True" in text["restart"], text["restart"]

    # another world size: new ranks, said so; the same behaviours on 2
    assert "started 2 ranks: Gloo on CPU" in text["start2"] and "the 4 ranks before were stopped" in text["start2"]
    assert text["start2"].count("\n[rank") + text["start2"].startswith("[rank") <= 2
    assert "[rank 0] 2" in text["start2"] and "[rank 1] 2" in text["start2"], text["start2"]
    assert "[rank 0] 3.0" in text["persist2"] and "[rank 1] 3.0" in text["persist2"], text["persist2"]
    assert "rank 1 raised AttributeError" in text["raise2"] and "at cell line 3" in text["raise2"], text["raise2"]
    assert "rank 0 finished the cell" in text["raise2"], text["raise2"]
    h2 = text["hang2"]
    assert "the cell did not finish on every rank within 2 s" in h2 and "which rank 1 never started" in h2, h2

    # a rank that ends in a cell, or between cells: said, and fresh ranks
    assert "rank 1 died (exit code 3)" in text["die"] and "restarted" in text["die"], text["die"]
    assert "rank 1 (exit code -9) had ended since the last cell; 2 fresh ranks run this one" in text["after_kill"]
    assert "[rank 0] 2" in text["after_kill"] and "[rank 1] 2" in text["after_kill"], text["after_kill"]

    # a figure drawn once; the trace pulled
    plots = [o for o in cell["figure"].outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(plots) == 1, cell["figure"].outputs
    assert "[rank 1] [a figure]" in text["figure"]
    assert "trace 2 ['all_reduce']" in text["pulled_trace"], text["pulled_trace"]

    # the kernel has shut down: no rank left
    pids = [int(p) for p in re.search(r"PIDS \[([\d, ]+)\]", text["pids"]).group(1).split(",")]
    assert len(pids) == 2
    assert _wait_gone(pids) == [], "rank processes outlived the kernel"


def test_an_interrupt_ends_a_hang_and_a_killed_driver_leaves_no_rank(tmp_path):
    """An interrupt (Ctrl-C, the kernel's interrupt) while a cell hangs: what each rank was doing,
    then fresh ranks. Then the driver is killed outright, so no atexit runs: the ranks notice
    that the driver is gone and end."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, signal, threading, time\n"
        "from minipar.runtime.ranks import Ranks\nfrom minipar.runtime.rank_report import describe\n"
        "r = Ranks(2)\n"
        "def interrupt_once_waiting():  # as a learner would, once rank 0 waits inside the collective\n"
        "    while not any((w or {}).get('op') and not w['op']['finished'] for w in r.where()):\n"
        "        time.sleep(0.1)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "threading.Thread(target=interrupt_once_waiting, daemon=True).start()\n"
        "o = r.run('import torch, torch.distributed as dist\\nfrom minipar import comm\\n'\n"
        "          'if dist.get_rank() == 0:\\n    comm.all_reduce(torch.ones(1))', timeout=300)\n"
        "print(o.problem, o.restarted, *describe(r, o), sep='\\n')\n"
        "print('PIDS', *r.pids, flush=True)\n"
        "r.cmd[0].send(('run', 9, 'import time\\ntime.sleep(600)', None, {}))  # busy\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: a rank left behind would hold a pipe open
        done = subprocess.run([sys.executable, str(script)], stdout=o, stderr=e, env=env, timeout=300)
    said = out.read_text() + err.read_text()
    # what the driver printed; torch 2.9's Gloo also prints its connections to the ranks' inherited stdout
    lines = [ln for ln in out.read_text().splitlines() if not ln.startswith("[Gloo]")]
    assert done.returncode == -signal.SIGKILL, said
    assert lines[:2] == ["interrupted", "True"], said
    assert lines[2].startswith("rank 0: waiting inside all_reduce on world (seq 1)"), said
    assert lines[3] == "rank 1: finished the cell; it started no minipar.comm operation", said
    pids = [int(p) for p in lines[-1].split()[1:]]
    assert lines[-1].startswith("PIDS") and len(pids) == 2, said
    assert _wait_gone(pids, 10) == [], "rank processes outlived a killed driver"


def test_the_view_labels_every_rank_and_escapes_what_they_print():
    """The HTML has one labelled column per rank, four to a row, and escapes the ranks' text."""
    replies = {r: {"out": f"<b>{r}</b>\n", "value": "tensor([1.])", "figure": None, "error": None}
               for r in range(6)}
    cols = {r: rank_view.column(x, "", None, r) for r, x in replies.items()}
    page = rank_view.to_html(cols, "started 6 ranks")
    assert page.count("<table") == 2 and all(f">rank {r}</th>" in page for r in range(6))
    assert "&lt;b&gt;3&lt;/b&gt;" in page and "<b>3</b>" not in page and "<script" not in page
    text = rank_view.to_text(replies, {5: "waiting"})
    assert "[rank 4] <b>4</b>" in text and "[rank 5] waiting" in text
