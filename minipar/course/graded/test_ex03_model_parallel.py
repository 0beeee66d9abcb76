"""Exercise 03: the stage boundary: activations forward, gradients back, across ranks.

Autograd's graph ends where a process ends. Split a model by layers over ranks and the chain
rule ∂L/∂x = ∂L/∂y · ∂y/∂x must be carried across the cut by hand (Huang et al. 2019;
Narayanan et al. 2019; notebook 03, "Autograd across ranks"). You write both sides of that
boundary, then the two users of it.

A. The stage communication (``send_activation``, ``recv_activation``, ``send_grad``,
   ``recv_grad`` in ``minipar.model_parallel.stage_comm``) and the naive model-parallel step
   that runs on it (``NaiveModelParallel.step(x, y)``).
B. The pipeline's ``Mailbox`` (``minipar.pipeline.executor``): how messages find their
   receive, whatever order a schedule posts them in.
C. The pipeline's compute actions, ``Pipeline.F(a)``, ``.B(a)`` and ``.W(a)`` (same module):
   what each keeps, passes on and frees is yours to design.

Each function's docstring below is its contract: clauses ``ex03.P.word`` that must hold (the
grader names the clause a failure breaks). Graded on 2 and 3 ranks: the values, dtypes and
gradients that arrive, the recorded bytes, their group and labels, an LSTM and a GPT split over
ranks (once over 2 of 3 ranks), an MLP in bfloat16, pipelined GPTs (a schedule whose second rank takes the micro-batches in the other
order, in float64, and 1F1B) trained on your code, equal to one process, and one step of a
two-stage network under 1F1B, ZB-H1 (once with a W left out) and bfloat16. Grade it with
``python -m minipar.grade ex03``; stuck? ``minipar.hint("ex03", "A")`` (parts A, B, C).
"""
import time

import torch
import torch.distributed as dist

import minipar
from minipar import comm, data, reference
from minipar.runtime import flight, trace
from minipar import model_parallel as mpar
from minipar import pipeline as pp
from minipar import strategy
from minipar.model_parallel import stage_comm
from minipar.pipeline.executor import Pipeline
from minipar.model_parallel.partition import boundary_shapes, owned_parameters
from minipar.pipeline.schedules import Action, Schedule, add_comms, make_schedule
from minipar.course import grading
from minipar.course.grading import (GradeFailure, breaks, diagnose, expect, expect_close, expect_equal, expect_recorded,
                                    expect_same_training, hang_breaks, launched, observes)
from minipar.models import GPT, LSTMLM, MLP, GPTConfig
from minipar.runtime.launch import LaunchTimeout

