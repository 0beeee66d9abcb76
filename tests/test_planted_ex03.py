"""ex03's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it.
Two plants crash a rank rather than give wrong numbers (a middle rank that takes the loss, a
float64 model's activations received as float32): the failure names the case and its clause,
then that rank's error at its line in the learner's file."""

from minipar.course.graded import test_ex03_model_parallel as g
from tests.planted import contract_tests, fails, more_tests, planted

SEND = '    return isend(y.detach(), dst, group, name="send_activation", tag=tag, **labels)'
RECV = '    irecv(x, src, group, name="recv_activation", tag=tag, **labels).wait()'
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex03.A.async": (
        [(SEND, SEND.replace("    return isend", "    isend") + ".wait()")],
        g.test_activation_values, r"return its ``Handle`` without waiting"),
    "ex03.A.leaf": (
        [("    return x.requires_grad_()", "    return x")], g.test_activation_values, r"a leaf that requires grad"),
    "ex03.A.dtype": (
        [("    x = torch.empty(shape, dtype=dtype, device=device)", "    x = torch.empty(shape, device=device)")],
        g.test_activation_values, r"in the ``dtype`` asked"),
    "ex03.A.grad": (
        [('    irecv(g, src, group, name="recv_grad", tag=tag, **labels).wait()\n    return g',
          '    irecv(g, src, group, name="recv_grad", tag=tag, **labels).wait()\n    return g.zero_()')],
        g.test_gradient_flows_back, r"(?s)the gradient sent back is ∂L/∂\(the stage's input\).*seen: rank 0's"),
    "ex03.*.recorded": (
        [('    return isend(grad.detach(), dst, group, name="send_grad", tag=tag, **labels)',
          '    return torch.distributed.isend(grad.detach(), dst, group=group, tag=tag)')],
        g.test_transfers_are_recorded, r"every transfer goes through ``minipar.comm``"),
    "ex03.*.group": (
        [(SEND, SEND.replace("dst, group,", "dst, None,")), (RECV, RECV.replace("src, group,", "src, None,"))],
        g.test_transfers_are_recorded, r"over ``group``, with ``src``/``dst`` its ranks"),
    "ex03.A.stages": (
        [("            out = self.loss_fn(out, y) if r == n - 1 else", "            out = self.loss_fn(out, y) if r == 1 else")],
        g.test_drives_model_parallel, r"the GPT split over 3 ranks, rank 1 in the middle \(any number of stages, "
                                      r"one per rank\): rank 1: .*ex03_model_parallel\.py:\d+ .*IndexError: Target "
                                      r"\d+ is out of bounds"),
    "ex03.A.train": (
        [("            torch.autograd.backward(out, grad)",
          "            torch.autograd.backward(out, None if grad is None else grad / n)")],
        g.test_drives_model_parallel, r"the LSTM split over 2 ranks \(training equals one process\)"),
    "ex03.B.match": (
        [("        tag = 2 * (sender * self.m + a.microbatch) + (not forward)", "        tag = 2 * sender + (not forward)"),
         ("tag=2 * (sender * self.m + a.microbatch) + (not forward)", "tag=2 * sender + (not forward)")],
        g.test_messages_match_in_any_order, r"a receive gets the message of its own kind, micro-batch"),
    "ex03.B.dtype": (
        [("        self.dtype, self.device, self.pending = dtype, device, []",
          "        self.dtype, self.device, self.pending = torch.float32, device, []")],
        g.test_messages_match_in_any_order, r"\(every message travels in the dtype of the stages' parameters; "
                                            r".*\): rank \d: .*ex03_model_parallel\.py:\d+ .*RuntimeError: mixed dtype"),
    "ex03.B.flush": (
        [("        for h in self.pending:\n            h.wait()\n        self.pending = []",
          "        for h in self.pending:\n            [w.wait() for w in h.works if w is not None]\n"
          "        self.pending = []")],
        g.test_sends_complete_each_step, r"every send is waited on, and recorded, by the end of the step"),
    "ex03.C.mean": (
        [("out = self.loss_fn(out, self.ys[i]) / self.schedule.m", "out = self.loss_fn(out, self.ys[i])")],
        g.test_compute_actions, r"rank 1 \(the last stage\), 1F1B, m=4: the step's loss \(the mean of its micro-batches"),
    "ex03.C.backward": (
        [('                self.outbox["B", i, s] = x.grad', '                self.outbox["B", i, s] = torch.zeros_like(x.grad)')],
        g.test_compute_actions, r"rank 0, 1F1B, m=4, stage 0's weight: gradient after the step \(through the ∂L/∂\(input\)"),
    "ex03.C.stash": (
        [("            x, out, dw = self.stash.pop((i, s))", "            x, out, dw = self.stash[i, s]")],
        g.test_compute_actions, r"1F1B, m=4: peak_stash after the step, the schedule's"),
    "ex03.C.split": (   # right numbers with the schedule as it is; the weight gradients all come in B
        [("            dw = WeightGrads() if self.split_backward else None", "            dw = None"),
         ("            self.stash.pop((a.microbatch, a.stage)).apply()",
          "            self.stash.pop((a.microbatch, a.stage), None)")],
        g.test_compute_actions, r"ZB-H1 without micro-batch 1's W, stage 0's weight: gradient after the step "
                                r"\(the other micro-batches' only"),
    "ex03.A.precision": (
        [("with strategy.forward(self.dtype, inp,", "with strategy.forward(None, inp,")],
        g.test_naive_step_on_a_group_and_in_bfloat16, r"one step of an MLP over 3 ranks in bfloat16, against one "
                                                      r"process under the same autocast, step 0: loss"),
    "ex03.C.dtype": (
        [("with strategy.forward(self.compute_dtype, ", "with strategy.forward(None, ")],
        g.test_compute_actions, r"bfloat16: the dtype of the stage's output \(the forward computes in ``compute_dtype``\)"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex03", g, PLANTS)

STEP = "r, n, g, c = self.rank, self.n, self.group, self.comm"
PEND = "        self.pending.append(fn(tensor.detach().to(self.dtype), a.peer, self.group, microbatch=a.microbatch,"
MORE = [  # further wrong answers: (clause, edits, graded test, what the message must name)
    # the naive step on the world
    ("ex03.*.group", [(STEP, STEP.replace("self.group", "None"))],
     g.test_naive_step_on_a_group_and_in_bfloat16, r"(?s)the GPT over ranks 1 and 2 of 3 .*sends to group rank 1: "
                                                   r"itself.*breaks ex03\.\*\.group"),
    # bfloat16 sent as it is
    ("ex03.A.precision", [("else out.to(self.wire)", "else out")],
     g.test_naive_step_on_a_group_and_in_bfloat16, r"MLP over 3 ranks in bfloat16.*\n(.*\n)*  breaks ex03\.A\.precision"),
    # a tensor returned
    ("ex03.A.stages", [("return out.item() if r == n - 1 else None", "return out.detach() if r == n - 1 else None")],
     g.test_naive_step_on_a_group_and_in_bfloat16, r"as a Python float, None elsewhere\): rank 2: expected 'float', "
                                                   r"got 'Tensor'"),
    # the labels dropped
    ("ex03.*.group", [(SEND, SEND.replace(", **labels)", ")"))],
     g.test_transfers_are_recorded, r"the stage label of the recorded transfers.*\(``\*\*labels`` passed through\)"),
    # one more send, never waited on
    ("ex03.*.recorded", [(PEND, "        fn(tensor.detach().to(self.dtype), a.peer, self.group, tag=10**6)\n" + PEND)],
     g.test_sends_complete_each_step, r"transfers started and never waited on after 2 steps.*\n(.*\n)*"
                                      r"  breaks ex03\.\*\.recorded"),
    # ZB-H1: everything kept until W
    ("ex03.C.stash", [("self.stash[i, s] = dw          #", "self.stash[i, s] = (x, out, dw)          #"),
      ("self.stash.pop((a.microbatch, a.stage)).apply()", "self.stash.pop((a.microbatch, a.stage))[2].apply()")],
     g.test_compute_actions, r"ZB-H1, m=4: the elements of the tensors a micro-batch's stash still holds right after "
                             r"its B.*\n(.*\n)*  breaks ex03\.C\.stash"),
]


test_more_wrong_answers_fail = more_tests("ex03", g, MORE)


def test_a_blocking_send_hangs_naming_match_and_flush(tmp_path, monkeypatch):
    """A Mailbox that waits on each send as it posts it: rank 0's first send waits on a receive rank 1
    posts only after its own forward of the other micro-batch, so the ranks hang; the failure names the
    two clauses a hang there can break (under a short launch bound)."""
    monkeypatch.setattr(g, "TIMEOUT", 20)
    with planted("ex03", tmp_path, ("stage=a.stage, tag=tag))", "stage=a.stage, tag=tag))\n        self.pending[-1].wait()")):
        fails(g.test_messages_match_in_any_order, match=r"the ranks hung; a receive waits for ever .*\n(.*\n)*"
              r"  breaks ex03\.B\.match, ex03\.B\.flush")
