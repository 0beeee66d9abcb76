"""Chapter 12: a live layout switch trains exactly like one process, and moves only what it must.

One launch of 4 ranks runs two jobs of 6 steps on the small GPT, each compared with
:func:`minipar.reference.train_reference` (same seed, batches, optimizer), losses of every step
and final parameters, fp32 on CPU:

* AdamW under ZeRO-1, dp4 → dp2·tp2 → pp2·tp2 (switches after steps 2 and 4): ``rtol=1e-4,
  atol=5e-5`` (Adam magnifies rounding near eps, as in test_hybrid);
* SGD with momentum, pp2·tp2 → dp4 → dp2·tp2 with ZeRO-1 (into and out of sharded optimizer
  state): ``rtol=1e-5, atol=1e-6``;
* AdamW, dp4 ZeRO-3 → dp2·tp2 ZeRO-3 → dp2·pp2 ZeRO-1 (into and out of sharded parameters):
  ``rtol=1e-4, atol=5e-5``.

The bytes of the switch into dp4 are counted independently of the plan: every rank ends with
every element of every parameter and momentum buffer, and had only its stage's tensor-parallel
shard, so it must receive (Ψ − held) elements of each, 4 bytes each, and nothing more."""
import json

import numpy as np
import pytest
import torch

import minipar
from minipar import adapt, data, hybrid
from minipar.adapt.moves import plan
from minipar.pipeline import partition
from minipar.models import GPT, GPTConfig
from minipar.reference import assert_same_training, train_reference

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=4, n_embd=32)
SEED, STEPS, BATCH = 1, 6, 8
BATCHES = data.batches(data.synthetic_tokens(3000, CFG.vocab_size), STEPS, BATCH, CFG.block_size)
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
MOMENTUM = {"lr": 0.2, "momentum": 0.9}
OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, **ADAMW),
              "momentum": lambda ps: torch.optim.SGD(ps, **MOMENTUM)}
OPTIMIZERS["zero3"] = OPTIMIZERS["adamw"]
TOL = {"adamw": dict(rtol=1e-4, atol=5e-5), "momentum": dict(rtol=1e-5, atol=1e-6)}
TOL["zero3"] = TOL["adamw"]
JOBS = {"adamw": ("dp=4,zero=1", ["2=dp=2,tp=2,zero=1", "4=pp=2,tp=2,zero=1"]),
        "momentum": ("pp=2,tp=2", ["2=dp=4", "4=dp=2,tp=2,zero=1"]),
        "zero3": ("dp=4,zero=3", ["2=dp=2,tp=2,zero=3", "4=dp=2,pp=2,zero=1"])}


def _jobs() -> dict:
    out = {name: adapt.train(GPT(CFG, seed=SEED), BATCHES, OPTIMIZERS[name], layout=first, switches=sw)
           for name, (first, sw) in JOBS.items()}
    out["auto"] = adapt.train(GPT(CFG, seed=SEED), BATCHES, OPTIMIZERS["momentum"],
                              candidates=["dp=4", "pp=2,tp=2", "dp=2,tp=2,zero=1"], probe=2)
    out["straggler"] = adapt.train(GPT(CFG, seed=SEED), BATCHES, OPTIMIZERS["momentum"], layout="pp=4",
                                   slow_rank="0:4", adapt_every=2, switch_cost=0.0)
    old = hybrid.build(GPT(CFG, seed=SEED), hybrid.ProcessMesh(pp=2, tp=2), microbatches=2)
    out["held"] = sum(v.numel() for v in old.local_state_dict().values())   # pp2·tp2's share
    return out


@pytest.fixture(scope="module")
def launched():
    return minipar.launch(_jobs, 4, timeout=240)


@pytest.mark.parametrize("name", list(JOBS))
def test_switches_train_like_one_process(launched, name):
    want = train_reference(GPT(CFG, seed=SEED), BATCHES, OPTIMIZERS[name])
    got = launched[0][name]
    assert_same_training(got, want, **TOL[name])
    assert all(r[name]["losses"] == got["losses"] for r in launched), "ranks disagree on the loss"
    steps = [s["step"] for s in got["measured"]["switches"]]
    assert steps == [2, 4], steps