EXERCISE = "ex03_model_parallel"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNpdjrEOgzAMRH/lti6o/QTE3r1zSFwSQWNkJ1DWTv3OfkkDlKWLT747PbvJiTsx7qQoMnpQdAqTk'
        'DxhFLakipZzdEaWM26+RI+sey5kKUwhdtDgqCASRWVBS7ivYmw/G3FIjC5MhIUzPu/X9VLGs/6Dabl8oBA5b'
        'QbMwMWbQ/JbaTJDJq3RlChEaKKxwuyD9RATe/29RIe5Mqq1ua8sjqT+AvIqWQ8=',
        'sealed:eNptkEFOxDAMRa/yd4A0FNhSCYklEjtO4Jm4NGonKbY7o25ZcU5OgpPOdMUmSpz/n/39wSkgp3GB9'
        'YwTjTMrbgMbHXoOdyD/FrZZUhX0/h659dKB44kRk2UQOmHtYZw0C3JXpdrTxNUfbCk3HTjscKZou1o+0uAAc'
        '/vIVDxkzv2ao8PwKeRizdjTYTiTBKjlSQtZVmoXx1HRFGGD1+tEoTojJ0NiDoqUa6VMFU2Rz6nBW3IaT88QS'
        'gMEL3i8+rWqYppm81T5CLl/amuekdRWA4WgaymrtuATy7L+7N21adVXq+iy1PHXRV56/P58vz/4kV1fArZbz'
        'H9xXZSNt413cwl/AZS9lmZY8iyrtvkD3nuqLw==',
        'sealed:eNptUtFugzAM/BWrL4Quy9TXVnzJVFVpcCFaG5hj2vL3c0JFBdoDIQ6XO9+ZiKE+Wcf+btl3YQ+EP'
        'FAAH+WDGk2NbF2rSg11ZA0NdUOvIdgbVkVc3i00sG0qeTRst1d7xmssjRC6+0LhCRVwR641eOt5VLG1PQo/j'
        'z1WeZUC795JlV/lAXxiUU8NkdyqixX//108rGclPC93T0P4OwhpPDVk65OSPrObVMHX1HPa74FbhChC8PDcZ'
        'skIxYwtBFzMaNFOqG5gWPALOWO/Bx968f6EjtapTCHEb/rcHTXIKibFrLjAiqTvRFlNtRKWEoZQI8kBWcZmN'
        'JeOHpZq9YpPIBo2r8ONBmNMCSpZkQsORb0RUbChBjtw52xkGUmDgiAZ9bWL8XQJSlQ1jCUINN29CuyQc0q9L'
        'Ic/YeljN4kdICdZvZOcHR4XsOlHSE3koM7W/WQjmS4dlYf3ZJJ1kzaviBLFPNqEWs9ZWIxnvKmFByAbfswfs'
        'v0FPQ==',
    ),
    'B': (
        'sealed:eNo1zUEKwzAMRNGrzDm6ySUKXQtnHJvEVpBMTG9fYej6j57eU9HoLgcdSTqSqTtGIVwacUs1aIZJP'
        'x0yoD3xhVlqKrEyElnSiAteV0T+NWTTBj60LzQ4WzGkRQ/eGz5FcXad612LvpoxsT61H/C6c/sBZqc6Hg==',
        'sealed:eNo9UMFOxTAM+xXfALE3iSs3xJGvyLpsjbY1U5Mxvb8nrwOkqgfbsZ18wGlG0m0/nEdMVTc8L1LGD'
        'pukqreBPOUOxmWUMsNCzi8dPDOMNsZ0lOSiBfEG9QyTke29CSonlm+uWIqeds2ETwBilxPs9oZJK+jxn1Qj1'
        '17/oIHS8sB6fJI5zkyOux7NBK7NcKcaNZyrPWH0+86gIH+TIaXJYq5xPb6Y9/8iyKFd2bp2gDVcGjVJEctxD'
        'S1sIGuZs3bN+STxVu9aMGpJwbQelvsfCoZ1MA==',
        'sealed:eNp1UctOwzAQ/JVRT44aLJVjq1wK7ZEDSFwQipZkG1tNYsveNuLLeu+X4aSFIiEu+5x9zK5QgwL35'
        '5OK3NcczqcOc9gsCbW3fY2iwGw9y3JYiGF0tgru7oOkMhpjyRI7G6JgICugVFAH5yeoT1nbNzAp2nLEYFxkD'
        'C7sIygwqG1hY1m5zrcsXKtsNdb12PVppRTu9DigpErskcS6lHEBL5unx3ILblOzG6gJVK++R2ryo6V2vRLuo'
        'wu6ZqHKqEyLU7V8ek6ESHvmkKMJ7uDzC7OJWEH65uSIQg2n2KRzJFmM9JLGYMXgcjhcAVmmEbg6LhEN+cSyk'
        'nKy1BWAOyyyicnz5uG13OZ/Ib/S6+km/w0be8Hd3DkWGrv2EM3y8pCxT7pz/vOMAm/v+gvNNqr1',
    ),
    'C': (
        'sealed:eNpVjj1uwzAMha/yti7x0DWLUQMpeoMA3WiRiYXYYiDSEHL7MsqSbsTj935OlBZsOVUdZvK4s4FgG'
        '60rXoJekN2grRzRFnJsu3mXVjXDLLBEqzDmB0zhT8QXwRb+dGtUORKZsd/h2j8998NwrcRZio+YxJtIiea3K'
        'UF8gwr3rgka1gpKnrUY6v5vzoRLLnzoeAtORnzFuRcOz+80/HweQlfcRO728p1RRNjGP565WSI=',
        'sealed:eNptkcFugzAMhl/lvxWkiO3c3nroHqGHaZrSxkDULEFxEOXtZwPtpGo34tj5P3+c9ig9wcdhLPCMO'
        '3/6L6QILrYjvBtQYNp6Lum+Y1S7087AG3B9QB7jcrm2j9FRhh1LulouqGx0W81RSzmTq9xUY/Klh0WbiXucy'
        'Xd9+cjWMaaetueuPbkxyMcQfOGldrHX22Szk1Q9Bk1YY8uYI0P70liWRWJJCIn5u42V1Axm3avGG36gUNY5H'
        'TDCVaxmGcgEU2gbHTvow8JWLV7M9qx0C/y6T7Xtr2lK8wx+nMSVtAZihRexnl+oGxz3GNLw0Me9MNjbq+vjw'
        'zV8K+izeXoQf+lHlkC1yBb+PxAZdWUeqDZPwmUVqTedqP4fdKGUX66GVgFugu2sNLcp49zgvCJrWS0OQ5iFo'
        'PkFHuXHbg==',
        'sealed:eNptkkFvwjAMhf+KbyRalXEu2w4c2G1XDgihkBgaLTRV4q7l389J6UDbbo38/Pz8uZsaXAUJXkGri'
        'zMxHDWZpuJXIn3GFYxcGtPO7cGdsu4VloA+Ibj2GEbVhU6IxWZRFRspV2AH7tiiOzf0HrVNQpZO06DtParUe'
        'UeHozafg452svoILU8aHDWQKGrC81WdQswCYcKl6wkPlq4dVmDxyxmEEGFhun4hKxAWTxgjWmGHMooDuARto'
        'OI7TWh7701oCUcSUtYQeuKUZcW0S3sxcvB5P68TzQofUjqcWsGvCq4Zg4RnuKxK4VaHpyxWFkmbRkhlQ3/0y'
        'B/ZPzW7DGbPWjFWUHw4523ay30Yw9z9cMzy7AnrGu5dU+LUTNBn3meGzJXHc6znc1QFAYsoRNMo3VPIcjXjn'
        '/YqmDhPcWJ0d2xFTEGU/fIB5Jz8DZb32OuH2KPKTau/h6h/4bCDgm39uNG/f6CUSnedvzLPb5dJ3OU=',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT
TOKENS = data.synthetic_tokens(1000)
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _group():
    """The 2-rank world as a named group: its transfers are labelled "pp" (the world's: "world")."""
    g = dist.new_group([0, 1])
    comm.name_group(g, "pp")
    return g


def _boundary():
    """Rank 0 sends an fp32 and a bfloat16 activation; rank 1 receives them, runs the second of
    two linear layers and sends the gradient back, and a bfloat16 gradient; each returns what it
    saw and its events. Every call is given the label ``stage`` (its rank)."""
    g, r = _group(), dist.get_rank()
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)
    x = torch.randn(6, 4)
    trace.start(r)
    if r == 0:
        y = l1(x)
        h = stage_comm.send_activation(y, 1, g, tag=1, stage=0)
        out = {"has_wait": hasattr(h, "wait")}
        if out["has_wait"]:
            h.wait()
        h = stage_comm.send_activation(torch.arange(6.0).reshape(2, 3).to(torch.bfloat16), 1, g, tag=3, stage=0)
        if out["has_wait"]:
            h.wait()
        grad = stage_comm.recv_grad((6, 5), 1, g, tag=2, stage=0)
        half = stage_comm.recv_grad((2, 3), 1, g, dtype=torch.bfloat16, tag=4, stage=0)
        y.backward(grad)
        return out | {"weight_grad": l1.weight.grad, "events": trace.events(), "half_grad": half.float(),
                      "half_grad_dtype": str(half.dtype)}
    h = stage_comm.recv_activation((6, 5), 0, g, tag=1, stage=1)
    half = stage_comm.recv_activation((2, 3), 0, g, dtype=torch.bfloat16, tag=3, stage=1)
    seen = {"values": h.detach().clone(), "leaf": h.is_leaf, "requires_grad": h.requires_grad,
            "half": half.detach().float(), "half_dtype": str(half.dtype)}
    l2(h).pow(2).sum().backward()
    stage_comm.send_grad(torch.zeros(6, 5) if h.grad is None else h.grad, 0, g, tag=2, stage=1).wait()
    stage_comm.send_grad(torch.arange(6.0).reshape(2, 3).to(torch.bfloat16), 0, g, tag=4, stage=1).wait()
    return seen | {"weight_grad": l2.weight.grad, "events": trace.events()}


