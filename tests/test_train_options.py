"""``python -m minipar.train`` refuses bad input before any rank starts, and trains every new
dimension: each numeric and choice option with its invalid values (zero, negative, not a
number, infinite, out of range, inconsistent with another option) is one line on stderr naming
the option, exit status 2, no traceback, no rank launched, no file written; a mixture-of-experts
run on dp2·cp2·pp2 with ep2 and ZeRO-1 resumes on dp2·tp2 with ep2 and matches one process."""
import json
import subprocess
import sys

import pytest
import torch

from minipar.production import checkpoint, train
from minipar.data import batches, corpus_tokens
from minipar.hybrid import experts
from minipar.models.gpt import GPT
from minipar.reference import adamw

POSITIVE_INT = ["--dp-shard", "--dp-replicate", "--dp", "--pp", "--tp", "--cp", "--ep", "--virtual-stages", "--microbatches", "--n-layer",
                "--n-head", "--n-embd", "--block-size", "--top-k", "--moe-every", "--batch-size", "--steps", "--keep"]
NATURAL_INT = ["--n-experts", "--seed", "--data-seed", "--save-every"]
POSITIVE_REAL = ["--lr", "--timeout", "--capacity-factor"]
NATURAL_REAL = ["--weight-decay", "--hang-timeout"]
CHOICES = {"--cp-variant": ["ringg", "1"], "--cp-layout": ["zig"], "--zero": ["4", "-1", "1.5", "x"],
           "--sharding": ["fsdp"], "--reshard-after-forward": ["sometimes"], "--schedule": ["1F1B", "zb"], "--dtype": ["fp16"],
           "--recompute": ["some"], "--device": ["tpu"], "--nonfinite": ["ignore"]}
OWN_RANGE = ([(f, v) for f in POSITIVE_INT for v in ("0", "-1", "1.5", "x", "nan")]
             + [(f, v) for f in NATURAL_INT for v in ("-1", "2.5", "x", "inf")]
             + [(f, v) for f in POSITIVE_REAL for v in ("0", "-1", "nan", "inf", "-inf", "x")]
             + [(f, v) for f in NATURAL_REAL for v in ("-1", "-1e-9", "nan", "inf", "x")]
             + [(f, v) for f, vs in CHOICES.items() for v in vs])
