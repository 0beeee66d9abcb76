"""Exercise 09: dispatch and combine, the two all-to-alls of expert parallelism.

Under expert parallelism rank j of an ep group holds the j-th block of E/ep experts of an MoE
layer. Every rank routes its own tokens; each (token, expert) assignment travels to the rank
holding its expert, is computed there and comes back. You write the whole exchange:

A. The counts the ranks agree on. ``count_tokens(expert_of, n_experts)``: the assignments per
   expert, an int64 tensor of length ``n_experts`` on the input's device, where experts nobody
   chose count 0. ``exchange_counts(counts, group)``: every rank of the group holds the same
   (ep × E) matrix, row r the counts of group rank r. ``kept_counts(counts, cap)``: that
   matrix after a capacity of ``cap`` assignments per expert (``None``: no limit), by
   position: expert i keeps the first cap of its assignments in rank order (all of rank 0's,
   then rank 1's, ...).
B. Where the rows go. ``split_sizes(counts, rank, ep)``: ``(send, recv)``, two lists of ep
   Python ints, the rows this rank sends to and receives from each rank, where rank a's
   ``send[b]`` equals rank b's ``recv[a]``. ``permutation(keys)``: ``(perm, inverse)``, with
   ``keys[perm]`` sorted, rows of equal keys kept in their original order, and
   ``x[perm][inverse] == x``.
C. The exchange. ``exchange(x, recv, send, group)`` and the autograd function ``AllToAll``
   behind ``all_to_all``: ``x`` holds ``sum(send)`` rows, the first ``send[0]`` for group rank 0
   and so on; the result holds ``sum(recv)`` rows where the rows arrive in rank order (group rank
   0's first), a rank may send or receive no rows, each dtype kept (float64 and bfloat16 in,
   the same dtype out); in backward each arrived row's gradient goes back where the row came
   from.
D. The layer. ``ExpertParallelMoE.__init__``: rank j of the group holds experts j·E/ep ..
   (j+1)·E/ep - 1 of ``moe`` (``self.local``, ``self.experts`` keyed by their own indices) and
   its router; E that ep does not divide is a ``ValueError``. ``ExpertParallelMoE.forward``,
   from the routed assignments to the output ``y`` and the auxiliary losses: count and exchange,
   keep within capacity (``keep``, per assignment, in token order), send the kept rows to their
   experts' ranks, run every local expert on its rows in the single device's order, bring the
   results home, combine them with the router's weights, and set the losses with
   ``self.aux_losses`` (the code after your part reads ``counts``, ``M``, ``cap``, ``kept``,
   ``keep``, ``totals``, ``aux``, ``z`` and ``y``). Invariant: outputs and dropped assignments
   equal the MoE layer on one device, on all ranks' tokens concatenated; every gradient equals
   the single device's (the input's, each expert's, the router's summed over the ranks); the
   load-balancing loss, averaged over the ranks, is one device's, and with a ``token_group``
   its f_i count that group's tokens; a second step (other tokens) is as exact as the first;
   on a non-world group (two ep groups of 2 out of 4 ranks) each group is its own layer.

Derived in notebook 09, "The layer" and "The two all-to-alls" (GShard, Lepikhin et al. 2020,
§2-3; DeepSpeed-MoE, Rajbhandari et al. 2022). The last tests run the library's
``ExpertParallelMoE`` with your code in place, in float64, and compare it with the MoE layer on
one device. Stuck? ``minipar.hint("ex09", "A")`` (or "B", "C", "D") gives a nudge, then the
idea, then the pseudo-code. Grade it with ``python -m minipar.grade ex09``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar.expert_parallel import (ExpertParallelMoE, all_to_all, count_tokens, exchange_counts, kept_counts,
                                     permutation, split_sizes)
from minipar.course.grading import diagnose, expect, expect_close, expect_equal, expect_recorded, observes
from minipar.runtime import trace
from minipar.models.moe import MoE

EXERCISE = "ex09_expert_parallel"
HINTS = {
    "A": ("Three small pieces: a histogram, a gather, and a running total over the ranks. "
          "Which rank's assignments come first for an expert over capacity?",
          "The histogram needs one bin per expert even when nobody chose it. The matrix is an "
          "all-gather of every rank's E counts on the group. By position, rank r's assignments to "
          "expert i start after those of ranks 0..r-1: with cum the running sum down the ranks, rank "
          "r keeps min(cum_r, C) - min(cum_{r-1}, C).",
          "torch.bincount(expert_of, minlength=n_experts); ep = comm.group_size(group); out = "
          "counts.new_empty(ep·E); comm.all_gather(out, counts, group=group, name=\"ep_counts\", "
          "dim=\"ep\"); out.view(ep, -1); kept: cum = counts.cumsum(0); cum.clamp(max=cap) - (cum - "
          "counts).clamp(max=cap), or counts itself when cap is None."),
    "B": ("Which experts live on rank j? Group the columns of the count matrix by their rank. "
          "The inverse permutation answers \"where did row i go?\".",
          "Summing each row's E/ep columns per destination gives an (ep × ep) matrix [source, "
          "destination]: this rank's row is what it sends, its column what it receives. An argsort "
          "with stable=True keeps equal keys in order; the inverse is a scatter of the positions.",
          "per_rank = counts.reshape(ep, ep, -1).sum(-1); return per_rank[rank].tolist(), "
          "per_rank[:, rank].tolist(). perm = torch.argsort(keys, stable=True); inverse = "
          "torch.empty_like(perm); inverse[perm] = torch.arange(perm.numel(), device=perm.device)."),
    "C": ("An all-to-all is a permutation of rows across ranks. What is the transpose of a "
          "permutation, and which exchange applies it?",
          "The output buffer has sum(recv) rows of x's trailing shape and dtype. The backward is the "
          "same exchange the other way, with the split sizes swapped; remember them in ctx, and name "
          "the event <name>_backward.",
          "exchange: out = x.new_empty(sum(recv), *x.shape[1:]); comm.all_to_all_single(out, "
          "x.contiguous(), recv, send, group=group, name=name, **labels); return out. forward: save "
          "recv, send, group, name, labels on ctx; return exchange(x, recv, send, group, name, "
          "**labels). backward: return exchange(grad, ctx.send, ctx.recv, ctx.group, ctx.name + "
          "\"_backward\", **ctx.labels), then None for every other input."),
    "D": ("Follow one assignment: which rank computes it, in which order does that rank see its "
          "rows, and how does its result find its token again?",
          "Capacity counts every rank's tokens: C from the matrix's total over k, and this rank's "
          "assignments to expert i come after the lower ranks' (M[:rank].sum(0)). Sort the kept "
          "assignments by expert with the dropped ones last, so the first sum(send) rows go out in "
          "rank order. The layer keeps only its block of experts, by their own indices. The rows that arrive are grouped by source rank; regroup them by local expert "
          "(stable: source rank, then token order), run each expert on its block, undo the "
          "regrouping, send back with the splits swapped, put zeros for the dropped rows, undo the "
          "sort, and add w·E(x) into each token's row. The auxiliary loss's f_i count every token of "
          "the group (the matrix's column sums), or of token_group when one is given.",
          "__init__: ep, rank = comm.group_size(group), comm.group_rank(group); E % ep: ValueError; "
          "local = range(rank·E/ep, (rank+1)·E/ep); router = moe.router; experts = ModuleDict({str(i): "
          "moe.experts[i] for i in local}). forward: "
          "counts = count_tokens(expert_of, E); M = exchange_counts(counts, group); cap = capacity("
          "M.sum() // k, E, k, factor); kept = kept_counts(M, cap); keep = keep_within_capacity("
          "expert_of, E, cap, before=M[:rank].sum(0)); send, recv = split_sizes(kept, rank, ep); perm, "
          "inverse = permutation(where(keep, expert_of, E)); arrived = all_to_all(x[token_of[perm[:"
          "sum(send)]]], recv, send, group); mine = kept[:, local]; by_expert, back = permutation("
          "arange(len(local)).repeat(ep).repeat_interleave(mine.reshape(-1))); out = cat(expert(chunk) "
          "for chunks of arrived[by_expert].split(mine.sum(0)))[back]; home = all_to_all(out, send, "
          "recv, group); result = cat([home, zeros(N·k - sum(send), h)])[inverse]; y = zeros_like(x)."
          "index_add(0, token_of, result · weights.reshape(-1, 1)); totals = M.sum(0), or counts "
          "all-reduced over token_group when there is one; aux, z = self.aux_losses(logits, probs, "
          "expert_of, totals)."),
}
CONTRACT = {
    "experts nobody chose count 0": "test_count_tokens",
    "every rank of the group holds the same (ep × E) matrix, row r the counts of group rank r":
        "test_exchanges_on_ranks",
    "expert i keeps the first cap of its assignments in rank order": "test_kept_counts",
    "rank a's ``send[b]`` equals rank b's ``recv[a]``": "test_split_sizes",
    "two lists of ep Python ints": "test_split_sizes",
    "rows of equal keys kept in their original order": "test_permutation_is_stable_with_inverse",
    "``x[perm][inverse] == x``": "test_permutation_is_stable_with_inverse",
    "the rows arrive in rank order (group rank 0's first)": "test_exchanges_on_ranks",
    "a rank may send or receive no rows": "test_exchanges_on_ranks",
    "each dtype kept (float64 and bfloat16 in, the same dtype out)": "test_exchanges_on_ranks",
    "each arrived row's gradient goes back where the row came from": "test_exchanges_on_ranks",
    "outputs and dropped assignments equal the MoE layer on one device": ("test_expert_parallel_layer",
                                                                          "test_layer_on_subgroups"),
    "every gradient equals the single device's": "test_expert_parallel_layer",
    "a second step (other tokens) is as exact as the first": "test_expert_parallel_layer",
    "rank j of the group holds experts j·E/ep .. (j+1)·E/ep - 1 of ``moe``": "test_layer_on_subgroups",
    "E that ep does not divide is a ``ValueError``": "test_layer_on_subgroups",
    "the load-balancing loss, averaged over the ranks, is one device's": ("test_expert_parallel_layer",
                                                                        "test_layer_on_subgroups"),
    "with a ``token_group`` its f_i count that group's tokens": "test_layer_on_subgroups",
    "on a non-world group (two ep groups of 2 out of 4 ranks) each group is its own layer":
        ("test_exchanges_on_ranks", "test_layer_on_subgroups"),
}
TIMEOUT = 30


@observes('ex09.A.zero_counts')
def test_count_tokens(impl):
    """count_tokens: assignments per expert, zeros for experts nobody chose, int64."""
    e = torch.tensor([3, 0, 3, 1, 3])
    expect_equal(count_tokens(e, 6).tolist(), [1, 1, 0, 3, 0, 0], "count_tokens([3, 0, 3, 1, 3], 6)", keys="expert")
    r = torch.randint(0, 8, (200,), generator=torch.Generator().manual_seed(0))
    expect_equal(count_tokens(r, 8).tolist(), [int((r == i).sum()) for i in range(8)],
                 "count_tokens of 200 random assignments to 8 experts", keys="expert")
    got = count_tokens(torch.zeros(0, dtype=torch.long), 3)
    expect_equal(got.tolist(), [0, 0, 0], "count_tokens of no assignments, 3 experts", keys="expert")
    expect_equal(str(got.dtype), "torch.int64", "the dtype of count_tokens' result")


@observes('ex09.A.kept')
def test_kept_counts(impl):
    """kept_counts: the assignments kept per expert and rank under a capacity; None keeps everything."""
    M = torch.tensor([[3, 1, 0, 2], [2, 2, 1, 0], [1, 0, 4, 1]])
    expect_equal(kept_counts(M, None).tolist(), M.tolist(), "kept_counts(M, None) (no capacity: M itself)",
                 keys="(rank, expert)")
    want = {2: [[2, 1, 0, 2], [0, 1, 1, 0], [0, 0, 1, 0]], 3: [[3, 1, 0, 2], [0, 2, 1, 0], [0, 0, 2, 1]]}
    for cap, w in want.items():
        expect_equal(kept_counts(M, cap).tolist(), w, f"kept_counts(M = {M.tolist()}, cap = {cap}): assignments "
                     "each rank keeps per expert (the first cap, rank 0's before rank 1's)", keys="(rank, expert)")


@observes('ex09.B.send_recv', 'ex09.B.python_ints')
def test_split_sizes(impl):
    """split_sizes: rows sent to and received from every rank, as Python ints; send and recv agree."""
    M = torch.arange(32).reshape(4, 8)
    got = {r: split_sizes(M, r, 4) for r in range(4)}
    for r, (send, recv) in got.items():
        types = sorted({type(v).__name__ for v in list(send) + list(recv)})
        expect(types == ["int"], f"rank {r}: the split sizes are of type {', '.join(types)}; expected Python ints")
    expect_equal({(a, b): got[a][0][b] for a in range(4) for b in range(4)},
                 {(a, b): got[b][1][a] for a in range(4) for b in range(4)},
                 "rank a's send[b] against rank b's recv[a], counts = arange(32).reshape(4, 8), ep = 4",
                 keys="(a, b)")
    for r, want in ((0, ([3, 7], [3, 11])), (1, ([11, 15], [7, 15]))):
        two = split_sizes(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), r, 2)
        with diagnose(lambda e, two=two: tuple(map(list, two))[::-1] == want,
                      "send equals the expected recv and recv the expected send"):
            expect_equal({"send": list(two[0]), "recv": list(two[1])}, {"send": want[0], "recv": want[1]},
                         f"split_sizes(counts = [[1, 2, 3, 4], [5, 6, 7, 8]], rank {r}, ep = 2)")
    for r, (send, recv) in got.items():
        expect_equal({"send": send, "recv": recv},
                     {"send": [int(M[r, 2 * j:2 * j + 2].sum()) for j in range(4)],
                      "recv": [int(M[j, 2 * r:2 * r + 2].sum()) for j in range(4)]},
                     f"split_sizes(counts = arange(32).reshape(4, 8), rank {r}, ep = 4): rows to and from each rank")


@observes('ex09.B.stable', 'ex09.B.inverse')
def test_permutation_is_stable_with_inverse(impl):
    """permutation: keys[perm] sorted, equal keys in their original order, x[perm][inverse] == x."""
    keys = torch.tensor([2, 0, 3, 2, 1, 0, 2])
    perm, inv = permutation(keys)
    with diagnose(lambda e: sorted(perm.tolist()) == list(range(7)) and keys[perm].tolist() == sorted(keys.tolist()),
                  "keys[perm] is sorted, and rows of equal keys are in another order than the input's"):
        expect_equal(perm.tolist(), [1, 5, 4, 0, 3, 6, 2], "perm for keys [2, 0, 3, 2, 1, 0, 2]", keys="position")
    expect_equal(inv.tolist(), [3, 0, 6, 4, 2, 1, 5], "inverse for keys [2, 0, 3, 2, 1, 0, 2] "
                 "(inverse[perm[i]] = i)", keys="position")
    k = torch.randint(0, 4, (300,), generator=torch.Generator().manual_seed(1))
    perm, inv = permutation(k)
    s = k[perm]
    expect_close(s, torch.sort(k, stable=True).values, "keys[perm] for 300 random keys (sorted)", rtol=0, atol=0)
    for i in range(4):                                  # stable: positions ascending per key
        p = perm[s == i]
        expect_equal(p.tolist(), sorted(p.tolist()), f"positions of key {i} in perm (ascending: a stable sort)",
                     keys="entry")
    x = torch.randn(300)
    expect_close(x[perm][inv], x, "x[perm][inverse] (x itself)", rtol=0, atol=0)


# ----------------------------------------------------------------------------- on ranks
def _split(a, b, case):
    """Rows group rank a sends group rank b in exchange case ``case`` (some are 0)."""
    return (a + 2 * b + case) % 3


EXCHANGES = [  # (name, dtype, on subgroups): run in turn on 4 ranks
    ("float64, the world of 4 ranks", torch.float64, False),
    ("bfloat16, two groups of 2 ([0, 1] and [2, 3])", torch.bfloat16, True),
    ("float32, the world of 4 ranks, other split sizes (a second exchange)", torch.float32, False),
]


def _rows(a, b, n, dtype):
    """The rows group rank a sends group rank b: 16a + 4b + i, exact in bfloat16."""
    return torch.tensor([[16.0 * a + 4 * b + i, -1.0] for i in range(n)], dtype=dtype).reshape(n, 2)


def _sent(since):
    """Bytes sent in the communication recorded since event ``since``."""
    return sum(e["bytes_sent"] for e in trace.events()[since:] if e["kind"] == "comm")


def _exchanges():
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]          # every rank creates both
    rank, dev = dist.get_rank(), minipar.device()
    counts = torch.tensor([rank, 2 * rank, 0, 7 - rank, 1, 5], device=dev)
    since = len(trace.events())
    out = {"counts": [exchange_counts(counts, None).cpu(), exchange_counts(counts, groups[rank // 2]).cpu()],
           "counts sent": _sent(since)}
    for case, (_, dtype, sub) in enumerate(EXCHANGES):
        group, n, r = (groups[rank // 2], 2, rank % 2) if sub else (None, 4, rank)
        send, recv = [_split(r, b, case) for b in range(n)], [_split(a, r, case) for a in range(n)]
        x = torch.cat([_rows(r, b, send[b], dtype) for b in range(n)]).to(dev).requires_grad_()
        try:                    # an error every rank raises alike is reported with its case
            since = len(trace.events())
            y = all_to_all(x, recv, send, group, name="graded_a2a", dim="ep")
            forward, since = _sent(since), len(trace.events())
            (y * (0.5 * y.detach() + r)).sum().backward()              # ∂/∂row = 0.5·row + its receiver
            out[case] = (y.detach().cpu(), x.grad.cpu(), forward, _sent(since))
        except Exception as e:  # noqa: BLE001
            out[case] = f"{type(e).__name__}: {e}"
    return out


@observes('ex09.*.recorded', 'ex09.A.count_matrix', 'ex09.C.rank_order', 'ex09.C.empty', 'ex09.C.dtype', 'ex09.C.grad_back', 'ex09.D.group')
def test_exchanges_on_ranks(impl):
    """On 4 ranks: exchange_counts on the world and on two groups of 2; all_to_all with uneven (some
    empty) splits in float64, bfloat16 on the groups and float32, forward and backward."""
    res = minipar.launch(_exchanges, 4, timeout=TIMEOUT)
    counts = [[rank, 2 * rank, 0, 7 - rank, 1, 5] for rank in range(4)]
    for rank, out in enumerate(res):
        expect_equal(out["counts"][0].tolist(), counts, f"rank {rank}: exchange_counts on the world of 4 ranks",
                     keys="(rank, expert)")
        g = rank // 2
        expect_equal(out["counts"][1].tolist(), counts[2 * g:2 * g + 2],
                     f"rank {rank}: exchange_counts on the group [{2 * g}, {2 * g + 1}]", keys="(group rank, expert)")
        expect_recorded(out["counts sent"], (3 + 1) * 6 * 8, "bytes exchange_counts sent, as recorded (its 6 "
                        "int64 counts to each other rank: 3 on the world, 1 in its group)", f"rank {rank}")
    for case, (name, dtype, sub) in enumerate(EXCHANGES):
        for rank, out in enumerate(res):
            n, r = (2, rank % 2) if sub else (4, rank)
            where = f"{name}: rank {rank}" + (f" (rank {r} of its group)" if sub else "")
            expect(not isinstance(out[case], str), f"{where}: all_to_all raised {out[case]} (sending "
                   f"{[_split(r, b, case) for b in range(n)]} rows, receiving {[_split(a, r, case) for a in range(n)]})")
            y, grad, forward, backward = out[case]
            expect_equal(str(y.dtype), str(dtype), f"the dtype of all_to_all's output, {where}")
            want = torch.cat([_rows(a, r, _split(a, r, case), torch.float64) for a in range(n)])
            expect_close(y.double(), want, "all_to_all's output rows (16·source + 4·this rank + i, in rank "
                         f"order; received from each rank: {[_split(a, r, case) for a in range(n)]})",
                         where=where, rtol=0, atol=0)
            x = torch.cat([_rows(r, b, _split(r, b, case), torch.float64) for b in range(n)])
            dest = torch.cat([torch.full((_split(r, b, case), 2), float(b), dtype=torch.float64) for b in range(n)])
            expect_equal(str(grad.dtype), str(dtype), f"the dtype of the input's gradient, {where}")
            expect_close(grad.double(), 0.5 * x + dest, "the input's gradient (0.5·row + the rank it went to; sent "
                         f"to each rank: {[_split(r, b, case) for b in range(n)]})", where=where, rtol=0, atol=0)
            size = 2 * torch.finfo(dtype).bits // 8                    # bytes per row of 2 elements
            expect_recorded(forward, size * sum(_split(r, b, case) for b in range(n) if b != r), "bytes all_to_all "
                            "sent forward, as recorded (the rows for the other ranks)", where)
            expect_recorded(backward, size * sum(_split(a, r, case) for a in range(n) if a != r), "bytes sent in "
                            "its backward, as recorded (the gradients of the rows that came from the other ranks)",
                            where)


def _moe(k, cf):
    torch.manual_seed(0)
    return MoE(8, 4, k, cf, hidden=16).double()


def _tokens(step, seed=1):
    return torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(seed + 10 * step)).double()


def _grads(layer, x):
    return {"input": x.grad.cpu(), "router": layer.router.weight.grad.cpu(),
            **{f"expert {i}": torch.cat([p.grad.reshape(-1) for p in e.parameters()]).cpu()
               for i, e in layer.experts.items()}}


def _weights(y):
    return torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)


LAYERS = [(2, None), (1, 1.0), (2, 1.0)]


def _ep_layer(steps):
    r, n, dev = dist.get_rank(), dist.get_world_size(), minipar.device()
    out = []
    for k, cf in LAYERS:
        layer = ExpertParallelMoE(_moe(k, cf).to(dev))
        for step in range(steps):
            layer.zero_grad()
            x = _tokens(step).chunk(n)[r].to(dev).requires_grad_()
            y = layer(x)
            (y * _weights(_tokens(step)).chunk(n)[r].to(dev)).sum().backward()
            out.append((y.detach().cpu(), layer.stats["dropped"].cpu(), _grads(layer, x), layer.stats["aux"].cpu()))
    return out


def _single(k, cf, step, x=None):
    moe = _moe(k, cf)
    x = (_tokens(step) if x is None else x).clone().requires_grad_()
    y = moe(x)
    (y * _weights(x)).sum().backward()
    return y.detach(), moe.stats["dropped"], moe.stats["aux"], {"input": x.grad, "router": moe.router.weight.grad,
                                              **{f"expert {i}": torch.cat([p.grad.reshape(-1) for p in e.parameters()])
                                                 for i, e in enumerate(moe.experts)}}


@observes('ex09.D.outputs', 'ex09.D.gradients', 'ex09.D.second_step', 'ex09.D.aux_loss')
def test_expert_parallel_layer(impl):
    """The expert-parallel MoE layer on 2 ranks equals one device, in float64: outputs, dropped
    assignments and gradients, for top-2 dropless, top-1 and top-2 at capacity factor 1, two steps each."""
    steps = 2
    res = minipar.launch(_ep_layer, 2, args=(steps,), timeout=TIMEOUT)
    for c, (k, cf) in enumerate(LAYERS):
        for step in range(steps):
            y, dropped, aux, grads = _single(k, cf, step)
            case = f"top-{k}, capacity factor {cf}, step {step + 1} of {steps}" + (" (other tokens)" if step else "")
            ranks = [res[r][c * steps + step] for r in range(2)]
            for r, (y_r, dropped_r, _, _) in enumerate(ranks):
                where = f"{case}, rank {r}"
                expect_close(dropped_r.float(), dropped.chunk(2)[r].float(), "assignments dropped (over capacity), "
                             "index (token·k + j)", where=where, rtol=0, atol=0)
                expect_close(y_r, y.chunk(2)[r], "layer output (the MoE layer on one device), index "
                             "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
                expect_close(ranks[r][2]["input"], grads["input"].chunk(2)[r], "the input's gradient, index "
                             "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
                for name, g in ranks[r][2].items():
                    if name.startswith("expert"):
                        expect_close(g, grads[name], f"{name}'s gradient (its parameters flattened)", where=where,
                                     rtol=1e-8, atol=1e-10)
            expect_close((ranks[0][3] + ranks[1][3]) / 2, aux, "the load-balancing loss (aux) averaged over the "
                         "2 ranks", where=case, rtol=1e-6, atol=1e-7)
            expect_close(ranks[0][2]["router"] + ranks[1][2]["router"], grads["router"],
                         "the router's gradient summed over the 2 ranks, index (expert, feature)", where=case,
                         rtol=1e-5, atol=1e-7)


def _on_subgroups():
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g, r, dev = dist.get_rank() // 2, dist.get_rank() % 2, minipar.device()
    try:
        ExpertParallelMoE(MoE(8, 6, 2), group=groups[g])              # 6 experts over 2 ranks: fine
        ExpertParallelMoE(MoE(8, 6, 2))                               # over the world of 4: refused
        refused = None
    except ValueError as e:
        refused = str(e)
    layer = ExpertParallelMoE(_moe(2, 1.0).to(dev), group=groups[g], token_group=dist.group.WORLD)
    y = layer(_tokens(0, seed=5 + g).chunk(2)[r].to(dev))
    return (y.detach().cpu(), layer.stats["dropped"].cpu(), layer.stats["matrix"].cpu(), refused,
            {int(i): float(e.fc.weight.detach().sum()) for i, e in layer.experts.items()}, layer.local, layer.stats["aux"].cpu())


@observes('ex09.D.outputs', 'ex09.D.experts', 'ex09.D.divides', 'ex09.D.aux_loss', 'ex09.D.token_group', 'ex09.D.group')
def test_layer_on_subgroups(impl):
    """4 ranks in two ep groups of 2 ([0, 1] and [2, 3]), each with its own tokens: every group's
    layer equals one device on that group's tokens (top-2, capacity factor 1); its experts are the
    group rank's block; the aux loss (token_group: all 4 ranks) averages to one device's on all
    tokens; 6 experts over 4 ranks are refused."""
    res = minipar.launch(_on_subgroups, 4, timeout=TIMEOUT)
    fc = {i: float(e.fc.weight.detach().sum()) for i, e in enumerate(_moe(2, 1.0).experts)}
    for rank, out in enumerate(res):
        expect(isinstance(out[3], str), f"rank {rank}: ExpertParallelMoE(MoE(8, n_experts=6)) over the world of 4 "
                                        "ranks was built; 6 experts over 4 ranks: a ValueError")
        want = [2 * (rank % 2), 2 * (rank % 2) + 1]
        expect_equal({"local": list(out[5]), "experts": out[4]}, {"local": want, "experts": {i: fc[i] for i in want}},
                     f"rank {rank} (rank {rank % 2} of ep group [{rank // 2 * 2}, {rank // 2 * 2 + 1}]): the experts "
                     "it holds, of 4 (self.local, and self.experts by index: the sum of each one's fc weight)")
    one = _moe(2, 1.0)
    one(torch.cat([_tokens(0, seed=5), _tokens(0, seed=6)]))
    expect_close(sum(out[6] for out in res) / 4, one.stats["aux"], "the load-balancing loss (aux) averaged over "
                 "the 4 ranks (token_group: all of them), against one device on all 32 sequences", rtol=1e-6, atol=1e-7)
    for g in range(2):
        x = _tokens(0, seed=5 + g)
        moe = _moe(2, 1.0)
        y = moe(x).detach()
        for r in range(2):
            rank = 2 * g + r
            y_r, dropped_r, M = res[rank][:3]
            where = f"rank {rank} (rank {r} of ep group [{2 * g}, {2 * g + 1}], its own 16 tokens)"
            expect_equal(list(M.shape), [2, 4], f"the shape of the count matrix (ep × E), {where}")
            expect_close(dropped_r.float(), moe.stats["dropped"].chunk(2)[r].float(),
                         "assignments dropped (over capacity), index (token·k + j)", where=where, rtol=0, atol=0)
            expect_close(y_r, y.chunk(2)[r], "layer output (the MoE layer on one device), index "
                         "(sequence, position, feature)", where=where, rtol=1e-10, atol=1e-12)