def _single_process():
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)
    y = l1(torch.randn(6, 4))
    l2(y).pow(2).sum().backward()
    return y.detach(), l1.weight.grad, l2.weight.grad


@observes("ex03.A.async", "ex03.A.leaf", "ex03.A.dtype", "ex03.*.group")   # a hang: a send's group or a wait
def test_activation_values(impl):
    """What arrives: the values sent, in the dtype asked, ready for the receiving stage's backward
    (activations and gradients); a send returns its Handle."""
    sender, got = minipar.launch(_boundary, 2, timeout=TIMEOUT)
    y, _, _ = _single_process()
    with breaks("ex03.A.async"):
        expect(sender["has_wait"], "rank 0: send_activation returned an object without .wait(), "
                                   "expected its Handle (return its ``Handle`` without waiting)")
    with breaks("ex03.A.leaf"):
        expect_close(got["values"], y, "the received activation (what rank 0 sent)", where="rank 1")
        expect_equal({"is_leaf": got["leaf"], "requires_grad": got["requires_grad"]},
                     {"is_leaf": True, "requires_grad": True},
                     "rank 1: the received activation's autograd flags (a leaf that requires grad)")
    with breaks("ex03.A.dtype"):
        expect_equal(got["half_dtype"], "torch.bfloat16",
                     "rank 1: the dtype of recv_activation(..., dtype=torch.bfloat16) (in the ``dtype`` asked)")
        expect_close(got["half"], torch.arange(6.0).reshape(2, 3), "the received bfloat16 activation", where="rank 1")
        expect_equal(sender["half_grad_dtype"], "torch.bfloat16",
                     "rank 0: the dtype of recv_grad(..., dtype=torch.bfloat16) (in the ``dtype`` asked)")
        expect_close(sender["half_grad"], torch.arange(6.0).reshape(2, 3), "the received bfloat16 gradient", where="rank 0")


