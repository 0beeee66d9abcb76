"""Every schedule trains the small GPT exactly like one process: same losses every step,
same final parameters (fp32, rtol 1e-5, atol 1e-6), with 2 and 4 stages and several
micro-batch counts (m < p, m not a multiple of p). One launch per pipeline size checks
all schedules, the measured order of events, the stash, and a pipeline on a subgroup."""
import pytest
import torch.distributed as dist

import minipar
from minipar import cost, data, reference, trace
from minipar import pipeline as pp
from minipar.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=6, n_head=2, n_embd=16)
BATCH, STEPS, RTOL, ATOL = 12, 3, 1e-5, 1e-6
MS = {2: (1, 2, 3, 4), 4: (2, 3, 4, 6, 12)}


def _batches():
    return data.batches(data.synthetic_tokens(2000), STEPS, BATCH, CFG.block_size)


def _configs(p):
    return [(name, m, 2 if name == "interleaved" else 1) for name in pp.SCHEDULES for m in MS[p]
            if not (name == "interleaved" and m % p)]


def _run_all(p):
    """Rank function: train with every schedule; keep each run's events; then two
    pipelines of 2 side by side on subgroups (only when p == 4)."""
    out, batches = [], _batches()
    for name, m, v in _configs(p):
        before = len(trace.events())
        res = pp.train(GPT(CFG, seed=0), batches, pp.make_schedule(name, p, m, v), reference.sgd(0.5))
        res["events"] = trace.events()[before:]
        out.append(res)
    sub = None
    if p == 2:  # the executor refuses stages that do not match the schedule or the group
        s, errors = pp.make_schedule("1f1b", 2, 2), []
        layers = GPT(CFG, seed=0).layers()
        for stages, sched in (({5: layers[0]}, s), ({dist.get_rank(): layers[0]}, pp.make_schedule("1f1b", 4, 2))):
            try:
                pp.Pipeline(stages, sched, (1, 8, 16))
            except ValueError as e:
                errors.append(str(e))
        sub = errors
    if p == 4:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[dist.get_rank() // 2]
        sub = pp.train(GPT(CFG, seed=0), batches, pp.make_schedule("1f1b", 2, 3), reference.sgd(0.5),
                       group=mine)
    return out, sub


@pytest.fixture(scope="module")
def reference_run():
    return reference.train_reference(GPT(CFG, seed=0), _batches(), reference.sgd(0.5))


def _check_events(evs_per_rank, p, m, v, split):
    """On every stage: F before B (before W) for each micro-batch; a stage's F starts only
    after its activation was received and its B after its gradient was (same rank's
    clock: the ranks' clocks differ by the skew of the starting barrier)."""
    S = p * v
    count = 0
    for evs in evs_per_rank:
        t = {}
        for e in evs:
            lab = e["labels"]
            key = lab.get("phase") or e["name"]
            t[key, lab["microbatch"], lab["stage"]] = (e["start"], e["end"])
        for (op, i, s), (start, _) in t.items():
            if op in ("F", "B", "W"):
                count += 1
            if op == "B":
                assert t["F", i, s][1] <= start
            if op == "W":
                assert t["B", i, s][1] <= start
            if op == "F" and s > 0:
                assert t["recv_activation", i, s][1] <= start
            if op == "B" and s < S - 1:
                assert t["recv_grad", i, s][1] <= start
    assert count == m * S * (3 if split else 2)


@pytest.mark.parametrize("p", [2, 4])
def test_schedules_match_single_process(p, reference_run):
    """GPipe, 1F1B, interleaved (v=2), ZB-H1: same losses and parameters as one process."""
    results = minipar.launch(_run_all, p, args=(p,), timeout=240)
    for k, (name, m, v) in enumerate(_configs(p)):
        runs = [r[0][k] for r in results]
        got = pp.gather(runs)
        try:
            reference.assert_same_training(got, reference_run, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            raise AssertionError(f"{name} p={p} m={m} v={v}: {e}") from None
        want_stash = [cost.peak_activations(name, p, m, r, v) for r in range(p)]
        assert got["peak_stash"] == want_stash, (name, p, m, v)
        _check_events([r["events"] for r in runs], p, m, v, name == "zb-h1")
    if p == 2:
        errors = results[0][1]
        assert len(errors) == 2 and "must hold stages [0]" in errors[0] and "group has 2" in errors[1], errors
    if p == 4:  # two independent pipelines on process subgroups {0,1} and {2,3}
        for pair in ((0, 1), (2, 3)):
            got = pp.gather([results[r][1] for r in pair])
            reference.assert_same_training(got, reference_run, rtol=RTOL, atol=ATOL)
