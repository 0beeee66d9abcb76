"""Hints out of plain sight: every graded module stores its ``HINTS`` tiers sealed, so a learner's
grep through the course finds no hint text, and ``minipar.hint`` shows them in plain words."""
import ast
import re

import pytest

from minipar.course import hints
from minipar.course.markers import GRADED

MODULES = sorted(GRADED.glob("test_*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_hints_are_sealed_and_read_back(path):
    node = hints._hints_node(ast.parse(path.read_text()))
    if node is None:
        pytest.skip("no hints")
    table = ast.literal_eval(node.value)
    plain = hints.hints_of(re.match(r"test_((?:ex|ch)\d+)", path.name)[1])
    for part, tiers in table.items():
        for i, tier in enumerate(tiers):
            assert tier.startswith(hints.SEAL), f"{path.name}: HINTS[{part!r}][{i}] is plain text " \
                "(python -m minipar.course.hints --seal)"
            assert plain[part][i] == hints.unseal(tier) and not plain[part][i].startswith(hints.SEAL)


def test_seal_and_unseal_round_trip(tmp_path):
    text = "for p in reversed(params): a tier, with ünïcode ∂L/∂x"
    assert hints.unseal(hints.seal(text)) == text and hints.seal(hints.seal(text)) == hints.seal(text)
    assert text not in hints.seal(text) and hints.unseal(text) == text
    mod = tmp_path / "test_ex98_demo.py"
    mod.write_text('"""Demo."""\nEXERCISE = "ex98_demo"\nHINTS = {"A": ("a nudge", "the steps: x = 1")}\nX = 1\n')
    assert hints.rewrite(mod, sealed=True) and "the steps" not in mod.read_text()
    assert not hints.rewrite(mod, sealed=True)            # idempotent
    assert hints.rewrite(mod, sealed=False) and "the steps: x = 1" in mod.read_text()
    ns = {}
    exec(mod.read_text(), ns)
    assert ns["HINTS"] == {"A": ("a nudge", "the steps: x = 1")} and ns["X"] == 1