@observes("ex03.A.grad")
def test_gradient_flows_back(impl):
    """A two-rank split computes the same weight gradients as one process."""
    r0, r1 = minipar.launch(_boundary, 2, timeout=TIMEOUT)
    _, g1, g2 = _single_process()
    expect_close(r1["weight_grad"], g2, "weight gradient of the second layer", where="rank 1")
    with diagnose(lambda f: bool((r0["weight_grad"] == 0).all()), "rank 0's weight gradient is all zeros"):
        expect_close(r0["weight_grad"], g1, "weight gradient of the first layer, through the gradient rank 1 "
                     "sent (the gradient sent back is ∂L/∂(the stage's input))", where="rank 0")


@observes("ex03.*.recorded", "ex03.*.group")
def test_transfers_are_recorded(impl):
    """Every transfer is recorded by minipar.comm, with its bytes and its group ("pp"), in fp32 and in
    bfloat16."""
    r0, r1 = minipar.launch(_boundary, 2, timeout=TIMEOUT)
    ev0, ev1 = r0["events"], r1["events"]
    got = {"rank 0 sent": sum(e["bytes_sent"] for e in ev0), "rank 0 received": sum(e["bytes_recv"] for e in ev0),
           "rank 1 sent": sum(e["bytes_sent"] for e in ev1), "rank 1 received": sum(e["bytes_recv"] for e in ev1)}
    with breaks("ex03.*.recorded"), diagnose(min(got.values()) == 0, "nothing was recorded on a side: a transfer "
                                             "made with torch.distributed directly is not recorded"):
        expect_equal(got, dict.fromkeys(got, 132),
                     "bytes in the trace (a 6x5 fp32 activation and a 2x3 bfloat16 one forward, a 6x5 fp32 "
                     "gradient and a 2x3 bfloat16 one back; every transfer goes through ``minipar.comm``)")
    dims = sorted({str(e["labels"].get("dim")) for e in ev0 + ev1 if e["bytes_sent"] or e["bytes_recv"]})
    with breaks("ex03.*.group"):
        expect_equal(dims, ["pp"], "the group label of the recorded transfers, the group passed being named "
                     "'pp' (over ``group``, with ``src``/``dst`` its ranks)")
        stages = {f"rank {r}": sorted({str(e["labels"].get("stage")) for e in ev if e["bytes_sent"] or e["bytes_recv"]})
                  for r, ev in enumerate((ev0, ev1))}
        expect_equal(stages, {"rank 0": ["0"], "rank 1": ["1"]}, "the stage label of the recorded transfers, each "
                     "call given stage=its rank (``**labels`` passed through)")


BOUNDARY_BYTES = {"lstm": 8 * 16 * 64 * 4, "gpt": 8 * 8 * 16 * 4}   # one (batch, time, width) fp32 tensor


def _model_parallel():
    if dist.get_world_size() == 2:
        return mpar.train(LSTMLM(vocab_size=32, seed=0), data.batches(TOKENS, 3, 8, 16), reference.adamw(1e-2),
                          stages=mpar.lstm_stages)
    return mpar.train(GPT(CFG, seed=0), data.batches(TOKENS, 3, 8, 8), reference.sgd(0.5))


