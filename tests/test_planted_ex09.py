"""ex09's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""

from minipar.course.graded import test_ex09_expert_parallel as g
import pytest

from tests.planted import contract_tests, fails, names_its_clause, planted

A2A = "recv, send, group=group, name=name, **labels)\n    return out\n"
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex09.A.count": (
        [("    return torch.bincount(expert_of, minlength=n_experts)", "    return torch.bincount(expert_of)")],
        g.test_count_tokens, r"count_tokens\(\[3, 0, 3, 1, 3\], 6\)"),
    "ex09.A.exchange": (
        [("    return out.view(ep, -1)", "    return counts.expand(ep, -1)")],
        g.test_exchanges_on_ranks, r"rank 0: exchange_counts on the world of 4 ranks: \(rank, expert\) 1\[0\]"),
    "ex09.A.capacity": (
        [("    return cum.clamp(max=cap) - (cum - counts).clamp(max=cap)", "    return counts.clamp(max=cap)")],
        g.test_kept_counts, r"kept_counts\(M = .*, cap = 2\): assignments each rank keeps"),
    "ex09.B.pairs": (
        [("    return per_rank[rank].tolist(), per_rank[:, rank].tolist()",
          "    return per_rank[rank].tolist(), per_rank[rank].tolist()")],
        g.test_split_sizes, r"rank a's send\[b\] against rank b's recv\[a\]"),
    "ex09.B.ints": (
        [("    return per_rank[rank].tolist(), per_rank[:, rank].tolist()",
          "    return list(per_rank[rank]), list(per_rank[:, rank])")],
        g.test_split_sizes, r"rank 0: the split sizes are of type Tensor; expected Python ints"),
    "ex09.B.stable": (
        [("    perm = torch.argsort(keys, stable=True)",
          "    perm = torch.argsort(keys * keys.numel() - torch.arange(keys.numel()), stable=True)")],
        g.test_permutation_is_stable_with_inverse, r"(?s)perm for keys .*seen: keys\[perm\] is sorted, and rows of equal"),
    "ex09.B.inverse": (
        [("    inverse[perm] = torch.arange(perm.numel(), device=perm.device)", "    inverse = perm.clone()")],
        g.test_permutation_is_stable_with_inverse, r"inverse for keys \[2, 0, 3, 2, 1, 0, 2\]"),
    "ex09.C.order": (
        [(A2A, A2A.replace("return out", "return out.flip(0)"))],
        g.test_exchanges_on_ranks, r"float64, the world of 4 ranks: rank \d: all_to_all's output rows"),
    "ex09.C.empty": (
        [(A2A, A2A.replace("    return out", "    return out  # noqa") .replace(
            "recv, send, group=group", "[n for n in recv if n], [n for n in send if n], group=group"))],
        g.test_exchanges_on_ranks, r"float64, the world of 4 ranks: rank \d: all_to_all raised .*\(sending \["),
    "ex09.C.dtype": (
        [("    out = x.new_empty(sum(recv), *x.shape[1:])", "    x = x.float()\n    out = x.new_empty(sum(recv), *x.shape[1:])")],
        g.test_exchanges_on_ranks, r"the dtype of all_to_all's output, float64, the world of 4 ranks: rank 0"),
    "ex09.C.backward": (
        [("        g = exchange(grad, ctx.send", "        g = exchange(grad.flip(0), ctx.send")],
        g.test_exchanges_on_ranks, r"float64, the world of 4 ranks: rank \d: the input's gradient"),
    "ex09.C.named": (   # the backward recorded under the forward's name
        [('ctx.name + "_backward", **ctx.labels)', 'ctx.name, **ctx.labels)')],
        g.test_exchanges_on_ranks, r"float64, the world of 4 ranks: rank 0: \(name, dim\) of what all_to_all"),
    "ex09.D.recorded": (   # the experts computed outside the region the chapter reads
        [('        with trace.region("experts", experts=len(self.local), rows=sum(rows)):',
          '        with trace.region("experts", experts=len(self.local)):')],
        g.test_expert_parallel_layer, r"top-2, capacity factor None, step 1 of 2, rank 0: what the layer recorded"),
    "ex09.D.exact": (
        [(", before=M[:self.rank].sum(0))", ")")],
        g.test_expert_parallel_layer, r"top-1, capacity factor 1.0, step 1 of 2, rank 1: assignments dropped"),
    "ex09.D.grads": (
        [("arrived = all_to_all(x[token_of[perm[:n_kept]]]", "arrived = all_to_all(x[token_of[perm[:n_kept]]].detach()")],
        g.test_expert_parallel_layer, r"top-2, capacity factor None, step 1 of 2, rank 0: the input's gradient"),
    "ex09.D.second": (
        [("perm, inverse = permutation(torch.where(keep, expert_of, E))",
          "perm, inverse = self.__dict__.setdefault('_p', permutation(torch.where(keep, expert_of, E)))")],
        g.test_expert_parallel_layer, r"top-2, capacity factor None, step 2 of 2 \(other tokens\), rank \d: layer output"),
    "ex09.D.experts": (
        [("        self.experts = nn.ModuleDict({str(i): moe.experts[i] for i in self.local})",
          "        self.experts = nn.ModuleDict({str(i): moe.experts[j] for i, j in zip(self.local, self.local[::-1])})")],
        g.test_layer_on_subgroups, r"rank 0 \(rank 0 of ep group \[0, 1\]\): the experts it holds"),
    "ex09.D.divide": (
        [("        if self.n_experts % self.ep:\n", "        if False:\n")],
        g.test_layer_on_subgroups, r"rank 0: ExpertParallelMoE\(MoE\(8, n_experts=6\)\) over the world of 4 ranks was built"),
    "ex09.D.aux": (
        [("        totals = M.sum(0)", "        totals = counts")],
        g.test_expert_parallel_layer, r"top-2, capacity factor None, step 1 of 2: the load-balancing loss \(aux\) averaged"),
    "ex09.D.token_group": (
        [("comm.all_reduce(totals, group=self.token_group", "comm.all_reduce(totals, group=self.group")],
        g.test_layer_on_subgroups, r"the load-balancing loss \(aux\) averaged over the 4 ranks \(token_group"),
    "ex09.*.group": (
        [("    ep = comm.group_size(group)\n", "    ep = comm.group_size()\n"),
         ('comm.all_gather(out, counts.contiguous(), group=group', 'comm.all_gather(out, counts.contiguous(), group=None')],
        g.test_exchanges_on_ranks, r"rank 0: exchange_counts on the group \[0, 1\]"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex09", g, PLANTS, elsewhere={"ex09.*.recorded"})  # planted in tests/test_planted_wrong_answers.py


# More wrong answers of ex09.D.recorded: every collective of the layer is counted, by name and group.
RECORDED = r"top-2, capacity factor None, step 1 of 2, rank 0: what the layer recorded(?s:.*)breaks ex09\.D\.recorded"
EXTRA = {
    "an all-reduce of the counts on the ep group, every forward": (
        "        M = exchange_counts(counts, self.group)\n",
        "        M = exchange_counts(counts, self.group)\n"
        "        comm.all_reduce(counts.clone(), group=self.group, name='ep_count_sum', dim='ep')\n"),
    "one more all-to-all, forward and backward": (
        "        n_kept = sum(send)\n",
        "        n_kept = sum(send)\n"
        "        all_to_all(weights.reshape(-1)[perm[:n_kept]].unsqueeze(1), recv, send, self.group, "
        "name='ep_weights', dim='ep')\n"),
    "the counts' all-gather under another name": (
        'name="ep_counts", dim="ep")', 'name="counts", dim="ep")'),
}


@pytest.mark.parametrize("what", list(EXTRA))
def test_extra_collectives_fail_recorded(what, tmp_path):
    with planted("ex09", tmp_path, EXTRA[what]):
        fails(g.test_expert_parallel_layer, match=RECORDED)


def test_gate_without_gradient_names_grads(tmp_path):
    """Gate weights detached: the router gets no gradient from the output; the failure says so,
    naming ex09.D.grads, instead of crashing inside the grader."""
    with planted("ex09", tmp_path, ("result * weights.reshape(-1, 1)", "result * weights.detach().reshape(-1, 1)")):
        fails(g.test_expert_parallel_layer, match=r"(?s)(got no gradient|router's gradient).*breaks ex09\.D\.grads")


def test_extra_collective_with_a_token_group_fails_recorded(tmp_path):
    """With a token_group the forward has one collective more (the all-reduce over it), no other."""
    with planted("ex09", tmp_path, EXTRA["an all-reduce of the counts on the ep group, every forward"]):
        fails(g.test_layer_on_subgroups,
              match=r"rank 0: what the layer's forward recorded with a token_group(?s:.*)breaks ex09\.D\.recorded")


def test_a_router_copied_per_rank_fails_experts(tmp_path):
    """A router deep-copied per rank: outputs and gradients equal one device's, but the layer does not hold
    the given MoE's router (its training would not reach the dense model's); the failure names ex09.D.experts."""
    with planted("ex09", tmp_path, ("        self.router = moe.router",
                                    '        self.router = __import__("copy").deepcopy(moe.router)')):
        g.test_expert_parallel_layer("exercise")            # outputs, gradients and the trace do not show it
        fails(g.test_layer_on_subgroups, match=r"rank 0: parameters of the given MoE's router .*: "
              r"expected 0 entries, got 1\n  expected: \[\]\n  got:      \['router\.weight'\]\n  breaks ex09\.D\.experts")


# The ranks of an ep group may hold different numbers of tokens: capacity counts the group's tokens.
def test_capacity_from_this_ranks_tokens_times_ep_fails_exact(tmp_path):
    """Capacity from N·ep (every rank assumed to hold this rank's N tokens): with ranks holding 12 and
    20 tokens they disagree on the capacity, so on the rows of the all-to-all; the failure names ex09.D.exact."""
    with planted("ex09", tmp_path, ("cap = capacity(int(M.sum()) // k,", "cap = capacity(N * self.ep,")):
        message = fails(g.test_expert_parallel_layer, match=r"rank 0 holding 12 tokens and rank 1 20 \(one device: "
                        r"all 32\), rank 0: the layer raised ValueError: the ranks disagree on an all-to-all's rows")
    names_its_clause(message, g.test_expert_parallel_layer, "ex09.D.exact")


TOKEN_COUNTS = 'comm.all_reduce(totals, group=self.token_group, name="ep_token_counts", dim="dp")'
SUBGROUPS = r"rank 0: what the layer's forward recorded with a token_group(?s:.*)breaks ex09\.D\.recorded"


@pytest.mark.parametrize("what, new", [
    ("labelled as the ep group's", TOKEN_COUNTS.replace('dim="dp"', 'dim="ep"')),
    ("under another name", TOKEN_COUNTS.replace('"ep_token_counts"', '"token_counts"')),
])
def test_token_group_all_reduce_recorded_otherwise_fails_recorded(what, new, tmp_path):
    """The all-reduce over token_group is "ep_token_counts", on the token group, not labelled dim="ep"."""
    with planted("ex09", tmp_path, (TOKEN_COUNTS, new)):
        message = fails(g.test_layer_on_subgroups, match=SUBGROUPS)
    names_its_clause(message, g.test_layer_on_subgroups, "ex09.D.recorded")


def test_counts_gathered_on_the_world_too_fail_recorded(tmp_path):
    """One more all-gather of the counts, on the world (4 ranks) rather than the ep group, labelled
    "ep" all the same: the record's group shows where it ran."""
    with planted("ex09", tmp_path, ("        M = exchange_counts(counts, self.group)\n",
                                    "        M = exchange_counts(counts, self.group)\n"
                                    "        exchange_counts(counts, None)\n")):
        message = fails(g.test_layer_on_subgroups, match=SUBGROUPS)
    names_its_clause(message, g.test_layer_on_subgroups, "ex09.D.recorded")


def test_an_expert_skipped_when_no_row_reached_it_fails_grads(tmp_path):
    """An expert run only when rows reached it: outputs are one device's, but an expert no token chose
    gets no gradient (None) where one device gives it a zero one (so ZeRO's flat shards and the
    optimizer's step treat it alike in every layout); the failure names ex09.D.grads."""
    with planted("ex09", tmp_path, ("torch.cat([e(c) for e, c in zip(", "torch.cat([e(c) if len(c) else c for e, c in zip(")):
        fails(g.test_expert_parallel_layer, match=r"(?s)none chooses expert 3, rank 1: expert 3 got no gradient "
              r"\(None\) from the layer's backward; on one device its gradient is zero.*breaks ex09\.D\.grads")


def test_experts_skipped_when_the_rank_got_no_row_fail_grads(tmp_path):
    """The rank's experts not run at all when no row arrived (a shortcut for an idle rank): right
    whenever each rank computes something, wrong when every token chooses another rank's experts,
    whose experts then get no gradient; the failure names ex09.D.grads."""
    with planted("ex09", tmp_path, ("            out = torch.cat([e(c) for e, c in zip(self.experts.values(), chunks)])[back]",
                                    "            out = (torch.cat([e(c) for e, c in zip(self.experts.values(), chunks)])[back]\n"
                                    "                   if sum(rows) else arrived)")):
        fails(g.test_expert_parallel_layer, match=r"(?s)none chooses experts 2 and 3 \(rank 1's: its experts compute no "
              r"row\), rank 1: expert 2 got no gradient \(None\).*breaks ex09\.D\.grads")


def test_the_combine_inside_the_experts_region_fails_recorded(tmp_path):
    """The combine's all-to-all run inside the "experts" region: the same outputs and collectives,
    but the chapter would read the exchange's time as the experts' compute; the failure names
    ex09.D.recorded."""
    with planted("ex09", tmp_path,
                 ("            out = torch.cat([e(c) for e, c in zip(self.experts.values(), chunks)])[back]\n\n"
                  "        home = all_to_all(",
                  "            out = torch.cat([e(c) for e, c in zip(self.experts.values(), chunks)])[back]\n"
                  "            home = all_to_all(")):
        message = fails(g.test_expert_parallel_layer, match=r"(?s)collectives inside an 'experts' region.*ep_combine"
                        r".*breaks ex09\.D\.recorded")
    names_its_clause(message, g.test_expert_parallel_layer, "ex09.D.recorded")


def test_token_counts_summed_over_the_world_fail_token_group(tmp_path):
    """The token counts all-reduced over the world, not the given token group: right when the token
    group is the world, wrong for the token groups [0, 2] and [1, 3]; the failure names ex09.D.token_group."""
    with planted("ex09", tmp_path, ("comm.all_reduce(totals, group=self.token_group", "comm.all_reduce(totals, group=None")):
        fails(g.test_layer_on_subgroups, match=r"averaged over the token group \[0, 2\](?s:.*)breaks ex09\.D\.token_group")


def test_an_all_to_all_never_waited_on_fails_recorded(tmp_path):
    """The exchange started asynchronously and never waited on: its values may even arrive, but
    nothing is recorded (minipar.comm records a transfer once it is waited on), so the graded
    exchange names ex09.*.recorded and says why, before any value it reads."""
    with planted("ex09", tmp_path, ("    comm.all_to_all_single(out, x.contiguous(), recv, send, group=group, name=name, **labels)",
                                    "    comm.all_to_all_single(out, x.contiguous(), recv, send, group=group, name=name, "
                                    "async_op=True, **labels)")):
        message = fails(g.test_exchanges_on_ranks, match=r"(?s)bytes all_to_all sent forward, as recorded.*never waited "
                        r"on, is not recorded.*breaks ex09\.\*\.recorded")
    names_its_clause(message, g.test_exchanges_on_ranks, "ex09.*.recorded")