def test_candidates_are_measured_and_the_fastest_kept(launched):
    """Three candidates, 2 steps each (real training steps), then the fastest measured for the
    rest: the losses stay one process's, every rank logs the same decision."""
    want = train_reference(GPT(CFG, seed=SEED), BATCHES, OPTIMIZERS["momentum"])
    got = launched[0]["auto"]
    assert_same_training(got, want, **TOL["momentum"])
    log = got["measured"]["decisions"]
    assert [d["layout"] for d in log] == ["dp=4", "pp=2,tp=2", "dp=2,tp=2,zero=1"]
    assert all(d["measured_ms"] > 0 for d in log)
    for d in log:                         # each decision with the steps it measured (the slowest rank's)
        assert len(d["step_ms"]) == 2 and min(d["step_ms"]) > 0 and d["measured_ms"] <= max(d["step_ms"]) + 1e-9
    fastest = min(log, key=lambda d: d["measured_ms"])["layout"]
    assert got["measured"]["layout"] == fastest
    assert all(r["auto"]["measured"]["decisions"] == log for r in launched), "ranks decided differently"
    moved = [s["to"] for s in got["measured"]["switches"]]
    assert moved[:2] == ["pp=2,tp=2", "dp=2,tp=2,zero=1"] and (len(moved) == 2) == (fastest == log[-1]["layout"])


def test_a_straggler_gets_fewer_layers(launched):
    """Rank 0 of pp=4 computes 4× slower: after 2 steps its layers measure slowest, the cut moves
    layers off its stage (the partition of the measured costs), the switch happens (charged 0 s
    here, so that the decision does not depend on this machine's speed) and the losses stay one
    process's."""
    want = train_reference(GPT(CFG, seed=SEED), BATCHES, OPTIMIZERS["momentum"])
    got = launched[0]["straggler"]
    assert_same_training(got, want, **TOL["momentum"])
    first = got["measured"]["repartitions"][0]
    before, after = first["bounds_before"], first["bounds_after"]
    assert first["step"] == 2 and first["switch"], first
    width = lambda b, s: b[s + 1] - b[s]
    assert width(after, 0) < width(before, 0), (before, after)
    assert first["stage_ms_after"] < first["stage_ms_before"]
    assert got["measured"]["switches"][0]["bounds"] == after
    layer_ms = first["layer_ms"]          # the decision keeps the measurement that drove it
    assert len(layer_ms) == len(GPT(CFG).layers()) and first["measured_steps"] == [1, 2]
    stage = lambda b: 3 * max(sum(layer_ms[x:y]) for x, y in zip(b[:-1], b[1:]))
    assert first["stage_ms_before"] == pytest.approx(stage(before)) and first["stage_ms_after"] == pytest.approx(stage(after))
    assert first["bounds_after"] == partition([x / 1e3 for x in layer_ms], len(before) - 1)
    assert all(r["straggler"]["measured"]["repartitions"][0]["bounds_after"] == after for r in launched)


def test_switch_sends_the_plan_and_only_what_is_missing(launched):
    psi = sum(p.numel() for p in GPT(CFG, seed=SEED).parameters())
    held = [r["held"] for r in launched]
    into_dp4 = [r["momentum"]["measured"]["switches"][0] for r in launched]
    want = sum((psi - h) * 2 * 4 for h in held)             # params + momentum, fp32
    assert into_dp4[0]["plan_bytes"] == want, (into_dp4[0]["plan_bytes"], want)
    for job in JOBS:
        for r in launched:
            for s in r[job]["measured"]["switches"]:
                assert s["sent_observed"] == s["bytes_sent"], (job, s)
        per_switch = zip(*[r[job]["measured"]["switches"] for r in launched])
        for ranks in per_switch:
            assert sum(s["bytes_sent"] for s in ranks) == ranks[0]["plan_bytes"]
            assert sum(s["bytes_received"] for s in ranks) == ranks[0]["plan_bytes"]
            for s in ranks:                 # the phases add up to the reshard, the rebuild beside it
                assert set(s["phases"]) == {"describe", "plan", "wait", "copy", "all_to_all"}, s["phases"]
                assert s["seconds"] == pytest.approx(sum(s["phases"].values()))
                assert s["phases"]["all_to_all"] > 0 and s["phases"]["copy"] >= 0 and s["build_seconds"] > 0, s
    # into dp4 every rank receives all it lacks: (Ψ − held) × 2 tensors × 4 bytes
    assert [s["bytes_received"] for s in into_dp4] == [(psi - h) * 2 * 4 for h in held]