@observes("ex03.A.grad", "ex03.A.stages", "ex03.A.train", "ex03.*.recorded")
def test_drives_model_parallel(impl):
    """Your step trains the LSTM split over 2 ranks and the GPT over 3 (a middle rank) like one
    process, and each rank's sends of the last step are recorded."""
    lstm = "the LSTM split over 2 ranks (training equals one process)"
    with breaks("ex03.A.train"), launched(lstm):
        two = minipar.launch(_model_parallel, 2, timeout=TIMEOUT)
    want = reference.train_reference(LSTMLM(vocab_size=32, seed=0), data.batches(TOKENS, 3, 8, 16),
                                     reference.adamw(1e-2))
    with breaks("ex03.A.train"):
        expect_same_training(strategy.TrainResult.merge(two), want, lstm, rtol=1e-5, atol=1e-6)
    gpt = "the GPT split over 3 ranks, rank 1 in the middle (any number of stages, one per rank)"
    with breaks("ex03.A.stages"), launched(gpt):
        three = minipar.launch(_model_parallel, 3, timeout=TIMEOUT)
    want = reference.train_reference(GPT(CFG, seed=0), data.batches(TOKENS, 3, 8, 8), reference.sgd(0.5))
    with breaks("ex03.A.stages"):
        expect_same_training(strategy.TrainResult.merge(three), want, gpt, rtol=1e-5, atol=1e-6)
    for name, results, message in ((lstm.split(" (")[0], two, BOUNDARY_BYTES["lstm"]),
                                   (gpt.split(" (")[0], three, BOUNDARY_BYTES["gpt"])):
        n = len(results)
        for r, res in enumerate(results):
            with breaks("ex03.*.recorded"):
                expect_recorded(res["measured"]["bytes_by_dim"].get("total", 0), message * ((r < n - 1) + (r > 0)),
                                f"bytes sent in the last step, as recorded (its activation forward unless last, its "
                                f"input's gradient back unless first, {message} bytes each; every transfer is waited "
                                "on before the step ends, so the trace records its bytes)", f"{name}, rank {r}")


def _naive_more():
    """3 ranks: the GPT over ranks 1 and 2 only (a group named "pp" that is not the world), with one
    step's loss and its type; then an MLP over all three in bfloat16, one stage per layer (a stage's
    output is bfloat16 there), one step of SGD."""
    r = dist.get_rank()
    sub = dist.new_group([1, 2])
    comm.name_group(sub, "pp")
    out = {}
    if r > 0:
        model = GPT(CFG, seed=0)
        parts = mpar.balanced_stages(model, 2)
        x, y = data.batches(TOKENS, 1, 8, 8)[0]
        loss = mpar.NaiveModelParallel(parts[r - 1], boundary_shapes(parts, [0, 1, 2], x), sub).step(x, y)
        out["type"] = type(loss).__name__
        out["sub"] = mpar.train(GPT(CFG, seed=0), data.batches(TOKENS, 2, 8, 8), reference.sgd(0.5), group=sub)
    dist.barrier()
    mlp = MLP(MLP_SIZES, seed=0)
    parts = mpar.balanced_stages(mlp, 3)
    x, y = MLP_XY
    opt = reference.sgd(0.5)(list(parts[r].parameters()))
    loss = mpar.NaiveModelParallel(parts[r], boundary_shapes(parts, [0, 1, 2, 3], x), None,
                                   loss_fn=torch.nn.functional.mse_loss, dtype=torch.bfloat16).step(x, y)
    opt.step()
    out["bf16"] = {"losses": [loss] if r == 2 else None,
                   "params": strategy.full_params(owned_parameters(mlp, {r: parts[r]}).items())}
    return out


MLP_SIZES = (16, 32, 32, 4)
MLP_XY = (torch.randn(8, 16, generator=torch.Generator().manual_seed(3)),
          torch.randn(8, 4, generator=torch.Generator().manual_seed(4)))


