"""Exercise 03: the stage boundary: activations forward, gradients back, across ranks.

Autograd's graph ends where a process ends. Split a model by layers over ranks and the chain
rule ∂L/∂x = ∂L/∂y · ∂y/∂x must be carried across the cut by hand: the activation y goes
forward, ∂L/∂y comes back (Huang et al. 2019; Narayanan et al. 2019; notebook 03, "Autograd
across ranks"). You write both sides of that boundary, then the two users of it.

A. The stage communication (``minipar.model_parallel.stage_comm``) and the naive model-parallel
   step that runs on it (``NaiveModelParallel.step(x, y)`` in ``minipar.model_parallel``; its
   ``stage``, ``shapes`` (stage s's output shape), ``group``, ``loss_fn``, ``comm``, ``dtype``,
   ``rank`` and ``n`` are set by the library):

   * ``send_activation(y, dst, group, tag, **labels)`` and ``send_grad(grad, dst, ...)`` start
     a send and **return its ``Handle`` without waiting**;
   * ``recv_activation(shape, src, group, dtype, device, tag, **labels)`` returns, once it has
     arrived, **a leaf that requires grad**, so that after this stage's backward its ``.grad``
     is ∂L/∂(this input); ``recv_grad(...)`` returns the gradient itself; both arrive
     **in the ``dtype`` asked**;
   * **the gradient sent back is ∂L/∂(the stage's input)**: the sending stage continues its
     backward from it, and the weight gradients on every rank are one process's;
   * **every transfer goes through ``minipar.comm``** (``isend``/``irecv``: recorded, with its
     bytes), **over ``group``, with ``src``/``dst`` its ranks**, passing ``tag`` and
     ``**labels`` through;
   * ``step`` runs one batch over **any number of stages, one per rank** (a middle rank
     receives and sends in both directions) and returns the batch's loss on the last rank,
     ``None`` elsewhere: **training equals one process**.

B. The pipeline's ``Mailbox`` (``minipar.pipeline.executor``): the executor calls
   ``Mailbox(comm, group, m, act_shape, dtype, device)`` (``act_shape(s)``: stage s's output
   shape for one micro-batch; ``dtype``: its parameters'), ``send(a, tensor)`` for a
   ``SEND_F``/``SEND_B`` action ``a`` (``a.microbatch``, ``a.stage``, ``a.peer``),
   ``recv(a)`` for a ``RECV_F``/``RECV_B`` and ``flush()`` at the end of the step. The
   schedule may receive in any order:

   * **a receive gets the message of its own kind, micro-batch and sending stage, whatever
     the order the messages were sent in**;
   * **every message travels in the dtype of the stages' parameters** (a float64 model's in
     float64);
   * sends never block the schedule, yet **every send is waited on, and recorded, by the end
     of the step**, on the pipeline's ``group``.

Graded on 2 and 3 ranks: the values, dtypes and gradients that arrive, the recorded bytes and
their group, an LSTM and a GPT split over ranks, and pipelined GPTs (a schedule whose second
rank takes the micro-batches in the other order, in float64, and 1F1B) trained on your code,
equal to one process. Grade it with ``python -m minipar.grade ex03``; stuck?
``minipar.hint("ex03", "A")`` (parts A, B).
"""
import torch
import torch.distributed as dist

import minipar
from minipar import comm, data, reference
from minipar.runtime import trace
from minipar import model_parallel as mpar
from minipar import pipeline as pp
from minipar import strategy
from minipar.model_parallel import stage_comm
from minipar.pipeline.schedules import Action, Schedule, add_comms
from minipar.course.grading import diagnose, expect, expect_close, expect_equal, expect_same_training
from minipar.models import GPT, LSTMLM, GPTConfig

