"""A challenge cannot be passed by calling the library's answer: a graded module's ``FORBIDDEN``
makes :func:`minipar.course.challenge.load` refuse a learner's file that imports it, in any form,
naming the line; the solution and other imports load."""
import pytest

from minipar.course import challenge
from minipar.course.challenge import EXERCISES_ENV, GRADED_ENV
from minipar.course.grading import GradeFailure

GRADED = '"""Challenge 97: demo."""\nCHALLENGE = "ch97_demo"\nFORBIDDEN = ("minipar.pipeline.schedules", "minipar.plan.search", "minipar.pipeline.zb_h1")\n'
HEAD = '"""Mine."""\nimport math\nfrom minipar.pipeline import Action  # fine\n'
BODY = "\n\ndef schedule(p, m, rank):\n    return []\n"
REFUSED = {
    "import minipar.pipeline.schedules\n": 4,
    "import minipar.pipeline.schedules as s\n": 4,
    "from minipar.pipeline import schedules\n": 4,
    "from minipar.pipeline.schedules import zb_h1\n": 4,
    "from minipar.pipeline.schedules.x import y\n": 4,
    "import importlib\nS = importlib.import_module('minipar.pipeline.schedules')\n": 5,
    "from importlib import import_module\nS = import_module('minipar.plan.search')\n": 5,
    "import minipar\n\nS = minipar.pipeline.schedules.zb_h1\n": 6,
    "from minipar.pipeline import zb_h1\n": 4,
    "import minipar.pipeline as pp\nS = pp.zb_h1\n": 5,
    "from minipar import pipeline as pp\nS = pp.schedules\n": 5,
}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    graded, mine = tmp_path / "graded", tmp_path / "mine"
    graded.mkdir(), (mine / "challenges").mkdir(parents=True)
    (graded / "test_ch97_demo.py").write_text(GRADED)
    monkeypatch.setenv(GRADED_ENV, str(graded))
    monkeypatch.setenv(EXERCISES_ENV, str(mine))
    return graded, mine / "challenges" / "ch97_demo.py"


@pytest.mark.parametrize("line", list(REFUSED), ids=range(len(REFUSED)))
def test_an_import_of_the_answer_is_refused_naming_the_line(dirs, line):
    _, path = dirs
    path.write_text(HEAD + line + BODY)
    with pytest.raises(GradeFailure) as e:
        challenge.load("ch97_demo", "exercise")
    want = REFUSED[line]
    code = (HEAD + line).splitlines()[want - 1].strip()
    assert str(e.value).startswith(f"{path}:{want}  {code}\n"), str(e.value)
    assert "graded without minipar." in str(e.value)


def test_other_imports_and_other_targets_load(dirs, tmp_path):
    graded, path = dirs
    path.write_text(HEAD + "from minipar.pipeline.schedules_x import y  # another module\n" + BODY)
    challenge.refuse_imports(path, challenge.forbidden("ch97_demo"))         # a name is no prefix of it
    path.write_text(HEAD + BODY)
    assert challenge.load("ch97_demo", "exercise").schedule(4, 8, 0) == []
    assert challenge.forbidden("ch97_demo") == ("minipar.pipeline.schedules", "minipar.plan.search",
                                                "minipar.pipeline.zb_h1")
    path.write_text(HEAD + "import minipar.pipeline as pp\nS = pp.gpipe\n" + BODY)
    challenge.refuse_imports(path, challenge.forbidden("ch97_demo"))         # another name of the package
    (graded / "test_ch97_demo.py").write_text(GRADED.replace("FORBIDDEN", "NOT_FORBIDDEN"))
    path.write_text(HEAD + "import minipar.pipeline.schedules\n" + BODY)
    assert challenge.load("ch97_demo", "exercise").schedule(4, 8, 0) == []   # no FORBIDDEN: loads
    assert [n for _, n in challenge.imported(path)][:3] == ["math", "minipar.pipeline", "minipar.pipeline.Action"]
