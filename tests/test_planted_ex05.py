"""ex05's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it."""

import pytest

from minipar.course.graded import test_ex05_tensor_parallel as g
from tests.planted import contract_tests, fails, planted

REDUCE = "        comm.all_reduce(out, group=group, name=name)\n"
ROW = "    y = g(F.linear(x, weight), group)\n    return y if bias is None else y + bias"
ROW_LOAD = ('        m.load_state_dict({k: v.chunk(t, 1)[r] if k == "weight" else v  # the bias whole\n'
            '                           for k, v in linear.state_dict().items()})')
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex05.*.group": (
        [("        t, r = size_and_rank(group)\n        z = logits", "        t, r = size_and_rank(None)\n        z = logits")],
        g.test_vocab_parallel_cross_entropy_on_subgroups, r"rank \d \(rank \d of group \[\d, \d\]\), torch\.float32 "
                                                           r"logits: the call raised"),
    "ex05.A.f": (
        [("        return _sum(grad, ctx.group, ctx.name), None, None", "        return grad, None, None")],
        g.test_f_identity_forward_all_reduce_backward, r"seen: the gradient is this rank's own upstream gradient"),
    "ex05.A.g": (
        [('        return _sum(x, group, name)', "        return x.view_as(x)")],
        g.test_g_all_reduce_forward_identity_backward, r"g's forward \(the sum over ranks\)"),
    "ex05.A.bytes": (   # the right sum, with a second all-reduce of it
        [(REDUCE, REDUCE + "        comm.all_reduce(out.mul_(1 / comm.group_size(group)), group=group, name=name)\n")],
        g.test_f_identity_forward_all_reduce_backward, r"bytes sent in f's backward \(one all-reduce of 12 floats\)"),
    "ex05.A.inplace": (
        [("    out = x.clone(memory_format=torch.contiguous_format)", "    out = x.contiguous()")],
        g.test_g_all_reduce_forward_identity_backward, r"seen: the tensor given to g changed during the call"),
    "ex05.A.gather": (
        [("    return out.view(n * xt.shape[0], *xt.shape[1:]).movedim(0, dim).contiguous()",
          "    return out.view(n, -1).flip(0).reshape(n * xt.shape[0], *xt.shape[1:]).movedim(0, dim).contiguous()")],
        g.test_gather_and_split, r"gather along dim 0 \(the group's blocks in rank order"),
    "ex05.A.split": (
        [("    return x.chunk(n, dim)[r].contiguous()", "    return x.chunk(n, dim)[0].contiguous()")],
        g.test_gather_and_split, r"(split along dim 1 \(block 1 of 2\)|the gradient of gather's input)"),
    "ex05.A.divide": (
        [('    divide(x.shape[dim], n, f"size along dim {dim}")\n    return x.chunk', "    return x.chunk")],
        g.test_gather_and_split, r"split of a size-5 dimension over 2 ranks"),
    "ex05.B.column": (
        [("    return gather(y, -1, group) if gather_output else y", "    return y")],
        g.test_column_parallel_linear, r"gather_output=True: output \(all features\)"),
    "ex05.B.row": (
        [(ROW, "    return g(F.linear(x, weight, bias), group)")],
        g.test_row_parallel_linear, r"seen: the output holds the bias 4 times"),
    "ex05.B.once": (
        [(ROW, ROW.replace("group)\n", "group)\n    g(y.detach() / size_and_rank(group)[0], group)\n"))],
        g.test_mlp_needs_one_all_reduce_each_way, r"bytes sent by each communication"),
    "ex05.B.load": (
        [("v.chunk(t, 0)[r] for k, v in linear", "v.chunk(t, 0)[0] for k, v in linear")],
        g.test_layers_shard_the_single_device_layer, r"ColumnParallelLinear\.from_linear\(nn\.Linear\(6, 4\)\)'s weight"),
    "ex05.B.nobias": (
        [(ROW_LOAD, "        with torch.no_grad():\n            m.weight.copy_(linear.weight.chunk(t, 1)[r])\n"
                    "            m.bias.copy_(linear.bias)")],
        g.test_layers_shard_the_single_device_layer, r"RowParallelLinear\.from_linear\(nn\.Linear\(6, 4, bias=False\)\): "
                                                     r"the call raised"),
    "ex05.C.exact": (
        [("        owned = (y >= start) & (y < start + v_local)", "        owned = (y < v_local) & (r == 0)")],
        g.test_vocab_parallel_cross_entropy, r"loss \(F\.cross_entropy on the full logits, scale 1\)"),
    "ex05.C.finite": (
        [("        z = z - m.unsqueeze(1)", "        z = z - 0 * m.unsqueeze(1)")],
        g.test_vocab_parallel_cross_entropy_large_logits, r"seen: the loss is not finite"),
    "ex05.C.bytes": (
        [("        local_max = z.max(dim=-1).values.contiguous()\n",
          "        local_max = z.max(dim=-1).values.contiguous()\n        whole = torch.empty(t * z.numel())\n"
          "        comm.all_gather(whole, z.reshape(-1).contiguous(), group=group)\n")],
        g.test_vocab_parallel_cross_entropy_never_gathers_logits, r"bytes in forward; expected more than 0 and under"),
    "ex05.C.backward": (
        [("        ctx.shape, ctx.dtype = logits.shape, logits.dtype",
          "        ctx.shape, ctx.dtype, ctx.group = logits.shape, logits.dtype, group"),
         ("        softmax, local_y, owned = ctx.saved_tensors\n",
          "        softmax, local_y, owned = ctx.saved_tensors\n        comm.all_reduce(torch.zeros(1), group=ctx.group)\n")],
        g.test_vocab_parallel_cross_entropy_never_gathers_logits, r"bytes sent in the cross-entropy's backward"),
    "ex05.C.fp32": (
        [("        z = logits.reshape(-1, logits.shape[-1]).float()", "        z = logits.reshape(-1, logits.shape[-1])")],
        g.test_vocab_parallel_cross_entropy_on_subgroups, r"torch\.bfloat16 logits: loss \(F\.cross_entropy on the "
                                                           r"group's full logits, in fp32\)"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex05", g, PLANTS, elsewhere={"ex05.*.recorded"})  # planted in tests/test_planted_wrong_answers.py


# more wrong answers a blind learner's grade accepted before: each fails the test of its clause
MORE = {  # name -> (clause, edits, graded test, what the message must name)
    "ce backward ignores the upstream gradient": (
        "ex05.C.exact", [("        g *= grad / g.shape[0]", "        g /= g.shape[0]")],
        g.test_vocab_parallel_cross_entropy, r"seen: the gradient is the one for an upstream gradient of 1"),
    "split by global rank": (
        "ex05.*.group", [("    return x.chunk(n, dim)[r].contiguous()",
                          "    return x.chunk(n, dim)[torch.distributed.get_rank() % n].contiguous()")],
        g.test_gather_and_split, r"rank \d \(rank \d of group \[\d, \d\]\): (split along dim 1 \(block \d of 2\)|"
                                 r"the gradient of gather's input)"),
    "a shard that is a view of the given layer's weight": (
        "ex05.B.load", [("        m.load_state_dict({k: v.chunk(t, 0)[r] for k, v in linear.state_dict().items()})",
                         "        for k, v in linear.named_parameters():\n"
                         "            setattr(m, k, torch.nn.Parameter(v.detach().chunk(t, 0)[r]))")],
        g.test_layers_shard_the_single_device_layer,
        r"ColumnParallelLinear\.from_linear\(nn\.Linear\(6, 4\)\): the module's parameters whose storage is the given "
        r"layer's .*\n(.*\n)*  breaks ex05\.B\.load"),
}


@pytest.mark.parametrize("name", list(MORE))
def test_more_planted_answers_fail(name, tmp_path):
    from minipar.course.grading import observed
    clause, edits, test, match = MORE[name]
    assert test.__name__ in observed(g).get(clause, ()), (clause, test.__name__)
    with planted("ex05", tmp_path, *edits):
        fails(test, match=match)