EXERCISE = "ex03_model_parallel"
HINTS = {
    'A': (
        "Autograd's graph ends at the process boundary. What must the receiving side's tensor be "
        'for backward to give you ∂L/∂x? What must the sending side not send along with the '
        'values? And in step, which ranks receive, which send, in which order?',
        'Send only the values (detached) and return the handle; receive into a fresh tensor of '
        'the shape and dtype asked, wait, and make it a leaf that requires grad, so backward '
        'stops there and fills .grad. A received gradient needs no grad of its own. In step: rank'
        ' r > 0 receives its input from r-1; the last rank adds the loss; every rank but the '
        'last sends forward and receives ∂L/∂out back; backward; every rank but the first sends '
        'its input\'s .grad back; wait for your sends.',
        "send_activation: return isend(y.detach(), dst, group, name='send_activation', tag=tag, "
        '**labels). recv_activation: x = torch.empty(shape, dtype=dtype, device=device); irecv(x,'
        " src, group, name='recv_activation', tag=tag, **labels).wait(); return "
        "x.requires_grad_(). send_grad / recv_grad: the same with names 'send_grad' / "
        "'recv_grad', without requires_grad. step: inp = x or recv_activation(shapes[r-1], r-1, "
        'g, stage=r); out = stage(inp) under trace.region("forward", ...) and autocast(dtype, '
        'inp.device), loss_fn(out, y) on the last; send = send_activation(out, r+1, ...); grad = '
        'recv_grad(shapes[r], r+1, ...); torch.autograd.backward(out, grad); send_grad(inp.grad, '
        'r-1, ...).wait(); send.wait(); return out.item() on the last rank.',
    ),
    'B': (
        'Two messages can cross the same pair of ranks at once: which three facts tell one '
        'message from every other one of the step? Who knows them on the receiving side?',
        'A tag computed from (kind, micro-batch, sending stage), the same function on both sides:'
        ' the receiver knows the sender is stage s-1 for a forward, s+1 for a backward. Cast what '
        'you send to the parameters\' dtype and receive into that dtype. Keep the send handles, '
        'complete the finished ones as you go, and wait for the rest in flush.',
        '_tag = 2·(sender·m + i) + (kind == "B"). send: fn = comm.send_activation for SEND_F else '
        'comm.send_grad; pending.append(fn(tensor.detach().to(dtype), a.peer, group, '
        'microbatch=a.microbatch, stage=a.stage, tag=_tag(a.op[-1], a.microbatch, a.stage))). '
        'recv: shape act_shape(a.stage - 1) for RECV_F, act_shape(a.stage) for RECV_B; tag with '
        'sender a.stage - 1 or a.stage + 1. _reap: wait and drop the handles whose works are all '
        'is_completed(); flush: wait for all, pending = [].',
    ),
}
CONTRACT = {
    "return its ``Handle`` without waiting": "test_activation_values",
    "a leaf that requires grad": "test_activation_values",
    "in the ``dtype`` asked": "test_activation_values",
    "the gradient sent back is ∂L/∂(the stage's input)": ("test_gradient_flows_back",
                                                           "test_drives_model_parallel"),
    "every transfer goes through ``minipar.comm``": "test_transfers_are_recorded",
    "over ``group``, with ``src``/``dst`` its ranks": "test_transfers_are_recorded",
    "any number of stages, one per rank": "test_drives_model_parallel",
    "training equals one process": "test_drives_model_parallel",
    "a receive gets the message of its own kind, micro-batch and sending stage, whatever the order "
    "the messages were sent in": "test_messages_match_in_any_order",
    "every message travels in the dtype of the stages' parameters": "test_messages_match_in_any_order",
    "every send is waited on, and recorded, by the end of the step": "test_sends_complete_each_step",
}
TIMEOUT = 60
TOKENS = data.synthetic_tokens(1000)
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _group():
    """The 2-rank world as a named group: its transfers are labelled "pp" (the world's: "world")."""
    g = dist.new_group([0, 1])
    comm.name_group(g, "pp")
    return g


