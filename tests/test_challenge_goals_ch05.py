"""Challenge 05's goals can fail: layouts that miss one goal each are rejected, with a message that
names what was measured against the goal; a file that calls the library's own layers is refused."""
import types

import pytest
import torch.nn.functional as F

from minipar import tensor_parallel as tp
from minipar.course import challenge
from minipar.course.challenge import EXERCISES_ENV
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch05_mlp_layout as ch05
from minipar.course.graded.alternatives import ch05_mlp_layout as alternative


def _module(shard, forward):
    return types.SimpleNamespace(__name__="planted", shard=shard, forward=forward)


def _megatron(w1, b1, w2, b2, rank, t):
    return w1.chunk(t, 0)[rank].clone(), b1.chunk(t, 0)[rank].clone(), w2.chunk(t, 1)[rank].clone(), b2.clone()


def _no_b2(x, shards, group=None):
    """Megatron's layout without the output bias."""
    w1, b1, w2, _ = shards
    return tp.g(F.linear(F.gelu(F.linear(tp.f(x, group), w1, b1)), w2), group)


def _replicated(w1, b1, w2, b2, rank, t):
    return w1.clone(), b1.clone(), w2.clone(), b2.clone()


def _local(x, shards, group=None):
    """Every rank computes the whole MLP from its whole copy: no communication at all."""
    w1, b1, w2, b2 = shards
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _rows_both(w1, b1, w2, b2, rank, t):
    """W1 and W2 both split by their output features (rows): a quarter of each."""
    return w1.chunk(t, 0)[rank].clone(), b1.chunk(t, 0)[rank].clone(), w2.chunk(t, 0)[rank].clone(), \
        b2.chunk(t, 0)[rank].clone()


def _gather_hidden(x, shards, group=None):
    """The hidden activation (4 times x) all-gathered between the layers, the output gathered."""
    w1, b1, w2, b2 = shards
    h = F.gelu(F.linear(tp.f(x, group), w1, b1))
    return tp.gather(F.linear(tp.all_gather(h, -1, group), w2, b2), -1, group)


def test_another_layout_meets_every_goal():
    m = alternative
    ch05.test_output_and_input_gradient(m)
    ch05.test_memory_goal(m)
    ch05.test_traffic_goal(m)


def test_a_missing_bias_misses_correctness():
    with pytest.raises(GradeFailure, match=r"rank \d: the MLP's output y"):
        ch05.test_output_and_input_gradient(_module(_megatron, _no_b2))


def test_whole_copies_miss_the_memory_goal():
    with pytest.raises(GradeFailure, match=r"memory: rank \d keeps 33408 bytes of weights; the goal is at most 8448"):
        ch05.test_memory_goal(_module(_replicated, _local))


def test_a_gathered_hidden_activation_misses_the_traffic_goal():
    m = _module(_rows_both, _gather_hidden)
    ch05.test_output_and_input_gradient(m)          # right, and a quarter of the memory
    ch05.test_memory_goal(m)
    with pytest.raises(GradeFailure, match=r"traffic: rank \d sent 33792 bytes \(15360 forward, 18432 backward\); "
                                           r"the goal is at most 12288"):
        ch05.test_traffic_goal(m)


def test_no_communication_is_noticed():
    with pytest.raises(GradeFailure, match=r"rank \d recorded no communication through minipar\.comm in forward"):
        ch05.test_traffic_goal(_module(_replicated, _local))


def test_the_librarys_layers_are_refused(tmp_path, monkeypatch):
    (tmp_path / "challenges").mkdir()
    path = tmp_path / "challenges" / "ch05_mlp_layout.py"
    monkeypatch.setenv(EXERCISES_ENV, str(tmp_path))
    for line in ("from minipar.tensor_parallel import column_parallel_linear, row_parallel_linear\n",
                 "from minipar import tensor_parallel as tp\nY = tp.ParallelMLP\n",
                 "from minipar.tensor_parallel.layers import RowParallelLinear\n"):
        path.write_text('"""Mine."""\nimport torch\n' + line + "\n\ndef shard(*a):\n    pass\n\n\ndef forward(*a):\n    pass\n")
        with pytest.raises(GradeFailure, match=r"(?s)ch05_mlp_layout\.py:\d+ .*graded without minipar\.tensor_parallel\.\w+"):
            challenge.load("ch05_mlp_layout", "exercise")
    path.write_text('"""Mine."""\nfrom minipar import tensor_parallel as tp\nF = tp.f\n')
    assert challenge.load("ch05_mlp_layout", "exercise").F is tp.f         # the operators are allowed
