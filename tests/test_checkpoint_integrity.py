"""minipar.production.checkpoint integrity: a damaged, missing, foreign or mismatched checkpoint is a
clear error naming the file and the reason, never a silent load. A fuzz test mutates the
files of a real two-rank checkpoint hundreds of times: every case either loads bit-exact or
raises CheckpointError naming the file it damaged."""
import json
import random
import shutil

import pytest
import torch
import torch.distributed as dist

import minipar
from minipar.production import checkpoint
from minipar import hybrid
from minipar.production.checkpoint import CheckpointError, CheckpointNotFound
from minipar.data import batches, corpus_tokens
from minipar.mesh import ProcessMesh
from minipar.models.gpt import GPT, GPTConfig
from minipar.reference import adamw

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
BATCHES = batches(corpus_tokens()[0], 2, 4, CFG.block_size, seed=3)
CASES = 600  # random truncations and byte flips (plus the named faults below)


def _save_two_steps(root):
    """tp=2: both ranks write real pieces; AdamW state included; checkpoints at steps 1 and 2."""
    mesh = ProcessMesh(tp=2).build()
    model = hybrid.build(GPT(CFG, seed=0), mesh, optimizer=adamw(1e-2))
    for step, (x, y) in enumerate(BATCHES, 1):
        model.train_step(x, y)
        checkpoint.save(root, model, model.optimizer, step=step, extra={"next_step": step})
    return dist.get_rank()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "run"
    minipar.launch(_save_two_steps, 2, args=(root,), timeout=60)
    return root


def _fresh():
    model = GPT(CFG, seed=7)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model, opt) -> dict:
    out = {f"p/{k}": v.detach().clone() for k, v in model.named_parameters()}
    names = {id(p): k for k, p in model.named_parameters()}
    for p, st in opt.state.items():
        for key, v in st.items():
            out[f"{key}/{names[id(p)]}"] = v.detach().clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fuzzed_files_load_bit_exact_or_fail_naming_the_file(saved, tmp_path):
    """600 random truncations and byte flips of `latest`, meta.json and both rank files
    (and of the directory opened without `latest`): each loads exactly the saved state, or
    raises CheckpointError whose path is the damaged file."""
    model, opt = _fresh()
    checkpoint.load(saved, model, opt)
    want = _state(model, opt)
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    step = checkpoint.resolve(root)
    targets = [root / "latest", step / "meta.json", step / "rank_00000.pt", step / "rank_00001.pt"]
    rng = random.Random(0)
    outcomes = {"loaded exactly": 0, "refused": 0}
    fresh, fresh_opt = _fresh()
    for case in range(CASES):
        target = targets[case % len(targets)]
        original = target.read_bytes()
        data = bytearray(original)
        if case % 3 == 0:  # truncated anywhere, to empty
            data = data[:rng.randrange(len(data))]
        else:  # one to three bytes changed (xor with a non-zero mask)
            for _ in range(1 + (case % 3 == 2) * rng.randrange(1, 3)):
                i = rng.randrange(len(data))
                data[i] ^= rng.randrange(1, 256)
        target.write_bytes(bytes(data))
        where = step if (case // len(targets)) % 5 == 4 and target.name == "meta.json" else root
        with torch.no_grad():  # a state unlike the saved one: a load that does nothing shows
            for p in fresh.parameters():
                p.zero_()
        fresh_opt.state.clear()
        try:
            checkpoint.load(where, fresh, fresh_opt)
        except CheckpointError as e:
            outcomes["refused"] += 1
            assert e.path.name == target.name or target.name in str(e), (case, str(e))
            assert e.reason and str(e).startswith(str(e.path)), str(e)
        else:
            outcomes["loaded exactly"] += 1
            assert _same(_state(fresh, fresh_opt), want), f"case {case}: {target.name} loaded WRONG"
        finally:
            target.write_bytes(original)
    print(f"\n{CASES} mutated checkpoints: {outcomes}")
    assert sum(outcomes.values()) == CASES and outcomes["refused"] > CASES * 0.9


def test_each_named_fault_is_a_clear_error(saved, tmp_path):
    """Missing rank file, `latest` pointing nowhere or flipped to the other checkpoint, not a
    checkpoint at all, another model configuration or vocabulary: each names file and reason."""
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    step = checkpoint.resolve(root)
    model, opt = _fresh()

    def fails(match, where=root, cls=CheckpointError, m=None):
        with pytest.raises(cls, match=match) as info:
            checkpoint.load(where, *(m or (model, opt)))
        return info.value

    (step / "rank_00001.pt").rename(tmp_path / "away.pt")
    e = fails(r"rank_00001\.pt: missing", cls=CheckpointNotFound)
    assert isinstance(e, FileNotFoundError)
    (tmp_path / "away.pt").rename(step / "rank_00001.pt")

    latest = (root / "latest").read_text()
    (root / "latest").write_text(latest.replace(step.name, "step_00000099"))
    fails(r"latest: points nowhere: it names step_00000099", cls=CheckpointNotFound)
    other = "step_00000001" if step.name == "step_00000002" else "step_00000002"
    (root / "latest").write_text(latest.replace(step.name, other))  # another real checkpoint
    fails(r"meta\.json: changed or corrupt: its SHA-256 is not the one .*latest recorded")
    (root / "latest").write_text("hello")
    fails(r"latest: corrupt")
    (root / "latest").write_text(latest)

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "meta.json").write_text(json.dumps({"model_type": "gpt2"}))
    fails(r"meta\.json: not a minipar checkpoint \(no format field\)", where=junk)
    (junk / "meta.json").write_bytes(bytes(range(256)))
    fails(r"meta\.json: not a minipar checkpoint \(not JSON", where=junk)
    torch.save(GPT(CFG).state_dict(), tmp_path / "weights.pt")
    fails(r"weights\.pt: not a minipar checkpoint \(a file", where=tmp_path / "weights.pt")
    fails(r"no checkpoint here", where=tmp_path / "nothing", cls=CheckpointNotFound)

    wider = GPT(GPTConfig(**{**CFG.__dict__, "n_embd": 32}))
    fails(r"meta\.json: another model configuration: .* holds shape", m=(wider, None))
    vocab = GPT(GPTConfig(**{**CFG.__dict__, "vocab_size": 72}))
    fails(r"meta\.json: another model configuration: embed\.wte\.weight: the checkpoint holds "
          r"shape \(64, 16\), this model \(72, 16\)", m=(vocab, None))
    checkpoint.load(root, model, opt)  # and the untouched checkpoint still loads


def test_verify_checks_every_file_without_loading(saved, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    meta = checkpoint.verify(root)
    assert meta["format"] == checkpoint.FORMAT and set(meta["checksums"]) == set(meta["files"])
    f = checkpoint.resolve(root) / "rank_00000.pt"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt: truncated: \d+ bytes, the checkpoint recorded \d+"):
        checkpoint.verify(root)