def _boundary():
    """Rank 0 sends an fp32 and a bfloat16 activation; rank 1 receives them, runs the second of
    two linear layers and sends the gradient back; each returns what it saw and its events."""
    g, r = _group(), dist.get_rank()
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)
    x = torch.randn(6, 4)
    trace.start(r)
    if r == 0:
        y = l1(x)
        h = stage_comm.send_activation(y, 1, g, tag=1)
        out = {"has_wait": hasattr(h, "wait")}
        if out["has_wait"]:
            h.wait()
        h = stage_comm.send_activation(torch.arange(6.0).reshape(2, 3).to(torch.bfloat16), 1, g, tag=3)
        if out["has_wait"]:
            h.wait()
        grad = stage_comm.recv_grad((6, 5), 1, g, tag=2)
        y.backward(grad)
        return out | {"weight_grad": l1.weight.grad, "events": trace.events()}
    h = stage_comm.recv_activation((6, 5), 0, g, tag=1)
    half = stage_comm.recv_activation((2, 3), 0, g, dtype=torch.bfloat16, tag=3)
    seen = {"values": h.detach().clone(), "leaf": h.is_leaf, "requires_grad": h.requires_grad,
            "half": half.detach().float(), "half_dtype": str(half.dtype)}
    l2(h).pow(2).sum().backward()
    stage_comm.send_grad(torch.zeros(6, 5) if h.grad is None else h.grad, 0, g, tag=2).wait()
    return seen | {"weight_grad": l2.weight.grad, "events": trace.events()}


def _single_process():
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)
    y = l1(torch.randn(6, 4))
    l2(y).pow(2).sum().backward()
    return y.detach(), l1.weight.grad, l2.weight.grad


def test_activation_values(impl):
    """What arrives: the values sent, as a leaf requiring grad, in the dtype asked; a send
    returns its Handle."""
    sender, got = minipar.launch(_boundary, 2, timeout=TIMEOUT)
    y, _, _ = _single_process()
    expect(sender["has_wait"], "rank 0: send_activation returned an object without .wait(), "
                               "expected its Handle (return its ``Handle`` without waiting)")
    expect_close(got["values"], y, "the received activation (what rank 0 sent)", where="rank 1")
    expect_equal({"is_leaf": got["leaf"], "requires_grad": got["requires_grad"]},
                 {"is_leaf": True, "requires_grad": True},
                 "rank 1: the received activation's autograd flags (a leaf that requires grad)")
    expect_equal(got["half_dtype"], "torch.bfloat16",
                 "rank 1: the dtype of recv_activation(..., dtype=torch.bfloat16) (in the ``dtype`` asked)")
    expect_close(got["half"], torch.arange(6.0).reshape(2, 3), "the received bfloat16 activation", where="rank 1")


def test_gradient_flows_back(impl):
    """A two-rank split computes the same weight gradients as one process."""
    r0, r1 = minipar.launch(_boundary, 2, timeout=TIMEOUT)
    _, g1, g2 = _single_process()
    expect_close(r1["weight_grad"], g2, "weight gradient of the second layer", where="rank 1")
    with diagnose(lambda f: bool((r0["weight_grad"] == 0).all()), "rank 0's weight gradient is all zeros"):
        expect_close(r0["weight_grad"], g1, "weight gradient of the first layer, through the gradient rank 1 "
                     "sent (the gradient sent back is ∂L/∂(the stage's input))", where="rank 0")


def test_transfers_are_recorded(impl):
    """Each transfer goes through minipar.comm on the group: 120 bytes of fp32 each way, and the
    12 bytes of the bfloat16 activation, all labelled with the group ("pp")."""
    r0, r1 = minipar.launch(_boundary, 2, timeout=TIMEOUT)
    ev0, ev1 = r0["events"], r1["events"]
    got = {"rank 0 sent": sum(e["bytes_sent"] for e in ev0), "rank 0 received": sum(e["bytes_recv"] for e in ev0),
           "rank 1 sent": sum(e["bytes_sent"] for e in ev1), "rank 1 received": sum(e["bytes_recv"] for e in ev1)}
    expect_equal(got, {"rank 0 sent": 132, "rank 0 received": 120, "rank 1 sent": 120, "rank 1 received": 132},
                 "bytes in the trace (a 6x5 fp32 activation and a 2x3 bfloat16 one forward, a 6x5 fp32 "
                 "gradient back; every transfer goes through ``minipar.comm``)")
    dims = sorted({str(e["labels"].get("dim")) for e in ev0 + ev1 if e["bytes_sent"] or e["bytes_recv"]})
    expect_equal(dims, ["pp"], "the group label of the recorded transfers, the group passed being named "
                               "'pp' (over ``group``, with ``src``/``dst`` its ranks)")


