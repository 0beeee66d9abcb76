"""Challenge 01's goals can fail: answers that miss one goal each are rejected, with a message
that names what was measured against the goal; the library's own ring is refused."""
import types

import pytest
import torch
import torch.distributed as dist

from minipar import comm
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch01_all_reduce as ch01
from minipar.runtime.launch import RankError


def _module(fn):
    return types.SimpleNamespace(__name__="planted", all_reduce=fn)


def _ring(tensor, group=None, pieces=1):
    """A ring all-reduce whose every step is cut into ``pieces`` exchanges (same bytes)."""
    n, r = comm.group_size(group), comm.group_rank(group)
    flat = tensor.view(-1)
    chunks = list(flat.tensor_split(n))
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(2 * (n - 1)):
        out, into = (r - s) % n, (r - s - 1) % n
        for a, b in zip(chunks[out].tensor_split(pieces), chunks[into].tensor_split(pieces)):
            buf = torch.empty_like(b)
            comm.exchange(a, right, buf, left, group, name="planted_ring")
            if s < n - 1:
                b += buf
            else:
                b.copy_(buf)
    return tensor


def _everyone_to_everyone(tensor, group=None):
    """Each rank sends its whole tensor to every other: correct, (n-1)·N bytes per rank."""
    n, r = comm.group_size(group), comm.group_rank(group)
    mine, buf = tensor.clone(), torch.empty_like(tensor)
    for d in range(1, n):
        comm.exchange(mine, (r + d) % n, buf, (r - d) % n, group, name="planted_all_to_all")
        tensor += buf
    return tensor


def _even_chunks_only(tensor, group=None):
    """The ring on the first n·⌊N/n⌋ elements: the remainder is never summed."""
    n = comm.group_size(group)
    flat = tensor.view(-1)
    _ring(flat[:n * (flat.numel() // n)], group)
    return tensor


def _outside_comm(tensor, group=None):
    dist.all_reduce(tensor, group=group)
    return tensor


def test_a_plain_ring_meets_every_goal():
    ch01.test_bandwidth_and_time_beat_gather_to_one(_module(_ring))


def test_whole_tensors_miss_the_bandwidth_goal():
    with pytest.raises(GradeFailure, match=r"bandwidth: rank \d sent 3\.000 MiB, the goal is at most .*1\.500 MiB"):
        ch01.test_bandwidth_and_time_beat_gather_to_one(_module(_everyone_to_everyone))


def test_many_small_messages_miss_the_time_goal():
    fn = lambda t, group=None: _ring(t, group, pieces=16)  # noqa: E731
    with pytest.raises(GradeFailure, match=r"modelled time: \d+ µs on rank \d \(96 calls"):
        ch01.test_bandwidth_and_time_beat_gather_to_one(_module(fn))


def test_an_unsummed_remainder_misses_correctness():
    with pytest.raises(GradeFailure, match=r"shape \(10,\)"):
        ch01.test_sums_on_four_ranks(_module(_even_chunks_only))


def test_data_outside_minipar_comm_is_noticed():
    with pytest.raises(GradeFailure, match=r"less than the tensor's .* outside minipar.comm"):
        ch01.test_bandwidth_and_time_beat_gather_to_one(_module(_outside_comm))


@pytest.mark.parametrize("name", ["ring_all_reduce", "halving_doubling_all_reduce", "all_reduce"])
def test_the_library_answer_is_refused(name):
    fn = getattr(comm, name)
    with pytest.raises((GradeFailure, RankError), match=r"minipar's own collectives"):
        ch01.test_bandwidth_and_time_beat_gather_to_one(_module(lambda t, group=None: fn(t, group=group)))