MOE = ["--n-experts", "4"]
INCONSISTENT = [  # (argv, the option the message must name)
    (["--n-embd", "30", "--n-head", "4"], "--n-embd"),
    (["--ep", "2", "--dp", "2"], "--ep"),
    (["--capacity-factor", "1.0"], "--capacity-factor"),
    (["--n-experts", "1"], "--n-experts"),
    (MOE + ["--top-k", "5"], "--top-k"),
    (["--n-experts", "3", "--dp", "2", "--ep", "2"], "--n-experts"),
    (MOE + ["--moe-every", "3"], "--moe-every"),
    (MOE + ["--dp", "2", "--ep", "4"], "--ep"),
    (MOE + ["--dp", "4", "--ep", "2", "--capacity-factor", "1.0"], "--capacity-factor"),
    (MOE + ["--dp", "2", "--ep", "2", "--recompute", "full"], "--recompute"),
    (["--sharding", "per-parameter"], "--sharding"),
    (["--reshard-after-forward", "never", "--zero", "1", "--dp", "2"], "--reshard-after-forward"),
    (["--dp", "2", "--dp-shard", "2", "--dp-replicate", "2", "--zero", "3"], "--dp"),
    (["--dp-shard", "2", "--dp-replicate", "2", "--zero", "1"], "--dp-shard"),
    (["--dp", "2", "--dp-shard", "2", "--dp-replicate", "1"], "--dp-shard"),   # HSDP without ZeRO-3
    (["--layout", "auto", "--steps", "12"], "--layout"),                      # one rank: nothing to choose
    (MOE + ["--dp-shard", "2", "--dp-replicate", "2", "--ep", "2", "--zero", "3"], "--dp-shard"),
    (["--zero", "3", "--dp", "2", "--nonfinite", "skip"], "--nonfinite"),
    (["--virtual-stages", "2"], "--virtual-stages"),
    (["--schedule", "interleaved", "--pp", "2", "--virtual-stages", "2"], "--microbatches"),
    (["--dp", "3"], "--dp"),
    (["--tp", "3"], "--tp"),
    (["--pp", "8"], "--pp"),
    (["--cp", "3"], "--cp"),
    (["--cp", "2", "--cp-variant", "ulysses", "--n-head", "1", "--n-embd", "8"], "--cp-variant"),
    (["--microbatches", "3"], "--microbatches"),
    (["--batch-size", "2", "--dp", "4"], "--batch-size"),
    (["--resume"], "--resume"),
]


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if a rank would start."""
    import importlib
    module = importlib.import_module("minipar.runtime.launch")   # the module (minipar.launch is the function)

    def refuse(*a, **k):
        raise AssertionError("a rank was launched")
    monkeypatch.setattr(module, "launch", refuse)


def _refused(argv, flag, capsys, where):
    before = sorted(where.rglob("*"))
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m minipar.train: error: "), (argv, err)
    assert flag in lines[0] and "Traceback" not in err, (argv, err)
    assert sorted(where.rglob("*")) == before, f"{argv} left files behind"


@pytest.mark.parametrize("flag, value", OWN_RANGE)
def test_every_option_refuses_its_invalid_values(flag, value, capsys, tmp_path, no_launch):
    """Zero, negative, fractional, non-numeric, non-finite, out-of-range values and unknown choices."""
    _refused([flag, value], flag, capsys, tmp_path)


@pytest.mark.parametrize("argv, flag", INCONSISTENT)
def test_options_inconsistent_with_each_other_are_refused(argv, flag, capsys, tmp_path, no_launch):
    """An option that contradicts another (or the layout) is refused, naming it."""
    _refused(argv, flag, capsys, tmp_path)


def test_paths_are_checked_without_creating_anything(capsys, tmp_path, no_launch):
    """A --checkpoint-dir that is a file, --resume on an empty directory that does not exist yet
    (not created), --out in a missing directory or naming a directory."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv, flag in ([["--checkpoint-dir", str(afile)], "--checkpoint-dir"],
                       [["--checkpoint-dir", str(tmp_path / "new"), "--resume"], "--resume"],
                       [["--checkpoint-dir", str(afile / "sub")], "--checkpoint-dir"],
                       [["--out", str(tmp_path / "missing" / "x.json")], "--out"],
                       [["--out", str(tmp_path)], "--out"]):
        _refused(argv, flag, capsys, tmp_path)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv", [["--lr", "nan"], ["--n-experts", "4", "--top-k", "5"]])