def _model_parallel():
    if dist.get_world_size() == 2:
        return mpar.train(LSTMLM(vocab_size=32, seed=0), data.batches(TOKENS, 3, 8, 16), reference.adamw(1e-2),
                          stages=mpar.lstm_stages)
    return mpar.train(GPT(CFG, seed=0), data.batches(TOKENS, 3, 8, 8), reference.sgd(0.5))


def test_drives_model_parallel(impl):
    """Your step trains the LSTM split over 2 ranks and the GPT over 3 (a middle rank) like one process."""
    two = minipar.launch(_model_parallel, 2, timeout=TIMEOUT)
    want = reference.train_reference(LSTMLM(vocab_size=32, seed=0), data.batches(TOKENS, 3, 8, 16),
                                     reference.adamw(1e-2))
    expect_same_training(strategy.TrainResult.merge(two), want,
                         "the LSTM split over 2 ranks (training equals one process)", rtol=1e-5, atol=1e-6)
    three = minipar.launch(_model_parallel, 3, timeout=TIMEOUT)
    want = reference.train_reference(GPT(CFG, seed=0), data.batches(TOKENS, 3, 8, 8), reference.sgd(0.5))
    expect_same_training(strategy.TrainResult.merge(three), want, "the GPT split over 3 ranks, rank 1 in the "
                         "middle (any number of stages, one per rank)", rtol=1e-5, atol=1e-6)


def crossed() -> Schedule:
    """GPipe on 2 ranks and 2 micro-batches, rank 1 taking them in the other order: the messages
    arrive in another order than the one they are read in."""
    orders = ([Action(op, i, 0) for op, i in (("F", 0), ("F", 1), ("B", 1), ("B", 0))],
              [Action(op, i, 1) for op, i in (("F", 1), ("F", 0), ("B", 0), ("B", 1))])
    return Schedule("crossed", 2, 2, 1, [add_comms(o, 2, 2) for o in orders])


def _pipelines(which):
    g = _group()
    if which == "crossed":
        return pp.train(GPT(CFG, seed=0).double(), data.batches(TOKENS, 2, 4, 8), reference.sgd(0.5),
                        group=g, schedule=crossed())
    return pp.train(GPT(CFG, seed=0), data.batches(TOKENS, 2, 8, 8), reference.sgd(0.5), group=g,
                    schedule="1f1b", microbatches=4)


def test_messages_match_in_any_order(impl):
    """A float64 GPT on 2 ranks with a schedule whose rank 1 takes the micro-batches in the other
    order trains like one process: the float64 losses to 1e-12, the parameters to 1e-6."""
    got = strategy.TrainResult.merge(minipar.launch(_pipelines, 2, args=("crossed",), timeout=TIMEOUT))
    want = reference.train_reference(GPT(CFG, seed=0).double(), data.batches(TOKENS, 2, 4, 8), reference.sgd(0.5))
    where = "float64 GPT, rank 0 sends micro-batches 0, 1 and rank 1 takes 1, 0"
    expect_same_training(got, want, f"{where} (a receive gets the message of its own kind, micro-batch and "
                         "sending stage), parameters compared as the fp32 copies the run returns",
                         rtol=1e-6, atol=1e-7)
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        expect_close(torch.tensor(g, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                     "the float64 loss (every message travels in the dtype of the stages' parameters)",
                     where=f"{where}, step {step}", rtol=1e-12, atol=1e-12)


def test_sends_complete_each_step(impl):
    """1F1B on 2 ranks, 4 micro-batches, 2 steps: like one process, and each step's recorded bytes
    are its 4 messages of 2x8x16 fp32 per rank, on the group ("pp")."""
    results = minipar.launch(_pipelines, 2, args=("1f1b",), timeout=TIMEOUT)
    want = reference.train_reference(GPT(CFG, seed=0), data.batches(TOKENS, 2, 8, 8), reference.sgd(0.5))
    got = strategy.TrainResult.merge(results)
    expect_same_training(got, want, "the 1F1B-pipelined GPT on 2 ranks", rtol=1e-5, atol=1e-6)
    expect_equal([res["measured"]["bytes_by_dim"] for res in results], [{"pp": 4096, "total": 4096}] * 2,
                 "the last step's recorded bytes sent, by group label (every send is waited on, and recorded, "
                 "by the end of the step)", keys="rank")