def test_exchange_time_is_the_alpha_beta_of_the_busiest_rank():
    """(n − 1)·α + β·max(sent, received): 3 ranks, rank 1 receives the most (900 B)."""
    assert adapt.switch.exchange_seconds([100, 0, 800], [0, 900, 0], alpha=1e-3, beta=1e-6) == \
        pytest.approx(2e-3 + 900e-6)
    assert adapt.switch.exchange_seconds([0], [0], alpha=1.0, beta=1.0) == 0.0


def test_plan_copies_locally_and_spreads_sources():
    """Two ranks: rank 0 held all of a, rank 1 its second half; now rank 0 keeps the second half
    (a local copy) and rank 1 takes the first (from rank 0, the only holder): 8 bytes, by rank 0."""
    old = [{"a": torch.arange(4)}, {"a": torch.tensor([2, 3])}]
    new = [{"a": torch.tensor([2, 3])}, {"a": torch.tensor([0, 1])}]
    p = plan(old, new, {"a": 4})
    assert [(m.src, m.dst, m.src_pos.tolist(), m.dst_pos.tolist()) for m in p.moves] == \
        [(0, 0, [2, 3], [0, 1]), (0, 1, [0, 1], [0, 1])]
    assert p.sent() == [8, 0]
    # every rank holds everything, everyone needs everything: no bytes at all
    full = [{"a": torch.arange(4)}] * 3
    assert plan(full, full, {"a": 4}).bytes() == 0
    # three ranks need what only ranks 0 and 1 hold: each asks the first holder after itself
    old = [{"a": torch.arange(4)}, {"a": torch.arange(4)}, {}]
    p = plan(old, [{}, {}, {"a": torch.arange(4)}], {"a": 4})
    assert [(m.src, m.dst) for m in p.moves] == [(0, 2)]


def test_an_element_no_rank_holds_is_an_error():
    with pytest.raises(ValueError, match=r"a: elements \[3\] .* held by no rank"):
        plan([{"a": torch.tensor([0, 1, 2])}], [{"a": torch.arange(4)}], {"a": 4})