def test_the_command_exits_2_with_one_line(argv, tmp_path):
    """As a new user runs it: exit status 2, one line on stderr, no traceback, nothing written."""
    done = subprocess.run([sys.executable, "-m", "minipar.production.train", *argv, "--out", str(tmp_path / "o.json")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert argv[-2] in done.stderr and list(tmp_path.iterdir()) == []


def test_moe_5d_run_resumes_on_another_layout_like_one_process(tmp_path):
    """2 steps on dp2·cp2·pp2 with ep2 and ZeRO-1 (m=2), checkpointed, then 2 more resumed on
    dp2·tp2 with ep2 (m=2): the 4 losses and the final weights are those of one process
    accumulating the same micro-batches (rtol 1e-4, atol 5e-5: AdamW, as tests/test_train.py)."""
    ckpt, a, b = tmp_path / "ckpt", tmp_path / "a.json", tmp_path / "b.json"
    common = ["--n-experts", "4", "--microbatches", "2", "--batch-size", "8", "--no-progress",
              "--checkpoint-dir", str(ckpt), "--n-layer", "2", "--n-embd", "16", "--block-size", "16"]
    assert train.main(common + ["--dp", "2", "--cp", "2", "--pp", "2", "--ep", "2", "--zero", "1",
                                "--steps", "2", "--out", str(a)]) == 0
    assert train.main(common + ["--dp", "2", "--tp", "2", "--ep", "2", "--steps", "4", "--resume",
                                "--out", str(b)]) == 0
    first, second = json.loads(a.read_text()), json.loads(b.read_text())
    assert second["resumed_from"] == {"pp": 2, "dp": 2, "tp": 1, "cp": 2, "ep": 2}
    args = train.parse(common)
    data = batches(corpus_tokens()[0], 4, args.batch_size, args.block_size, seed=args.data_seed)
    want = experts.moe_reference(GPT(train.model_config(args), seed=args.seed), data,
                                   adamw(args.lr, args.weight_decay), dp=2, microbatches=2)
    torch.testing.assert_close(torch.tensor(first["losses"] + second["losses"]),
                               torch.tensor(want["losses"]), rtol=1e-4, atol=5e-5)
    got = checkpoint.load_full_state_dict(ckpt)
    assert set(got) == set(want["params"])
    for k, v in want["params"].items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_zero2_and_zero3_layouts_through_the_command_train_like_one_process(tmp_path):
    """``python -m minipar.train`` (3 steps, fp32): dp2·pp2 ZeRO-3 (kept gathered over m=2 micro-batches)
    and ZeRO-2, dp2·tp2·pp2 ZeRO-3, dp2·cp2 ZeRO-3 per-parameter, dp2·cp2·pp2 ZeRO-3 flat, HSDP 2×2
    ZeRO-3 per-parameter, and dp2·ep2 MoE ZeRO-3: the losses it writes equal one process's
    (rtol 1e-4, atol 5e-5: AdamW, as tests/test_train.py; the MoE's reference accumulates the
    same micro-batches, :func:`minipar.hybrid.experts.moe_reference`)."""
    from minipar.reference import train_reference
    common = ["--batch-size", "8", "--steps", "3", "--no-progress", "--n-layer", "2", "--n-embd", "16",
              "--block-size", "16", "--zero", "3"]
    layouts = [["--dp", "2", "--pp", "2", "--microbatches", "2"],
               ["--dp", "2", "--pp", "2", "--microbatches", "2", "--zero", "2"],
               ["--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2"],
               ["--dp", "2", "--cp", "2", "--sharding", "per-parameter"],
               ["--dp", "2", "--cp", "2", "--pp", "2", "--microbatches", "2"],
               ["--dp-shard", "2", "--dp-replicate", "2", "--sharding", "per-parameter"]]
    args = train.parse(common)
    data = batches(corpus_tokens()[0], 3, args.batch_size, args.block_size, seed=args.data_seed)
    want = train_reference(GPT(train.model_config(args), seed=args.seed), data, adamw(args.lr, args.weight_decay))
    moe = train.parse(common + MOE)
    want_moe = experts.moe_reference(GPT(train.model_config(moe), seed=args.seed), data,
                                       adamw(args.lr, args.weight_decay), dp=2, microbatches=1)
    for i, layout in enumerate(layouts + [MOE + ["--dp", "2", "--ep", "2"]]):
        want = want_moe if layout[:2] == MOE else want
        out = tmp_path / f"{i}.json"
        assert train.main(common + layout + ["--out", str(out)]) == 0
        got = json.loads(out.read_text())
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=1e-4, atol=5e-5, msg=lambda m, layout=layout: f"{layout}: {m}")


def test_zero3_checkpoints_resume_across_layouts(tmp_path):
    """ZeRO-3 checkpoints: 2 steps on dp2·pp2 ZeRO-3 flat (m=2), saved; 1 more resumed on HSDP 2×2
    ZeRO-3 per-parameter; 1 more on dp2·tp2 ZeRO-1: the 4 losses are one process's (rtol 1e-4,
    atol 5e-5), and the checkpoints hold every parameter whole (as one process's state dict)."""
    from minipar.reference import train_reference
    ckpt = tmp_path / "ckpt"
    common = ["--batch-size", "8", "--no-progress", "--n-layer", "2", "--n-embd", "16", "--block-size", "16",
              "--checkpoint-dir", str(ckpt)]
    runs = [["--dp", "2", "--pp", "2", "--microbatches", "2", "--zero", "3", "--steps", "2"],
            ["--dp-shard", "2", "--dp-replicate", "2", "--zero", "3", "--sharding", "per-parameter", "--steps", "3"],
            ["--dp", "2", "--tp", "2", "--zero", "1", "--steps", "4"]]
    losses = []
    for i, layout in enumerate(runs):
        out = tmp_path / f"{i}.json"
        assert train.main(common + layout + ["--out", str(out)]) == 0
        losses += json.loads(out.read_text())["losses"]
        if i == 0:
            saved = checkpoint.load_full_state_dict(ckpt)
    args = train.parse(common)
    data = batches(corpus_tokens()[0], 4, args.batch_size, args.block_size, seed=args.data_seed)
    model = GPT(train.model_config(args), seed=args.seed)
    want = train_reference(model, data, adamw(args.lr, args.weight_decay))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=1e-4, atol=5e-5)
    first = train_reference(GPT(train.model_config(args), seed=args.seed), data[:2], adamw(args.lr, args.weight_decay))
    assert set(saved) == set(first["params"])
    for k, v in first["params"].items():
        torch.testing.assert_close(saved[k], v, rtol=1e-4, atol=5e-5)
