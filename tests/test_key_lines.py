"""The course does not hand out an exercise's answer before a hint is asked for.

For every core, ``KEY_LINES`` holds 2-4 distinctive lines or expressions per part, taken from
its solution (the library's marked code), and a few phrases that say the same thing in prose.
None of them may appear (whitespace aside) anywhere a learner is pointed to before asking for
a hint:

* the chapter's notebook (every cell's source);
* the exercise file, as the generator writes it (its contracts, givens and stub bodies);
* the library text the exercise points to: the docstrings ``help()`` shows of every library
  name the exercise file imports (a class with its methods' docstrings) and of the modules it
  imports them from;
* the library's own docstrings of the marked functions, which ``help()`` shows in a notebook;
* the graded test files of the exercise and its chapter's challenge (their hints are sealed).

Each key line must also be in the solution, so a key that stops being the answer (a refactor)
is caught rather than silently checking nothing; and the test fails when a planted key line is
put into a pointed-to text (:func:`test_the_check_finds_a_key_line_where_it_is_planted`).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import re

import pytest

from minipar.course import exercise_files
from minipar.course.markers import GRADED, ROOT, exercises, pieces, stem

# exercise -> part -> key lines (code, from the solution) and prose giveaways (not in the solution)
KEY_LINES = {
    "ex01": {"": ["(r - s - 1) % n", "(r - s - 2) % n", "(r - s) % n", "chunks[recv_c] += buf",
                  "flat.tensor_split(n)", "(vr + mask + src) % n", "mask <= vr < 2 * mask"]},
    "ex02": {"A": ["p.grad = torch.zeros_like(p)", "all_reduce_fn(p.grad, group)"],
             "B": ["reversed(list(params))", "size + nbytes > cap"],
             "C": ["queue_callback(self._finish)", "self.pending[self.next_bucket] == 0",
                   "register_post_accumulate_grad_hook(self._grad_hook)"]},
    "ex03": {"A": ["return x.requires_grad_()", "c.recv_activation(self.shapes[r - 1]"],
             "B": ["2 * (sender * self.m + a.microbatch)", "w.is_completed()"],
             "C": ["self.loss_fn(out, self.ys[i]) / self.schedule.m", "self.stash.pop((i, s))"]},
    "ex04": {"A": ["best[k - 1][i] + c * c"],
             "B": ["warmup = min(p - rank - 1, m)", "range(m - warmup)"],
             "C": ["inputs.chunk(m)", 'Action("RECV_" + a.op']},
    "ex05": {"A": ["return _sum(grad, ctx.group, ctx.name)", "x.view_as(x)", "xt.reshape(-1)"],
             "B": ["F.linear(f(x, group), weight, bias)", "g(F.linear(x, weight), group)", "v.chunk(t, 0)[r]",
                   'v.chunk(t, 1)[r] if k == "weight" else v'],
             "C": ["maxima.view(t, n).max(dim=0)", "z.gather(1, local_y.unsqueeze(1))",
                   "g[rows, local_y] -= owned"]},
    "ex06": {"A": ["reduce_scatter(mine, flat_grad", "flat_grad[r * k:(r + 1) * k]"],
             "B": ["s.grad = g if g.dtype == s.dtype", "all_gather(f, s.detach().to(f.dtype)"],
             "C": ["untyped_storage().resize_(0)", "resize_(full.numel() * full.element_size())",
                   "self.flat.shard_of(master).clone()", "u.shard.grad.add_(g)"],
             "D": ["self.reduction.reached(i)", "self.gather(i + 1, wait=False",
                   "t.register_hook(lambda g, i=i: self.pre_backward(i))"]},
    "ex07": {"A": ['"dp": rank // tp % dp', '"pp": rank // (dp * tp)'],
             "B": ['q["pp"] * dp * tp + q["dp"] * tp + q["tp"]'],
             "C": ["q // ranks_per_node", 'key = (c["tp"] * c["pp"], crosses, c["pp"])'],
             "D": ["dc[i - i % self.ep:i - i % self.ep + self.ep]", "dc[i % self.ep::self.ep]",
                   '"cp": out["tp"] // self.tp', '* self.cp + coords.get("cp", 0)) * self.tp'],
             "E": ["g = dist.new_group(ranks)", 'self.groups["expert_dp"] = self.groups["dp_cp"]',
                   "if dist.get_rank() in ranks:"]},
    "ex08": {"A": ["torch.maximum(lse_a, lse_b)", "(w_a + w_b).unsqueeze(-1)"],
             "B": ["2 * cp - 1 - rank"],
             "C": ['"kv_front" if src < rank else "q_back"', "_start_exchange(kv, prv, nxt, group"],
             "D": ["delta = (do * o).sum(-1)", "contrib += pending()"]},
    "ex09": {"A": ["torch.bincount(expert_of, minlength=n_experts)",
                   "cum.clamp(max=cap) - (cum - counts).clamp(max=cap)"],
             "B": ["counts.reshape(ep, ep, -1).sum(-1)", "argsort(keys, stable=True)"],
             "C": ["exchange(grad, ctx.send, ctx.recv"],
             "D": ["torch.where(keep, expert_of, E)", "before=M[:self.rank].sum(0)"]},
    "ex10": {"A": ["(h + 2 * model.kv_dim) / (3 * h)", "else terms[k] * L.cp",
                   "(1.5 if model.gated else 1.0) * model.top_k"],
             "B": ["dense / (L.tp * L.pp)", "experts / (L.tp * L.pp * L.ep), L.dp * L.cp // L.ep"],
             "C": ["([0, pp - 1] + list(range(1, pp - 1)))[:fewer]",
                   "4 * (seq_len // L.cp) * L.micro_batch * model.vocab / L.tp",
                   "1 if (r == L.pp - 1 and r > 0)", "(model.num_params() / model.n_layer) / L.tp"]},
    "ex12": {"A": ["[(q + j) % world for j in range(1, world)]"],
             "B": ["send[at:at + mv.numel] = tensors[mv.key][mv.src_pos]",
                   "new_tensors[mv.key][mv.dst_pos] = recv[at:at + mv.numel]"],
             "C": ["torch.nonzero(i[1:] != i[:-1] + 1)"]},
}
# prose that gives a part's answer away (the recipes issue 40 found): not in the solution's code
PROSE = {
    "ex01": ["(r-s-1) mod n", "(r-s-2) mod n", "(r-s) mod n", "The chunk each rank sends at each step",
             "SENDS = [[", "sends[left][s]", "sends it 2^k places on"],
    "ex12": ["for each destination in rank order", "rank d unpacks them in the same order"],
    "ex02": ["last parameter first", "one all-reduce per trainable parameter"],
    "ex06": ["resizes its storage to 0", "start ``gather(i + 1)`` without waiting",
             "stage 3 calls this before re-gathering it", "_execution_engine.queue_callback",
             "a unit is freed when its forward returns", "the one before in a backward",
             "right after, the gathered copy is freed", "gather before use, free after",
             "is that one collective", "drop the full ones", "reduce-scatter the averaged gradients",
             "optionally clip by the global norm", "then the shards are all-gathered",
             "a view of this rank's slice of ``flat_params[u]`` in fp32",
             "Clip (if asked) by the norm of the averaged gradient, then"],
    "ex08": ["chunks r and 2c-1-r", "2c-1-r", "m = max(lse_a, lse_b)"],
    "ex09": ["send[j] = Σ", "min(cum_r, cap) - min(cum_{r-1}, cap)", "One recorded ``all_to_all_single``",
             "as ``<name>`` and ``<name>_backward``", "inverse[perm[i]] = i", "(a stable sort)"],
    "ex05": ["max over ranks of the local maxima", "forward: identity      backward: all-reduce",
             "unchanged forward; the gradient is all-reduced", "identity forward, all-reduce backward",
             "all-reduce forward, identity backward", "One `g.all_reduce` inside the forward region",
             r"g(\mathrm{GeLU}(f(X)A_i)B_i)", "f sums it", "g after attention and after the MLP",
             "f before them in backward", "f(x) A_iᵀ + b_i", "g(x_i A_iᵀ) + b", "the full bias (out,) is added once",
             "weight.chunk(t, 0)[r]", "weight.chunk(t, 1)[r]", "all-gathered along the last dimension"],
    "ex03": ["the last stage also computes ``loss_i / m``", "a tag per (kind, micro-batch, sending stage)",
             "runs its layers on the batch and sends the activation to rank 1",
             "continues the backward from there", "tags the messages so that a receive matches its send",
             "keep what the backward needs in ``self.stash[i, s]``", "add the last stage's ``loss_i / m``",
             "from F until the backward that frees them"],
    "ex04": ["``p - r - 1`` warm-up forwards", "p-r-1 *warm-up* forwards", "rank r does p-r-1",
             "p - rank - 1", "p - r - 1 forwards", "warm = min(", "F0 F1 F2 F3 B0 F4 B1",
             'pp.make_schedule("1f1b", 4, 6) print(s.table())', "one forward, one backward.",
             "Insert RECV before and SEND after", "def _add_comms(", "def _one_f_one_b("],
    "ex07": ["rank = p · (dp · tp) + d · tp + t", "p\\cdot(dp\\cdot tp) + d\\cdot tp + t", "rank = p·(dp·tp) + d·tp + t",
             "rank = ((p·dp + d)·cp + c)·tp + t", "tp fastest, then cp, dp, pp", "tp > ranks_per_node",
             "ties go to tp ≤ ranks_per_node", "cut into consecutive blocks", "at the same place of their blocks",
             "then tensor parallelism that stays within a node", "slowest to fastest", '("pp", "dp", "tp")',
             '("pp", "dp", "cp", "tp")', "(p=1, d=0, t=1)", "name_group(g, dim) labels its events"],
    "ex10": ["(h + 2·kv)/3h", "(h + 2·kv_dim)/(3h)", "× 1.5 for a gated MLP", "4·(s/cp)·b·a/t", "4·s·b·V/t",
             "Ψ_experts/(tp·pp·ep)", "Ψ/(tp·pp) of the dense", "the last stage one micro-batch",
             "one layer's \"none\" activations more", "34 * (s // cp) * 4096 + scores / cp",
             "on the GPU's s/cp tokens", "4·a·s·b/t", "Ψ_local = Ψ/(tp·pp)", "dp·cp, or dp·cp/ep",
             "peak_activations(schedule, p, m, r, v)/v", "p·⌈l/p⌉ - l", "(then the second, third, ...)",
             "N = dp_shard·cp", "the first and the last (then", "fp32 logits, ``4·s·b·V/t``",
             "How each component is counted", "dp·cp, or HSDP's dp_shard·cp"],
}


def _flat(text: str) -> str:
    return " ".join(text.split())


def _notebook(k: str) -> str:
    found = sorted((ROOT / "notebooks").glob(f"{k[2:]}_*.ipynb"))
    if not found:
        return ""
    return "\n".join("".join(c["source"]) for c in json.loads(found[0].read_text())["cells"])


def _imported_docs(stub: str) -> dict[str, str]:
    """{what: docstring} of the library names ``stub`` imports and of their modules."""
    out = {}
    for node in ast.walk(ast.parse(stub)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minipar"):
            mod = importlib.import_module(node.module)
            out[node.module] = inspect.getdoc(mod) or ""
            for a in node.names:
                obj = getattr(mod, a.name, None)
                if obj is None:
                    continue
                if inspect.ismodule(obj):
                    out[f"{node.module}.{a.name}"] = inspect.getdoc(obj) or ""
                    continue
                docs = [inspect.getdoc(obj) or ""]
                if inspect.isclass(obj):
                    docs += [inspect.getdoc(m) or "" for _, m in inspect.getmembers(obj)
                             if callable(m) and getattr(m, "__qualname__", "").startswith(obj.__name__ + ".")]
                out[f"{node.module}.{a.name}"] = "\n".join(docs)
    return out


def _marked_docs(k: str) -> dict[str, str]:
    """{qualname: the library's docstring} of ``k``'s marked functions (what help() shows)."""
    out = {}
    for p in pieces(k):
        obj = importlib.import_module(p.module)
        for name in p.qualname.split("."):
            obj = getattr(obj, name)
        out[f"{p.module}.{p.qualname}"] = inspect.getdoc(obj) or ""
    return out


def _graded(k: str) -> dict[str, str]:
    files = sorted(GRADED.glob(f"test_{k}_*.py")) + sorted(GRADED.glob(f"test_ch{k[2:]}_*.py"))
    return {p.name: p.read_text() for p in files}


def pointed_to(k: str) -> dict[str, str]:
    """Every text a learner of ``k`` is pointed to before a hint, by where it is."""
    stub = exercise_files.render(k, solution=False)
    texts = {f"notebook {k[2:]}": _notebook(k), f"exercises/{stem(k)}.py": stub}
    texts.update({f"help({name})": doc for name, doc in _imported_docs(stub).items()})
    texts.update({f"help({name})": doc for name, doc in _marked_docs(k).items()})
    texts.update({f"graded {name}": text for name, text in _graded(k).items()})
    return texts


def leaks(k: str, texts: dict[str, str] | None = None) -> list[str]:
    """Where a key line or prose giveaway of ``k`` appears in what the learner is pointed to."""
    texts = pointed_to(k) if texts is None else texts
    flat = {where: _flat(t) for where, t in texts.items()}
    keys = [(part, line) for part, lines in KEY_LINES[k].items() for line in lines]
    keys += [("prose", p) for p in PROSE.get(k, [])]
    return [f"{k} {part}: {line!r} in {where}" for part, line in keys
            for where, t in flat.items() if _flat(line) in t]


def test_every_core_has_key_lines_and_they_are_its_answer():
    assert set(KEY_LINES) == set(exercises())
    for k, parts in KEY_LINES.items():
        solution = _flat((ROOT / "solutions" / f"{stem(k)}.py").read_text())
        for part, lines in parts.items():
            assert lines, f"{k} {part}: no key line"
            for line in lines:
                assert _flat(line) in solution, f"{k} {part}: {line!r} is not in the solution"


# Known leaks left for the graded tests' owner to remove: each test file that holds a reference
# answer the learner can read (strict: a leak that is fixed must leave this set).
KNOWN = {
}


@pytest.mark.parametrize("k", sorted(KEY_LINES))
def test_no_key_line_where_the_learner_is_pointed(k):
    found = leaks(k)
    known = {f for f in found if any(f.endswith(x) for x in KNOWN.get(k, ()))}
    assert [f for f in found if f not in known] == []
    stale = {x for x in KNOWN.get(k, ()) if not any(f.endswith(x) for f in found)}
    assert not stale, f"fixed, drop from KNOWN: {stale}"


# Cores whose library module the learner is told to read beside the stub (the exercise imports from
# it): its text outside the marked regions (comments and code) holds none of the answer either.
READ_MODULES = {"ex03": ["minipar/pipeline/executor.py", "minipar/pipeline/simulate.py"],  # the rest of Pipeline
                "ex10": ["minipar/plan/memory.py"]}


@pytest.mark.parametrize("k", sorted(READ_MODULES))
def test_no_key_line_in_the_module_read_beside_the_stub(k):
    texts = {}
    for rel in READ_MODULES[k]:
        kept, inside = [], False
        for line in (ROOT / rel).read_text().splitlines():
            if line.strip().startswith("# >>> "):
                inside = True
            elif line.strip().startswith("# <<< "):
                inside = False
            elif not inside:
                kept.append(line)
        texts[rel] = "\n".join(kept)
    assert leaks(k, texts) == []


def test_the_check_finds_a_key_line_where_it_is_planted():
    texts = {w: t for w, t in pointed_to("ex02").items() if not w.startswith("graded")}
    assert leaks("ex02", texts) == []
    texts["notebook 02"] += "\n# and then:   for p in reversed(list(params)):\n"
    texts["help(minipar.comm)"] = "buckets fill from the last parameter first"
    assert leaks("ex02", texts) == [
        "ex02 B: 'reversed(list(params))' in notebook 02",
        "ex02 prose: 'last parameter first' in help(minipar.comm)"]
