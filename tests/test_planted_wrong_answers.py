"""Wrong answers that once scored 100%: each, planted as the learner's file (the solution with a
line or two changed), now fails a graded test whose message names the clause it breaks. Every
case observes its clause directly: the group a collective ran on, the units gathered at the
peak, the bytes and messages of the ring, validity on every (p, m), the recorder's bytes."""
import types

import pytest

from minipar.course import challenge
from minipar.course.grading import GradeFailure
from minipar.course.graded import test_ch04_schedule as ch04
from minipar.course.graded import test_ex02_data_parallel as ex02
from minipar.course.graded import test_ex03_model_parallel as ex03
from minipar.course.graded import test_ex05_tensor_parallel as ex05
from minipar.course.graded import test_ex06_zero as ex06
from minipar.course.graded import test_ex08_context_parallel as ex08
from minipar.course.graded import test_ex09_expert_parallel as ex09
from planted import fails, planted

PLANTS = {
    # the reducer's own all-reduce on the world instead of its group
    "ex02 C: the reducer's all-reduce on the world group": (
        "ex02", [('op="avg", group=self.group, async_op=True', 'op="avg", group=None, async_op=True')],
        ex02.test_reducer_on_a_sub_group,
        r"C: Reducer, overlap=True, step 0, rank 0 .*: the group labels of the recorded gradient all-reduces "
        r"\(any group"),
    # pre_backward never tells the reduction that the backward reached unit i
    "ex06 D: pre_backward without reduction.reached(i)": (
        "ex06", [("        if self.reshard:\n            self.reduction.reached(i)\n", "")],
        ex06.test_schedule_on_the_real_storage,
        r"rank 0, prefetch=True, unit 3 holding a parameter without a gradient: the units whose shard holds its "
        r"reduced gradient when unit 0's backward starts (.*\n)*  breaks ex06\.D\.reduce"),
    # the forward sends its K/V block at every step: c sends instead of c - 1
    "ex08 C: the forward sends K/V at every step": (
        "ex08", [("        if s < c - 1:   # send the block in hand on", "        if True:   # send the block in hand on"),
                 ("        kv = nxt_kv() if s < c - 1 else kv\n    return o, lse", "        kv = nxt_kv()\n    return o, lse")],
        lambda target: ex08.test_ring_attention_with_your_code(target, 2),
        r"cp = 2, rank 0, the ring attention's forward: bytes sent, as recorded \(cost.cp_comm_bytes\('ring', ...\)"
        r"\['forward'\]: the forward sends its K/V block to the next rank c - 1 times"),
    # flush drops the sends it should wait on: the step's last sends never complete (a hang, once)
    "ex03 B: flush forgets the pending sends without waiting": (
        "ex03", [("        for h in self.pending:\n            h.wait()\n        self.pending = []", "        self.pending = []")],
        ex03.test_sends_complete_each_step,
        # a hang ended by the launch's bound, or the step's bytes missing from the record: which one
        # depends on whether Gloo had delivered the unwaited sends; both name the clause
        r"(did not end within \d+ s |recorded bytes sent).*every send is waited on, and recorded, by the end of the step"),
    # reduce_shard's reduce-scatter on the world while its sizes come from the group
    "ex06 A: reduce_shard's collective on the world group": (
        "ex06", [('    reduce_scatter(mine, flat_grad, op="avg", group=group, **labels)',
                  '    reduce_scatter(mine, flat_grad, op="avg", group=None, **labels)')],
        ex06.test_reduce_shard,
        r"rank \d \(rank \d of group \[\d, \d\]\), group of 2 \(ex06\.\*\.group\): the call raised"),
    # the bf16 master copy taken from the bf16-rounded parameters, not the fp32 ones
    "ex06 B: the master copy from the bf16 parameters": (
        "ex06", [("            shard = u.shard_of(master).clone() if self.mixed else u.shard_of(flat)",
                  "            shard = u.shard_of(flat).float() if self.mixed else u.shard_of(flat)")],
        ex06.test_zero_optimizer, r"ex06\.B\.views"),
    # the fp32 shard a copy of the flat parameters' slice, not a view of it
    "ex06 B: the fp32 shard a clone": (
        "ex06", [("            shard = u.shard_of(master).clone() if self.mixed else u.shard_of(flat)",
                  "            shard = u.shard_of(master).clone() if self.mixed else u.shard_of(flat).clone()")],
        ex06.test_zero_optimizer, r"ex06\.B\.views"),
    # FlatStorage.reduce reduce-scatters in fp32 whatever self.dtype
    "ex06 C: the storage's reduce-scatter in fp32": (
        "ex06", [("dtype=self.dtype, unit=i).to(torch.float32)", "dtype=torch.float32, unit=i)")],
        ex06.test_flat_storage, r"ex06\.C\.reduce"),
    # gather_unit drops the labels its all-gather should carry
    "ex06 C: gather_unit's all-gather without the labels": (
        "ex06", [("group=group, async_op=async_op, **labels)", "group=group, async_op=async_op)")],
        ex06.test_gather_and_free, r"ex06\.C\.async"),
    # gather_unit all-gathers twice
    "ex06 C: gather_unit's all-gather run twice": (
        "ex06", [("    return all_gather(full, shard.detach().to(full.dtype), group=group, async_op=async_op, **labels)",
                  "    all_gather(full, shard.detach().to(full.dtype), group=group)\n"
                  "    return all_gather(full, shard.detach().to(full.dtype), group=group, async_op=async_op, **labels)")],
        ex06.test_gather_and_free, r"ex06\.C\.gather"),
    # the cross-entropy's stabiliser: the mean of the ranks' maxima instead of their maximum
    "ex05 C: the stabiliser is the mean of the ranks' maxima": (
        "ex05", [("m = maxima.view(t, n).max(dim=0).values", "m = maxima.view(t, n).mean(dim=0)")],
        ex05.test_vocab_parallel_cross_entropy_large_logits,
        r"(?s)rank 0: loss \(F.cross_entropy on the full logits, scale 1, rank 0's logits near 300 and rank 1's "
        r"near 0\) \(finite even when logits reach hundreds\).*seen: the loss is not finite"),
    # f's all-reduce recorded under _sum's default name, not the one f is given
    "ex05 A: f's all-reduce recorded under another name": (
        "ex05", [("        return _sum(grad, ctx.group, ctx.name), None, None", "        return _sum(grad, ctx.group), None, None")],
        ex05.test_f_identity_forward_all_reduce_backward,
        r"rank 0: the name f's backward collective is recorded under: .*expected 'f.all_reduce', got 'all_reduce'"),
    # gather_along through torch.distributed: nothing recorded
    "ex05 A: gather_along calls torch.distributed directly": (
        "ex05", [("comm.all_gather(out, xt.reshape(-1), group=group, name=name)",
                  "torch.distributed.all_gather_into_tensor(out, xt.reshape(-1), group=group)")],
        ex05.test_gather_and_split,
        r"(?s)rank 0 .*: bytes the three gathers sent, as recorded .*expected 144, got 0.*seen: nothing was "
        r"recorded: .*\(the clause 'recorded'\)"),
    # exchange_counts and all_to_all through torch.distributed: nothing recorded
    "ex09 A: exchange_counts calls torch.distributed directly": (
        "ex09", [('comm.all_gather(out, counts.contiguous(), group=group, name="ep_counts", dim="ep")',
                  "torch.distributed.all_gather_into_tensor(out, counts.contiguous(), group=group)")],
        ex09.test_exchanges_on_ranks,
        r"(?s)rank 0: bytes exchange_counts sent, as recorded .*expected 192, got 0.*seen: nothing was recorded: "
        r".*\(the clause 'recorded'\)"),
    "ex09 C: all_to_all calls torch.distributed directly": (
        "ex09", [("comm.all_to_all_single(out, x.contiguous(), recv, send, group=group, name=name, **labels)",
                  "torch.distributed.all_to_all_single(out, x.contiguous(), recv, send, group=group)")],
        ex09.test_exchanges_on_ranks,
        r"(?s)float64, the world of 4 ranks: rank 0: bytes all_to_all sent forward, as recorded .*got 0.*seen: "
        r"nothing was recorded: .*\(the clause 'recorded'\)"),
    # the naive step never waits on its activation send: that send is never recorded
    "ex03 A: the step never waits on its activation send": (
        "ex03", [("        if send is not None:\n            send.wait()\n", "")],
        ex03.test_drives_model_parallel,
        r"(?s)the LSTM split over 2 ranks, rank 0: bytes sent in the last step, as recorded .*every transfer is waited "
        r"on before the step ends, so the trace records its bytes\): expected 32768, got 0"),
    # recv_grad ignores its dtype: named, where it used to end in a rank's abort (exit code -6)
    "ex03 A: recv_grad ignores its dtype": (
        "ex03", [("    g = torch.empty(shape, dtype=dtype, device=device)", "    g = torch.empty(shape, device=device)")],
        ex03.test_activation_values,
        r"rank 0: the dtype of recv_grad\(..., dtype=torch.bfloat16\) \(in the ``dtype`` asked\)"),
    # under ZB-H1 the stash is held until W: the message says so (not "until its B")
    "ex03 C: W never drops its stash (ZB-H1)": (
        "ex03", [("            self.stash.pop((a.microbatch, a.stage)).apply()",
                  "            self.stash[a.microbatch, a.stage].apply()")],
        ex03.test_compute_actions,
        r"ZB-H1, m=4: peak_stash after the step, the schedule's \(what a micro-batch's backward needs is stashed "
        r"from its F until its W \(the backward is split\), and no longer\)"),
}