@observes("ex03.*.group", "ex03.A.stages", "ex03.A.precision")
def test_naive_step_on_a_group_and_in_bfloat16(impl):
    """Your step trains the GPT over ranks 1 and 2 of 3 (its group not the world) like one process,
    returning the last rank's loss as a Python float; then one step of an MLP over 3 ranks in
    bfloat16, like one process under the same autocast."""
    what = "the GPT over ranks 1 and 2 of 3 (one stage per rank of ``group``, the world or not)"
    with breaks("ex03.*.group", "ex03.A.stages", "ex03.A.precision"), launched(what + ", then the MLP in bfloat16"):
        results = minipar.launch(_naive_more, 3, timeout=TIMEOUT)
    want = reference.train_reference(GPT(CFG, seed=0), data.batches(TOKENS, 2, 8, 8), reference.sgd(0.5))
    with breaks("ex03.*.group", "ex03.A.stages"):
        expect_same_training(strategy.TrainResult.merge([r["sub"] for r in results[1:]]), want, what,
                             rtol=1e-5, atol=1e-6)
    with breaks("ex03.A.stages"):
        expect_equal({r: res.get("type") for r, res in enumerate(results) if r}, {1: "NoneType", 2: "float"},
                     "the type step returned, by world rank (the last stage's loss as a Python float, "
                     "None elsewhere)", keys="rank")
    want = reference.train_reference(MLP(MLP_SIZES, seed=0), [MLP_XY], reference.sgd(0.5), dtype=torch.bfloat16)
    with breaks("ex03.A.precision"):    # the same bfloat16 ops on the same values: an fp32 forward is off by 1e-4
        expect_same_training(strategy.TrainResult.merge([r["bf16"] for r in results]), want,
                             "one step of an MLP over 3 ranks in bfloat16, against one process under the same "
                             "autocast", rtol=BF16_TOL, atol=BF16_TOL)


BF16_TOL = 1e-5


def crossed() -> Schedule:
    """GPipe on 2 ranks and 2 micro-batches, rank 1 taking them in the other order: the messages
    arrive in another order than the one they are read in."""
    orders = ([Action(op, i, 0) for op, i in (("F", 0), ("F", 1), ("B", 1), ("B", 0))],
              [Action(op, i, 1) for op, i in (("F", 1), ("F", 0), ("B", 0), ("B", 1))])
    return Schedule("crossed", 2, 2, 1, [add_comms(o, 2, 2) for o in orders])


def _pipelines(which):
    g, t0 = _group(), time.monotonic()
    if which == "crossed":
        return pp.train(GPT(CFG, seed=0).double(), data.batches(TOKENS, 2, 4, 8), reference.sgd(0.5),
                        group=g, schedule=crossed())
    out = pp.train(GPT(CFG, seed=0), data.batches(TOKENS, 2, 8, 8), reference.sgd(0.5), group=g,
                   schedule="1f1b", microbatches=4)
    unwaited = [f"{e['op']} {e['name']}" for e in flight.entries()
                if e["op"] in ("send", "recv") and e["end"] is None and e["start"] >= t0]
    return out | {"unwaited": unwaited}     # transfers started through minipar.comm and never waited on


