"""Crash and hang diagnostics: the checked exchange (on only while an exercise runs or grading)
turns a send/receive size mismatch, which aborts Gloo, into an error naming the exchange, its
step, both ranks and both sizes; the flight Beacon keeps a rank's last operation in a file."""
import json

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar import comm
from minipar.runtime import flight
from minipar.runtime import checked


def test_checked_only_while_an_exercise_runs_or_grading(monkeypatch):
    monkeypatch.delenv(checked.ENV, raising=False)
    assert not checked.enabled()
    with minipar.exercise("ex01", target="library"):
        assert checked.enabled()
    assert not checked.enabled()
    monkeypatch.setenv(checked.ENV, "1")
    assert checked.enabled()


def _mismatch():
    r = dist.get_rank()
    send = torch.zeros(4 if r == 0 else 3)
    comm.exchange(send, 1 - r, torch.empty(3), 1 - r, name="halo", step=2, phase="demo")
    return "no error"


def test_a_size_mismatch_is_said_in_words_on_both_ranks():
    with minipar.exercise("ex01", target="library"):
        with pytest.raises(minipar.RankError) as e:
            minipar.launch(_mismatch, 2, timeout=30)
    msg = str(e.value)
    assert "exchange 'halo' (phase demo, step 2): sizes differ" in msg, msg
    assert "rank 0 sends to rank 1: expected 3 elements (rank 1's buffer), got 4" in msg, msg
    assert "rank 1 also failed" in msg and "died without a result" not in msg, msg


def _mismatch_in_a_subgroup():
    pair = dist.new_group([2, 3])
    r = dist.get_rank()
    if r >= 2:  # group ranks 0 and 1 are global ranks 2 and 3
        send = torch.zeros(5 if r == 3 else 3)
        comm.exchange(send, 3 - r, torch.empty(3), 3 - r, group=pair, name="halo", step=1)
    return "no error"


def test_a_size_mismatch_in_a_subgroup_names_global_ranks():
    with minipar.exercise("ex01", target="library"):
        with pytest.raises(minipar.RankError) as e:
            minipar.launch(_mismatch_in_a_subgroup, 4, timeout=30)
    msg = str(e.value)
    assert "rank 3 sends to rank 2: expected 3 elements (rank 2's buffer), got 5" in msg, msg


def test_beacon_keeps_the_last_operation(tmp_path):
    path = tmp_path / "rank3.json"
    with flight.Beacon(path, 3, every=0.05):
        flight.detail(step=1, phase="all-gather", peers="sends to rank 0, receives from rank 2")
        flight.started("exchange", "ring_all_reduce", "world")
    d = json.loads(path.read_text())
    assert d["rank"] == 3
    assert d["line"] == ("exchange 'ring_all_reduce' on world (seq 1, phase all-gather, step 1, peers sends to "
                         "rank 0, receives from rank 2): still inside it")
    flight.reset()