def _challenge(name, *edits):
    """The challenge's solution with ``edits`` applied, as the ``challenge`` fixture gives it."""
    text = (challenge.directory("solution") / f"{name}.py").read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    space = {}
    exec(compile(text, f"{name}.py", "exec"), space)
    return types.SimpleNamespace(__name__=name, **{k: v for k, v in space.items() if not k.startswith("__")})


CHALLENGE_PLANTS = {
    # the list scheduler letting a rank start one forward past the cap: 5 held, smaller bubble
    "ch04: a list scheduler one forward past the cap": (
        "ch04_schedule", [("ready_f = i < m and held[r] < CAP", "ready_f = i < m and held[r] <= CAP"),
                          ("if held[r] >= CAP and pending_w[r]:", "if held[r] > CAP and pending_w[r]:")],
        ch04.test_memory_goal, r"memory: p = \d, m = \d+: rank \d holds 5 micro-batches at once"),
}


@pytest.mark.parametrize("case", list(CHALLENGE_PLANTS))
def test_wrong_challenge_answer_fails_naming_its_goal(case):
    name, edits, test, match = CHALLENGE_PLANTS[case]
    planted_module = _challenge(name, *edits)
    for other in (ch04.test_is_a_valid_schedule, ch04.test_memory_goal, ch04.test_bubble_goal):
        if other is not test:          # it misses one goal only
            other(planted_module)
    with pytest.raises(GradeFailure, match=match):
        test(planted_module)


@pytest.mark.parametrize("case", list(PLANTS))
def test_wrong_answer_fails_naming_its_clause(case, tmp_path):
    exercise, edits, test, match = PLANTS[case]
    with planted(exercise, tmp_path, *edits):
        fails(test, match=match)
