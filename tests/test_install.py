"""The course installed, not run from its repository: ``pip install .`` (non-editable) puts the
package, its graded tests (``minipar/course/graded/``), ``exercises/`` and ``solutions/`` into
site-packages, and ``python -m minipar.grade ex01 --solution`` then passes from anywhere.

The package is built from a copy of the repository and installed with ``pip install --no-deps
--no-build-isolation --target`` (this environment already has torch and the rest, and nothing
is downloaded). The grader runs from a directory outside the repository with only the
install on ``PYTHONPATH``; an audit hook in every process it starts (the grader, its pytest,
the ranks) records each file opened, and none may lie in the repository."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".ipynb_checkpoints", "checkpoints")

# every process with this directory on PYTHONPATH logs the files it opens under the repository
AUDIT = '''
import os, sys
_repo, _log = os.environ["MINIPAR_AUDIT_REPO"], os.environ["MINIPAR_AUDIT_LOG"]
_ok = tuple(os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
            *os.environ["MINIPAR_AUDIT_ALLOW"].split(os.pathsep)))

def _hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(_repo + os.sep) and not path.startswith(_ok):
            with open(_log, "a") as f:   # (the log itself is outside the repository)
                f.write(path + "\\n")
sys.addaudithook(_hook)
'''


@pytest.mark.slow   # builds and installs a wheel
def test_an_installed_course_grades_from_anywhere(tmp_path):
    src, site, away, hook = (tmp_path / d for d in ("src", "site", "elsewhere", "hook"))
    shutil.copytree(ROOT, src, ignore=COPY_IGNORE)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--no-compile", "--target", str(site), str(src)],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    for shipped in ("minipar/course/graded/test_ex01_collectives.py", "minipar/course/graded/conftest.py",
                    "minipar/course/graded/alternatives/ch01_all_reduce.py", "minipar/assets/corpus.txt",
                    "exercises/ex01_collectives.py", "solutions/ex01_collectives.py",
                    "solutions/challenges/ch01_all_reduce.py"):
        assert (site / shipped).is_file(), f"the install lacks {shipped}"
    away.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(AUDIT))
    log = tmp_path / "opened-in-repo.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "MINIPAR_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(hook)]), MINIPAR_AUDIT_REPO=os.path.realpath(ROOT),
               MINIPAR_AUDIT_LOG=str(log), MINIPAR_AUDIT_ALLOW=os.pathsep.join([str(tmp_path), str(site)]))
    probe = f"import minipar; print(minipar.__file__); open({str(ROOT / 'pyproject.toml')!r}).close()"
    where = subprocess.run([sys.executable, "-c", probe], cwd=away, env=env, capture_output=True, text=True,
                           timeout=120)
    assert Path(where.stdout.strip()).is_relative_to(site), f"minipar imported from {where.stdout}{where.stderr}"
    assert log.read_text().split() == [os.path.realpath(ROOT / "pyproject.toml")], "the audit hook sees reads"
    log.unlink()
    graded = subprocess.run([sys.executable, "-m", "minipar.grade", "ex01", "--solution"], cwd=away, env=env,
                            capture_output=True, text=True, timeout=300)
    out = graded.stdout + graded.stderr
    assert graded.returncode == 0, out[-4000:]
    assert "ex01_collectives (solution):" in out and "(100%)" in out, out[-4000:]
    assert "FAIL" not in out, out[-4000:]
    opened = sorted(set(log.read_text().splitlines())) if log.exists() else []
    assert not opened, "the installed course read files in the repository:\n" + "\n".join(opened[:20])
