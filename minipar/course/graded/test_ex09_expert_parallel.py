"""Exercise 09: the token dispatch of expert parallelism.

Under expert parallelism rank j of ep ranks holds the j-th block of E/ep experts of every
MoE layer, and each rank's (token, expert) assignments travel to the experts' ranks in one
``all_to_all_single`` (and back in a second). Three small functions decide what goes where:

A. ``count_tokens(expert_of, n_experts)``: in, a flat int64 tensor of expert indices (one per
   assignment); out, an int64 tensor of length ``n_experts`` on the same device, the number
   of assignments to each expert (experts nobody chose count 0).
B. ``split_sizes(counts, rank, ep)``: in, the (ep × E) matrix whose row r counts what rank r
   routes to each expert; out, ``(send, recv)``, two lists of ep Python ints: the rows this
   rank sends to each rank, and the rows it receives from each rank (the split sizes
   ``all_to_all_single`` takes). Invariant: rank a's ``send[b]`` equals rank b's ``recv[a]``.
C. ``permutation(keys)``: ``(perm, inverse)``, with ``keys[perm]`` sorted and rows of equal
   keys kept in their original order (a stable sort: a token's position decides which tokens
   an expert over capacity keeps, and the expert must see its rows in the single device's
   order), and ``inverse`` undoing it, ``x[perm][inverse] == x``.

Derived in notebook 09, "The layer" and "The two all-to-alls" (GShard, Lepikhin et al. 2020,
§2; DeepSpeed-MoE, Rajbhandari et al. 2022). The last test runs the library's
``ExpertParallelMoE`` on 2 ranks with your code in place and compares it with the MoE layer
on one device. Stuck? ``minipar.hint("ex09", "A")`` (or "B", "C"). Grade it with
``python -m minipar.grade ex09``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar.expert_parallel import ExpertParallelMoE, count_tokens, permutation, split_sizes
from minipar.course.grading import diagnose, expect, expect_close, expect_equal
from minipar.models.moe import MoE

EXERCISE = "ex09_expert_parallel"
HINTS = {
    "A": ("A histogram of the indices, with one bin per expert, including the empty ones.",
          "torch has a one-call histogram of non-negative integers; tell it the number of bins so "
          "that experts nobody chose still appear.",
          "torch.bincount(expert_of, minlength=n_experts)."),
    "B": ("Which experts live on rank j? Group the columns of the count matrix by their rank.",
          "Summing each row's E/ep columns per destination rank gives an (ep × ep) matrix "
          "[source, destination]; this rank's row is what it sends, its column what it receives.",
          "per_rank = counts.reshape(ep, ep, E // ep).sum(-1); return per_rank[rank].tolist(), "
          "per_rank[:, rank].tolist()."),
    "C": ("Sorting gives the permutation; the inverse permutation answers \"where did row i go?\".",
          "An argsort with stable=True keeps equal keys in order. The inverse is a scatter: put i "
          "at position perm[i].",
          "perm = torch.argsort(keys, stable=True); inverse = torch.empty_like(perm); "
          "inverse[perm] = torch.arange(perm.numel(), device=perm.device)."),
}
TIMEOUT = 20


def test_count_tokens(impl):
    """count_tokens: assignments per expert, zeros for experts nobody chose."""
    e = torch.tensor([3, 0, 3, 1, 3])
    expect_equal(count_tokens(e, 6).tolist(), [1, 1, 0, 3, 0, 0], "count_tokens([3, 0, 3, 1, 3], 6)", keys="expert")
    r = torch.randint(0, 8, (200,), generator=torch.Generator().manual_seed(0))
    expect_equal(count_tokens(r, 8).tolist(), [int((r == i).sum()) for i in range(8)],
                 "count_tokens of 200 random assignments to 8 experts", keys="expert")
    expect_equal(count_tokens(torch.zeros(0, dtype=torch.long), 3).tolist(), [0, 0, 0],
                 "count_tokens of no assignments, 3 experts", keys="expert")


def test_split_sizes(impl):
    """split_sizes: rows sent to and received from every rank, as Python ints."""
    M = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    for r, want in ((0, ([3, 7], [3, 11])), (1, ([11, 15], [7, 15]))):
        got = split_sizes(M, r, 2)
        with diagnose(lambda e, got=got: tuple(got)[::-1] == want, "send and recv are swapped: send[j] sums this "
                      "rank's row over rank j's experts; recv[j] rank j's row over this rank's experts"):
            expect_equal({"send": list(got[0]), "recv": list(got[1])}, {"send": want[0], "recv": want[1]},
                         f"split_sizes(counts = [[1, 2, 3, 4], [5, 6, 7, 8]], rank {r}, ep = 2)")
    M = torch.arange(32).reshape(4, 8)
    for r in range(4):
        send, recv = split_sizes(M, r, 4)
        expect_equal({"send": send, "recv": recv},
                     {"send": [int(M[r, 2 * j:2 * j + 2].sum()) for j in range(4)],
                      "recv": [int(M[j, 2 * r:2 * r + 2].sum()) for j in range(4)]},
                     f"split_sizes(counts = arange(32).reshape(4, 8), rank {r}, ep = 4): rows to and from each rank")
        types = sorted({type(v).__name__ for v in list(send) + list(recv)})
        expect(types == ["int"], f"rank {r}: split sizes must be Python ints (all_to_all_single takes them); "
                                 f"got {', '.join(types)}")


def test_permutation_is_stable_with_inverse(impl):
    """permutation: keys[perm] sorted, equal keys in their original order, x[perm][inverse] == x."""
    keys = torch.tensor([2, 0, 3, 2, 1, 0, 2])
    perm, inv = permutation(keys)
    with diagnose(lambda e: sorted(perm.tolist()) == list(range(7)) and keys[perm].tolist() == sorted(keys.tolist()),
                  "keys[perm] is sorted, but equal keys changed order: the sort must be stable"):
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


def _ep_layer(k, cf):
    r, n, dev = dist.get_rank(), dist.get_world_size(), minipar.device()
    torch.manual_seed(0)
    moe = MoE(8, 4, k, cf, hidden=16).to(dev)
    x = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(1)).to(dev)
    layer = ExpertParallelMoE(moe)
    y = layer(x.chunk(n)[r])
    return y.detach().cpu(), layer.stats["dropped"]


def test_expert_parallel_layer(impl):
    """The expert-parallel MoE layer on 2 ranks equals one device (outputs and dropped tokens)."""
    for k, cf in [(2, None), (1, 1.0), (2, 1.0)]:
        res = minipar.launch(_ep_layer, 2, args=(k, cf), timeout=TIMEOUT)
        torch.manual_seed(0)
        moe = MoE(8, 4, k, cf, hidden=16)
        x = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(1))
        y = moe(x)
        case = f"top-{k}, capacity factor {cf}"
        for r, (y_r, dropped_r) in enumerate(res):
            expect_close(dropped_r.float(), moe.stats["dropped"].chunk(2)[r].float(),
                         "tokens dropped (over capacity) per assignment", where=f"{case}, rank {r}", rtol=0, atol=0)
            expect_close(y_r, y.detach().chunk(2)[r], "layer output (the MoE layer on one device), index "
                         "(sequence, position, feature)", where=f"{case}, rank {r}", rtol=1e-4, atol=1e-5)