@observes("ex03.B.match", "ex03.B.dtype", "ex03.B.flush")
def test_messages_match_in_any_order(impl):
    """A float64 GPT on 2 ranks with a schedule whose rank 1 takes the micro-batches in the other
    order trains like one process: the float64 losses to 1e-12, the parameters to 1e-6."""
    where = "float64 GPT, rank 0 sends micro-batches 0, 1 and rank 1 takes 1, 0"
    hung = (f"{where}: the ranks hung; a receive waits for ever for a message not sent under its own kind, "
            "micro-batch and sending stage, and a send that blocks can wait for ever on a receive the schedule "
            "posts later:\n")
    try:                                            # a hang: a receive whose message never comes, or a blocking send
        with hang_breaks(("ex03.B.match", "ex03.B.flush"), lambda text: hung + text), launched(
                f"{where} (every message travels in the dtype of the stages' parameters; a receive gets the "
                "message of its own kind, micro-batch and sending stage)"):
            got = strategy.TrainResult.merge(minipar.launch(_pipelines, 2, args=("crossed",), timeout=TIMEOUT))
    except GradeFailure as f:                       # a rank's error: the dtype clause when it says dtype
        if str(f).startswith(hung):
            raise
        with breaks("ex03.B.dtype" if "dtype" in str(f).split("): ", 1)[-1] else "ex03.B.match"):
            raise
    want = reference.train_reference(GPT(CFG, seed=0).double(), data.batches(TOKENS, 2, 4, 8), reference.sgd(0.5))
    with breaks("ex03.B.match"):
        expect_same_training(got, want, f"{where} (a receive gets the message of its own kind, micro-batch and "
                             "sending stage), parameters compared as the fp32 copies the run returns",
                             rtol=1e-6, atol=1e-7)
    with breaks("ex03.B.dtype"):
        for step, (g, w) in enumerate(zip(got["losses"], want["losses"])):
            expect_close(torch.tensor(g, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                         "the float64 loss (every message travels in the dtype of the stages' parameters)",
                         where=f"{where}, step {step}", rtol=1e-12, atol=1e-12)


@observes("ex03.B.flush", "ex03.*.recorded")
def test_sends_complete_each_step(impl):
    """1F1B on 2 ranks, 4 micro-batches, 2 steps: like one process, each step's recorded bytes per rank
    are the schedule's messages, on the group ("pp"), and no transfer is left unwaited."""
    try:
        results = minipar.launch(_pipelines, 2, args=("1f1b",), timeout=TIMEOUT)
    except LaunchTimeout as e:      # a send dropped unwaited can leave its receiver waiting for ever
        with breaks("ex03.B.flush"):
            expect(False, f"the 1F1B-pipelined GPT on 2 ranks, 2 steps, did not end within {TIMEOUT} s ({e}); each "
                   "step's sends never block the schedule, yet every send is waited on, and recorded, by the end of "
                   "the step")
    want = reference.train_reference(GPT(CFG, seed=0), data.batches(TOKENS, 2, 8, 8), reference.sgd(0.5))
    got = strategy.TrainResult.merge([{k: v for k, v in r.items() if k != "unwaited"} for r in results])
    with breaks("ex03.B.flush"):
        expect_same_training(got, want, "the 1F1B-pipelined GPT on 2 ranks", rtol=1e-5, atol=1e-6)
    sent = [res["measured"]["bytes_by_dim"] for res in results]
    with breaks("ex03.B.flush"):                    # a send never waited on records nothing
        expect_equal(sent, [{"pp": 4096, "total": 4096}] * 2, "the last step's recorded bytes sent, by group label "
                     "(every send is waited on, and recorded, by the end of the step)", keys="rank")
    with breaks("ex03.*.recorded"):
        expect_equal({r: res["unwaited"] for r, res in enumerate(results)}, {0: [], 1: []},
                     "transfers started and never waited on after 2 steps (every transfer is waited on before the "
                     "step ends, so the trace records its bytes)", keys="rank")


# ----------------------------------------------------------------------------- C: compute actions
ROWS, M = 8, 4
XY = (torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(1)),
      torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(2)))


def _net():
    """Two stages: Linear(4, 6) + tanh on rank 0, Linear(6, 3) on rank 1 (every parameter a linear's)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _mse(out, y):
    return ((out.float() - y) ** 2).mean()


def _one_step(g, schedule, dtype):
    r = dist.get_rank()
    net = _net()
    stage = net[:2] if r == 0 else net[2:]
    seen = []
    stage.register_forward_hook(lambda mod, args, out: seen.append(str(out.dtype)))
    pipe = Pipeline({r: stage}, schedule, (ROWS // schedule.m, 6), g, loss_fn=_mse, dtype=dtype)
    kept = []                         # under a split backward: the tensors a micro-batch's stash holds after its B
    if schedule.split_backward:
        b = pipe.B

        def watched(a):
            b(a)
            kept.append(sum(t.numel() for t in _tensors(pipe.stash.get((a.microbatch, a.stage)))))
        pipe.B = watched
    loss = pipe.step(*XY)
    return {"loss": loss, "grads": [None if q.grad is None else q.grad.clone() for q in stage.parameters()],
            "peak_stash": pipe.peak_stash, "dtypes": sorted(set(seen)), "kept_after_B": kept}


def _tensors(v) -> list:
    """The tensors in ``v`` itself, or in the plain tuples, lists and dicts it is made of (not inside
    a ``WeightGrads``: what the deferred weight gradients keep is theirs)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if type(v) in (tuple, list):
        return [t for x in v for t in _tensors(x)]
    if type(v) is dict:
        return [t for x in v.values() for t in _tensors(x)]
    return []


def without_w(schedule: Schedule, i: int) -> Schedule:
    """``schedule`` with micro-batch i's W actions left out on every rank."""
    return Schedule(f"{schedule.name} without W{i}", schedule.p, schedule.m, schedule.v,
                    [[a for a in acts if (a.op, a.microbatch) != ("W", i)] for acts in schedule.actions])


STEP_CASES = (("1F1B, m=4", ("1f1b", M), None), ("ZB-H1, m=4", ("zb-h1", M), None),
              ("ZB-H1 without micro-batch 1's W", ("zb-h1", M, 1), None),
              ("1F1B, m=2, bfloat16", ("1f1b", 2), torch.bfloat16))