@pytest.mark.parametrize("layout, switches, message", [
    ("dp=2", (), "dp·pp·tp·cp = 2, but the job has 4 ranks"),
    ("dp=4", ["6=dp=2,tp=2"], "outside the run's 6 steps"),
    ("dp=4", ["2=dp=2,tq=2"], "'tq=2' is not KEY=N"),
    ("dp=4", ["2=dp=4,zero=5"], "the ZeRO stage is 0, 1, 2 or 3"),
    ("dp=4", ["2=dp=4", "2=dp=2,tp=2"], "two switches after step 2"),
    ("dp=4", ["x=dp=4"], "expected STEP=LAYOUT"),
])
def test_bad_layouts_are_refused_before_launch(layout, switches, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        adapt.run(GPT(CFG, seed=SEED), BATCHES, 4, layout=layout, switches=switches)


def test_training_command_switches_twice_and_resumes_past_a_switch(tmp_path):
    """``python -m minipar.train --dp 4 --zero 1 --switch-at 2=dp=2,tp=2,zero=1 --switch-at
    4=pp=2,tp=2,zero=1``, 6 steps, run as 3 (checkpointed on dp2·tp2) then resumed to 6: the
    resumed run starts in the layout of step 3 and switches again after step 4. The 6 losses and
    final weights are one process's (AdamW: rtol 1e-4, atol 5e-5)."""
    from minipar.data import batches, corpus_tokens
    from minipar.production import checkpoint, train
    from minipar.reference import adamw
    ckpt, a, b = tmp_path / "ckpt", tmp_path / "a.json", tmp_path / "b.json"
    common = ["--dp", "4", "--zero", "1", "--no-progress", "--checkpoint-dir", str(ckpt),
              "--n-layer", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
              "--switch-at", "2=dp=2,tp=2,zero=1", "--steps"]
    assert train.main(common + ["3", "--out", str(a)]) == 0       # a switch beyond --steps is refused
    assert train.main(common + ["6", "--switch-at", "4=pp=2,tp=2,zero=1", "--resume", "--out", str(b)]) == 0
    first, second = json.loads(a.read_text()), json.loads(b.read_text())
    assert [(s["step"], s["to"]) for s in first["switches"]] == [(2, "dp=2,tp=2,zero=1")]
    assert [(s["step"], s["to"]) for s in second["switches"]] == [(3, "dp=2,tp=2,zero=1"),
                                                                   (4, "pp=2,tp=2,zero=1")]
    args = train.parse(common + ["6"])
    data = batches(corpus_tokens()[0], 6, args.batch_size, args.block_size, seed=args.data_seed)
    want = train_reference(GPT(train.model_config(args), seed=args.seed), data, adamw(args.lr, args.weight_decay))
    torch.testing.assert_close(torch.tensor(first["losses"] + second["losses"]),
                               torch.tensor(want["losses"]), rtol=1e-4, atol=5e-5)
    got = checkpoint.load_full_state_dict(ckpt)
    for k, v in want["params"].items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_training_command_chooses_its_layout_by_measuring(tmp_path, capsys):
    """``--layout auto --candidates 3 --probe-steps 2`` on 4 ranks, 8 steps: the log names three
    candidates with both numbers, the losses are one process's (AdamW: rtol 1e-4, atol 5e-5)."""
    from minipar.data import batches, corpus_tokens
    from minipar.production import train
    from minipar.reference import adamw
    out = tmp_path / "auto.json"
    argv = ["--dp", "4", "--layout", "auto", "--candidates", "3", "--probe-steps", "2", "--steps", "8",
            "--n-layer", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8", "--no-progress"]
    assert train.main(argv + ["--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["decisions"]) == 3 and all(d["predicted_ms"] > 0 < d["measured_ms"] for d in r["decisions"])
    assert "layout auto: " in capsys.readouterr().out
    args = train.parse(argv)
    data = batches(corpus_tokens()[0], 8, args.batch_size, args.block_size, seed=args.data_seed)
    want = train_reference(GPT(train.model_config(args), seed=args.seed), data, adamw(args.lr, args.weight_decay))
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("extra, tol", [
    (["--n-experts", "4"], {"rtol": 1e-4, "atol": 5e-5}),
    (["--dtype", "bf16"], {"rtol": 1e-3, "atol": 2e-3}),
], ids=["experts", "bf16"])
def test_training_command_chooses_a_layout_for_experts_and_bf16(tmp_path, extra, tol):
    """``--layout auto`` with a mixture of experts, and in bf16: the candidates probed are the
    planner's for that model (an MoE's have one micro-batch, so each continues the others'
    training), and the run's losses are the same command's on a fixed dp=4 layout. Tolerances: the
    experts' as tests/test_adapt_layouts.py (AdamW, the layouts' order of sums), bf16's as tests/test_precision.py (a bf16
    matmul's sums round differently over another split)."""
    from minipar.production import train
    base = ["--n-layer", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8", "--steps", "8",
            "--no-progress", "--dp", "4"] + extra
    auto, fixed = tmp_path / "auto.json", tmp_path / "fixed.json"
    assert train.main(base + ["--layout", "auto", "--candidates", "3", "--probe-steps", "2", "--out", str(auto)]) == 0
    assert train.main(base + ["--out", str(fixed)]) == 0
    a, b = json.loads(auto.read_text()), json.loads(fixed.read_text())
    assert len(a["decisions"]) == 3
    if "--n-experts" in extra:
        assert all("pp=" not in d["layout"] for d in a["decisions"]), a["decisions"]
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **tol)


def test_an_experts_job_may_probe_every_expert_split():
    """The candidates of 4 ranks for 4 experts include each ep dividing dp and the experts, no
    pipeline (the micro-batches would hold other rows after a switch), with and without ZeRO-1
    (an expert no token chose steps alike in every layout:
    :func:`test_an_expert_no_token_chose_steps_with_a_zero_gradient`)."""
    from minipar.adapt.auto import candidates
    from minipar.models import GPTConfig
    moe = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16, moe_every=1, n_experts=4)
    lays = candidates(moe, 4, 8)
    assert {(lay.dp, lay.ep, lay.zero) for lay in lays if lay.tp == 1} == {
        (4, ep, zero) for ep in (1, 2, 4) for zero in (0, 1)}
    assert all(lay.pp == 1 for lay in lays)
    dense = candidates(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16), 4, 8)
    assert all(lay.ep == 1 for lay in dense) and any(lay.pp > 1 for lay in dense)


@pytest.mark.parametrize("argv, message", [
    (["--dp", "4", "--switch-at", "2=pp=2,tp=3"], "dp·pp·tp·cp = 6, but the job has 4 ranks"),
    (["--dp", "4", "--switch-at", "9=dp=4"], "outside the run's 4 steps"),
    (["--dp", "4", "--switch-at", "2=dp=4,eq=2"], "'eq=2' is not KEY=N"),
    (["--dp", "4", "--switch-at", "2=dp=4,ep=2"], "ep=2 needs a mixture-of-experts model"),
    (["--dp", "4", "--layout", "auto", "--candidates", "3"], "exceed --steps 4"),
    (["--dp", "2", "--pp", "2", "--microbatches", "2", "--ep", "2", "--n-experts", "4", "--switch-at", "2=dp=4,ep=2"],
     "micro-batches hold other rows"),
    (["--dp", "4", "--zero", "1", "--switch-at", "2=dp=4,zero=1,dp_shard=2"], "needs zero=3"),
])
def test_training_command_refuses_bad_switches_before_launch(argv, message, capsys):
    from minipar.production import train
    with pytest.raises(SystemExit) as e:
        train.main(argv + ["--steps", "4", "--no-progress"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _command(argv, out):
    from minipar.production import train
    assert train.main(argv + ["--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_training_command_switches_a_mixture_of_experts_out_of_ep(tmp_path):
    """``python -m minipar.train --n-experts 4 --dp 2 --ep 2 --switch-at 3=dp=2`` (6 steps): the
    experts and their AdamW state leave the ep split for whole replicas; the losses and final
    weights are one process's accumulating the same micro-batch (m = 1, dropless;
    :func:`~minipar.hybrid.experts.moe_reference`; rtol 1e-4, atol 5e-5, AdamW as above)."""
    from minipar.data import batches, corpus_tokens
    from minipar.hybrid import experts
    from minipar.production import checkpoint, train
    from minipar.reference import adamw
    ckpt = tmp_path / "ckpt"
    argv = ["--n-experts", "4", "--dp", "2", "--ep", "2", "--switch-at", "3=dp=2", "--steps", "6",
            "--n-layer", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8", "--no-progress",
            "--checkpoint-dir", str(ckpt)]
    r = _command(argv, tmp_path / "moe.json")
    assert [(s["step"], s["from"], s["to"]) for s in r["switches"]] == [(3, "dp=2,ep=2", "dp=2")]
    args = train.parse(argv)
    data = batches(corpus_tokens()[0], 6, args.batch_size, args.block_size, seed=args.data_seed)
    want = experts.moe_reference(GPT(train.model_config(args), seed=args.seed), data,
                                 adamw(args.lr, args.weight_decay), dp=2, microbatches=1)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=1e-4, atol=5e-5)
    got = checkpoint.load_full_state_dict(ckpt)
    for k, v in want["params"].items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_training_command_switches_bf16_between_zero1_and_zero3_bitwise(tmp_path):
    """``--dtype bf16 --dp 2 --zero 1 --switch-at 2=dp=2,zero=3 --switch-at 4=dp=2,zero=1``: the fp32
    master weights and AdamW state move bit for bit, and ZeRO-1 and ZeRO-3 on dp2 sum in the same
    order, so the 6 losses equal, bitwise (tolerance 0), those of the same command without
    switches; and one process's in bf16 (rtol 1e-3, atol 2e-3, as tests/test_train.py)."""
    from minipar.data import batches, corpus_tokens
    from minipar.production import train
    from minipar.reference import adamw
    argv = ["--dtype", "bf16", "--dp", "2", "--zero", "1", "--steps", "6", "--n-layer", "2", "--n-embd", "16",
            "--block-size", "16", "--batch-size", "8", "--no-progress"]
    r = _command(argv + ["--switch-at", "2=dp=2,zero=3", "--switch-at", "4=dp=2,zero=1"], tmp_path / "a.json")
    still = _command(argv, tmp_path / "b.json")
    assert [s["to"] for s in r["switches"]] == ["dp=2,zero=3", "dp=2,zero=1"]
    assert r["losses"] == still["losses"]
    args = train.parse(argv)
    data = batches(corpus_tokens()[0], 6, args.batch_size, args.block_size, seed=args.data_seed)
    want = train_reference(GPT(train.model_config(args), seed=args.seed), data, adamw(args.lr, args.weight_decay),
                           dtype=torch.bfloat16)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("extra", [[], ["--zero", "1"], ["--switch-at", "5=dp=2,tp=2"]],
                         ids=["dp", "zero1", "switch"])
def test_an_expert_no_token_chose_steps_with_a_zero_gradient(tmp_path, extra):
    """A mixture of experts against one process, on data where an expert of block 1 gets no
    token at steps 4 and 5. One process runs that expert on no rows, so its gradient is zero
    (not None) and AdamW steps it like the others: its moments decay, weight decay applies, its
    step count keeps pace. So does every layout: dp's reduce, ZeRO-1's flat shard, and a switch
    after step 5 that carries Adam's ``step`` as one number for every parameter. Tolerance
    1e-6 (rounding only): when one process left that expert alone (a gradient of None) the runs
    under ZeRO-1 parted from it by 7e-5, then 3.7e-4, and the switch by 1e-5."""
    _experts_against_one_process(tmp_path, extra)


def _experts_against_one_process(tmp_path, extra):
    """4 experts on dp=4 for 8 steps (``extra``: more options), losses against one process to
    1e-6 (rounding only)."""
    from minipar.data import batches, corpus_tokens
    from minipar.hybrid import experts
    from minipar.production import train
    from minipar.reference import adamw
    argv = ["--n-experts", "4", "--dp", "4", "--steps", "8", "--n-layer", "2", "--n-embd", "16",
            "--block-size", "16", "--batch-size", "8", "--no-progress"] + extra
    r = _command(argv, tmp_path / "run.json")
    args = train.parse(argv)
    data = batches(corpus_tokens()[0], 8, args.batch_size, args.block_size, seed=args.data_seed)
    want = experts.moe_reference(GPT(train.model_config(args), seed=args.seed), data,
                                 adamw(args.lr, args.weight_decay), dp=4, microbatches=1)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-6)


def _pairs(p, n_old, n_new, flat=lambda t: t):
    """Every (source position, destination position) of plan ``p``'s moves, read through ``flat``."""
    out = set()
    for mv in p.moves:
        src = flat(torch.arange(n_old[mv.src]).float())[mv.src_pos]
        dst = flat(torch.arange(n_new[mv.dst]).float())[mv.dst_pos]
        out |= {(mv.src, mv.dst, int(a), int(b)) for a, b in zip(src.tolist(), dst.tolist())}
    return out


def test_blocks_carry_the_same_elements_as_the_index_they_replace():
    """Column shards of a 6×8 matrix on 2 ranks (rows of 4) into row shards (3 whole rows each): with
    ``blocks`` the moves are strided Blocks, and they pair exactly the positions the index moves do."""
    from minipar.moves import Block, Flat, expand, segments
    rows = [np.array([[24 * q, 24]], np.int64) for q in range(2)]
    for order in (range(6), (0, 2, 1, 3, 5, 4)):         # rank 1's rows in local order, then shuffled
        cols = [np.array([[r * 8 + 4 * q, 4] for r in (range(6) if q == 0 else order)], np.int64) for q in range(2)]
        bounds, old_ids, new_ids = segments(cols, rows)
        units = plan([{"s": torch.from_numpy(i)} for i in old_ids], [{"s": torch.from_numpy(i)} for i in new_ids],
                     {"s": len(bounds) - 1})
        plain, _, _ = expand(units, bounds, old_ids, new_ids, {0, 1}, few=0)
        strided, sent, _ = expand(units, bounds, old_ids, new_ids, {0, 1}, few=0, blocks=True, piece=1)
        assert any(isinstance(mv.src_pos, Block) for mv in strided.moves)
        assert not any(isinstance(mv.src_pos, Block) for mv in plain.moves)
        assert sum(mv.numel for mv in strided.moves) == 48 and sent == [12, 12]
        want = _pairs(plain, [24, 24], [24, 24])
        assert len(want) == 48 and _pairs(strided, [24, 24], [24, 24], Flat) == want, order
    t = Flat(torch.zeros(24))
    t[Block(1, 8, 3, 4)] = torch.arange(1.0, 13.0)               # writes elements 1-4, 9-12, 17-20
    assert t.tensor.nonzero().flatten().tolist() == [1, 2, 3, 4, 9, 10, 11, 12, 17, 18, 19, 20]


def test_moves_cut_at_pieces_read_and_write_the_same_elements_in_the_same_order():
    """``by_piece``: a rank's moves cut where its pieces end (any piece sizes; index, slice and Block
    positions) read, peer by peer and in order, the elements the flat plan reads, and write the
    elements it writes: what one rank packs is what its peer unpacks, though each cuts only its
    own pieces."""
    from minipar.adapt.cut import by_piece
    from minipar.moves import Flat, expand, segments
    rows = [np.array([[24 * q, 24]], np.int64) for q in range(2)]
    cols = [np.array([[r * 8 + 4 * q, 4] for r in (range(6) if q == 0 else (0, 2, 1, 3, 5, 4))], np.int64)
            for q in range(2)]
    bounds, old_ids, new_ids = segments(cols, rows)
    units = plan([{"s": torch.from_numpy(i)} for i in old_ids], [{"s": torch.from_numpy(i)} for i in new_ids],
                 {"s": len(bounds) - 1})
    pieces = {(0, 0): [5, 0, 7, 12], (0, 1): [10, 3, 11], (1, 0): [1, 23], (1, 1): [8, 0, 8, 8]}   # empty ones too

    def elements(p, me, side, sizes, cut):
        """Peer → the flat elements ``me`` reads (side 0) or writes (side 1) for it, in order."""
        at, out = np.concatenate([[0], np.cumsum(sizes)]), {}
        for mv in p.moves:
            if (mv.src, mv.dst)[side] != me:
                continue
            pos = (mv.src_pos, mv.dst_pos)[side]
            if cut:
                k = mv.key[side]
                values = Flat(torch.arange(sizes[k]).double() + float(at[k]))[pos]
            else:
                values = Flat(torch.arange(at[-1]).double())[pos]
            out.setdefault((mv.src, mv.dst)[1 - side], []).extend(values.long().tolist())
        return out

    for few, blocks, piece in ((0, False, 256), (16, False, 256), (0, True, 1)):
        for me in (0, 1):
            flat, _, _ = expand(units, bounds, old_ids, new_ids, {me}, few=few, blocks=blocks, piece=piece)
            cut = by_piece(flat, me, pieces[me, 0], pieces[me, 1])
            assert len(cut.moves) > len(flat.moves)
            for side in (0, 1):
                want = elements(flat, me, side, pieces[me, side], False)
                assert sum(map(len, want.values())) == 24 and elements(cut, me, side, pieces[me, side], True) == want


def test_runs_read_the_elements_of_their_moves_in_order_with_fewer_copies():
    """``cut.runs`` (what a switch packs and unpacks): consecutive slices of one piece become one
    slice (adjacent) or one Block (one length at one stride), never across pieces; the elements,
    piece by piece and in order, are the moves' own; index and Block positions pass through."""
    from minipar.adapt.cut import runs
    from minipar.moves import Block, Flat, Move
    rows = [slice(r * 10 + 2, r * 10 + 6) for r in range(5)]                   # a column shard's rows
    moves = [Move(0, 1, (0, 0), x, x) for x in rows]
    moves += [Move(0, 1, (0, 0), slice(60, 63), slice(0, 3)), Move(0, 1, (0, 0), slice(63, 70), slice(0, 7))]
    moves += [Move(0, 1, (1, 0), slice(0, 4), slice(0, 4)), Move(0, 1, (1, 0), slice(10, 14), slice(0, 4))]
    moves += [Move(0, 1, (1, 0), torch.tensor([7, 3]), torch.tensor([0, 1])), Move(0, 1, (1, 0), slice(20, 22), slice(0, 2))]
    moves += [Move(0, 1, (1, 0), slice(30, 32), slice(0, 2)), Move(0, 1, (0, 0), slice(72, 74), slice(0, 2))]
    pieces = [torch.arange(100.0), torch.arange(100.0, 200.0)]
    got = runs(moves, 0)
    assert len(got) == 6 and isinstance(got[0][1], Block) and got[1][1] == slice(60, 70)
    want = [v for mv in moves for v in Flat(pieces[mv.key[0]])[mv.src_pos].tolist()]
    assert [v for k, pos, n in got for v in Flat(pieces[k])[pos].tolist()] == want
    assert [n for *_, n in got] == [Flat(pieces[k])[pos].numel() for k, pos, _ in got]
