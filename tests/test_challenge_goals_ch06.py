"""Challenge 06's goals can fail: units that miss one goal each are rejected, with a message that
names what was measured against the goal; the library's own units (``model.layers()``) miss the
peak goal, so the challenge cannot be passed by returning them."""
import types

import pytest

from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch06_zero3_units as ch06


def _module(fn):
    return types.SimpleNamespace(__name__="planted", units=fn)


def _alternating(model):
    """Whole blocks beside split ones, the head in two: 13 units (meets every goal)."""
    out = [model.embed]
    for i, block in enumerate(model.blocks):
        out += [block.ln1, block.attn, block.ln2, block.mlp] if i % 2 == 0 else [block]
    return out + [model.head.ln_f, model.head.lm_head]


def _every_piece(model):
    """Every block in its four pieces: a small peak, 19 units, 38 gathers per step."""
    out = [model.embed]
    for block in model.blocks:
        out += [block.ln1, block.attn, block.ln2, block.mlp]
    return out + [model.head.ln_f, model.head.lm_head]


def test_alternating_units_meet_every_goal():
    m = _module(_alternating)
    ch06.test_trains_like_one_process(m)
    ch06.test_peak_gathered_bytes(m)
    ch06.test_gathers_per_step(m)


def test_the_librarys_default_units_miss_the_peak_goal():
    with pytest.raises(GradeFailure, match=r"peak gathered bytes per rank \[118400, 118400\]: the goal is at most 88,000"):
        ch06.test_peak_gathered_bytes(_module(lambda model: model.layers()))


def test_every_piece_its_own_unit_misses_the_gathers_goal():
    m = _module(_every_piece)
    ch06.test_peak_gathered_bytes(m)
    with pytest.raises(GradeFailure, match=r"all-gathers per step \[38, 38\] \(from the trace\): the goal is at most 28"):
        ch06.test_gathers_per_step(m)


def test_modules_not_the_models_own_are_refused():
    import torch
    with pytest.raises(GradeFailure, match=r"not the model's own: \['Linear'\]"):
        ch06.test_trains_like_one_process(_module(lambda model: [torch.nn.Linear(2, 2)]))