def _schedule(spec):
    s = make_schedule(spec[0], 2, spec[1])
    return without_w(s, spec[2]) if len(spec) > 2 else s


def _compute_actions():
    g = _group()
    return {name: _one_step(g, _schedule(spec), dtype) for name, spec, dtype in STEP_CASES}


def _step_want(m, skip=()):
    """One process: the loss of the batch and each stage's gradients, summing loss_i/m over the
    micro-batches not in ``skip``."""
    net = _net()
    loss = 0.0
    for i, (x, y) in enumerate(zip(XY[0].chunk(m), XY[1].chunk(m))):
        li = _mse(net(x), y) / m
        loss += float(li.detach())
        if i not in skip:
            li.backward()
    return loss, [[q.grad.clone() for q in net[:2].parameters()], [q.grad.clone() for q in net[2:].parameters()]]


@observes("ex03.C.mean", "ex03.C.backward", "ex03.C.stash", "ex03.C.split", "ex03.C.dtype")
def test_compute_actions(impl):
    """One step of a two-stage network on 2 ranks under 1F1B and ZB-H1 (4 micro-batches): the loss and both
    stages' gradients equal one process's; a micro-batch's W left out is missing from them and nothing else
    is; bfloat16 stages compute in bfloat16; ``peak_stash`` is the schedule's on each rank, and under ZB-H1 the
    tensors a stash holds between a micro-batch's B and its W."""
    results = minipar.launch(_compute_actions, 2, timeout=TIMEOUT)
    names = ("weight", "bias")
    for name, spec, dtype in STEP_CASES:
        skip = spec[2:] if len(spec) > 2 else ()
        loss, grads = _step_want(spec[1], skip)
        tol = dict(rtol=5e-2, atol=5e-2) if dtype is not None else dict(rtol=1e-5, atol=1e-6)
        with breaks("ex03.C.dtype" if dtype is not None else "ex03.C.mean"):
            expect_close(torch.tensor(results[1][name]["loss"]), torch.tensor(loss), "the step's loss (the mean "
                         "of its micro-batches' losses)", where=f"rank 1 (the last stage), {name}", **tol)
        for rank, got in enumerate(results):
            for pname, g, w in zip(names, got[name]["grads"], grads[rank]):
                what = "gradient after the step"
                if skip:
                    what += (" (the other micro-batches' only: with ``schedule.split_backward`` (ZB-H1), B "
                             "computes the input gradients only and W the weight gradients)")
                elif rank == 0:
                    what += (" (through the ∂L/∂(input) rank 1 sent back: B continues the backward from "
                             "the gradient ``RECV_B`` left)")
                else:
                    what += " (the step's loss and gradients are those of the mean of its micro-batches' losses)"
                clause = ("ex03.C.dtype" if dtype is not None else "ex03.C.split" if skip else
                          "ex03.C.backward" if rank == 0 else "ex03.C.mean")
                with breaks(clause):
                    expect(g is not None, f"rank {rank}, {name}: the stage's {pname} has no gradient after the step")
                    expect_close(g, w, what, where=f"rank {rank}, {name}, stage {rank}'s {pname}", **tol)
    for rank, got in enumerate(results):
        where = f"rank {rank}, {STEP_CASES[3][0]}"
        with breaks("ex03.C.dtype"):
            expect_equal(got[STEP_CASES[3][0]]["dtypes"], ["torch.bfloat16"], f"{where}: the dtype of the stage's "
                         "output (the forward computes in ``compute_dtype``)")
    name = STEP_CASES[1][0]
    with breaks("ex03.C.stash"):
        expect_equal({r: res[name]["kept_after_B"] for r, res in enumerate(results)}, {r: [0] * M for r in range(2)},
                     f"{name}: the elements of the tensors a micro-batch's stash still holds right after its B, one "
                     "entry per B (held only while a later action of it still needs them: W needs only what its "
                     "weight gradients were deferred with)", keys="rank")
    for name, spec, dtype in STEP_CASES[:2]:
        schedule = _schedule(spec)
        until = "its W (the backward is split)" if schedule.split_backward else "its B"
        with breaks("ex03.C.stash"):
            expect_equal([r[name]["peak_stash"] for r in results], pp.peak_stash(schedule), f"{name}: peak_stash after "
                         f"the step, the schedule's (what a micro-batch's backward needs is stashed from its F until "
                         f"{until}, and no longer)", keys="rank")
