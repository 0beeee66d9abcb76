"""Exercise 03: send activations forward and gradients back between pipeline stages.

Contract. The four functions of minipar's stage communication, used by the naive model
parallelism and the pipeline executor for every message between stages:

* ``send_activation(y, dst, group=None, tag=0, **labels)`` starts sending the *values* of stage
  output ``y`` and returns the ``Handle`` without waiting;
* ``recv_activation(shape, src, group=None, dtype, device=None, tag=0, **labels)`` returns the
  received activation once it has arrived, such that after this stage's backward its
  ``.grad`` is ∂L/∂(this input), the gradient to send back;
* ``send_grad(grad, dst, ...)`` / ``recv_grad(shape, src, ...)``: the same for that gradient
  going backwards; the received gradient is what the sending stage's output must be
  back-propagated with.

Why autograd needs this, and what the graph looks like on each side of the cut, is derived
in notebook 03, "Autograd across ranks" (Huang et al. 2019; Narayanan et al. 2019): the
chain rule ∂L/∂x = ∂L/∂y · ∂y/∂x, split across two processes. Data moves only through
``minipar.comm.isend``/``irecv`` (recorded), passing ``tag`` and ``**labels`` through;
``device=None`` means the CPU.

Graded: the values and gradients that arrive, that sends do not block, and an LSTM split
over two ranks and a 1F1B-pipelined GPT trained on your code, equal to one process. Grade it
with ``python -m minipar.grade ex03``; stuck? ``minipar.hint("ex03")``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import data, reference
from minipar.runtime import trace
from minipar import model_parallel as mpar
from minipar import pipeline as pp
from minipar import strategy
from minipar.pipeline import stage_comm
from minipar.course.grading import diagnose, expect, expect_close, expect_equal, expect_same_training
from minipar.models import GPT, LSTMLM, GPTConfig

EXERCISE = "ex03_model_parallel"
HINTS = {
    '': (
        "Autograd's graph ends at the process boundary. What must the receiving side's tensor be "
        'for backward to give you ∂L/∂x? What must the sending side not send along with the '
        'values?',
        'Send only the values (detached) and return the handle; receive into a fresh tensor, '
        'wait, and make it a leaf that requires grad, so backward stops there and fills .grad. A '
        'received gradient needs no grad of its own.',
        "send_activation: return isend(y.detach(), dst, group, name='send_activation', tag=tag, "
        '**labels). recv_activation: x = torch.empty(shape, dtype=dtype, device=device); irecv(x,'
        " src, group, name='recv_activation', tag=tag, **labels).wait(); return "
        "x.requires_grad_(). send_grad / recv_grad: the same with names 'send_grad' / "
        "'recv_grad', without requires_grad.",
    ),
}
TIMEOUT = 60
TOKENS = data.synthetic_tokens(1000)


def _activation_case():
    r = dist.get_rank()
    if r == 0:
        w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
        y = w * 2
        h = stage_comm.send_activation(y, 1, tag=7)
        has_wait = hasattr(h, "wait")
        h.wait()
        return {"has_wait": has_wait}
    x = stage_comm.recv_activation((2, 3), 0, tag=7)
    return {"x": x.detach(), "leaf": x.is_leaf, "requires_grad": x.requires_grad,
            "dtype": x.dtype, "shape": tuple(x.shape)}


def test_activation_values(impl):
    """recv_activation returns the values send_activation sent, as a leaf requiring grad."""
    sender, got = minipar.launch(_activation_case, 2, timeout=TIMEOUT)
    expect(sender["has_wait"], "rank 0: send_activation must return the Handle of its isend (it has no .wait())")
    expect_equal((got["shape"], str(got["dtype"])), ((2, 3), "torch.float32"),
                 "rank 1: (shape, dtype) of the received activation")
    expect_close(got["x"], torch.arange(6.0).reshape(2, 3) * 2, "the received activation (what rank 0 sent)",
                 where="rank 1")
    expect_equal({"is_leaf": got["leaf"], "requires_grad": got["requires_grad"]},
                 {"is_leaf": True, "requires_grad": True},
                 "rank 1: the received activation must be a leaf that requires grad (autograd starts again there)")


def _mlp_split():
    """Two linear layers on two ranks; return rank 0's weight gradient and the bytes sent."""
    r = dist.get_rank()
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)
    x = torch.randn(6, 4)
    trace.start(r)
    if r == 0:
        y = l1(x)
        stage_comm.send_activation(y, 1, tag=1).wait()
        g = stage_comm.recv_grad((6, 5), 1, tag=2)
        y.backward(g)
        return l1.weight.grad, trace.events()
    h = stage_comm.recv_activation((6, 5), 0, tag=1)
    l2(h).pow(2).sum().backward()
    stage_comm.send_grad(h.grad, 0, tag=2).wait()
    return l2.weight.grad, trace.events()


def test_gradient_flows_back(impl):
    """A two-rank split computes the same weight gradients as one process."""
    (g0, ev0), (g1, ev1) = minipar.launch(_mlp_split, 2, timeout=TIMEOUT)
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)
    l2(l1(torch.randn(6, 4))).pow(2).sum().backward()
    expect_close(g1, l2.weight.grad, "weight gradient of the second layer", where="rank 1")
    with diagnose(lambda f: bool((g0 == 0).all()), "rank 0's gradient is zero: did it receive the gradient and "
                                                   "call y.backward(grad) with it?"):
        expect_close(g0, l1.weight.grad, "weight gradient of the first layer (through the gradient rank 1 sent)",
                     where="rank 0")


def test_transfers_are_recorded(impl):
    """Each transfer goes through minipar.comm: 120 bytes each way in the trace."""
    (_, ev0), (_, ev1) = minipar.launch(_mlp_split, 2, timeout=TIMEOUT)
    got = {"rank 0 sent": sum(e["bytes_sent"] for e in ev0), "rank 0 received": sum(e["bytes_recv"] for e in ev0),
           "rank 1 sent": sum(e["bytes_sent"] for e in ev1), "rank 1 received": sum(e["bytes_recv"] for e in ev1)}
    with diagnose(lambda f: 0 in got.values(), "a transfer is missing from the trace: send and receive through "
                                               "minipar.comm.isend / irecv, not torch.distributed"):
        expect_equal(got, dict.fromkeys(got, 6 * 5 * 4),
                     "bytes in the trace (one 6x5 fp32 activation forward, one 6x5 gradient back)")


def _lstm_and_pipeline():
    lstm = LSTMLM(vocab_size=32, seed=0)
    naive = mpar.train(lstm, data.batches(TOKENS, 3, 8, 16), reference.adamw(1e-2), stages=mpar.lstm_stages)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    piped = pp.train(GPT(cfg, seed=0), data.batches(TOKENS, 3, 8, 8), reference.sgd(0.5), schedule="1f1b",
                     microbatches=4)
    return naive, piped


def test_drives_model_parallel_and_pipeline(impl):
    """Your functions train the split LSTM and a 1F1B-pipelined GPT like one process."""
    results = minipar.launch(_lstm_and_pipeline, 2, timeout=TIMEOUT)
    want = reference.train_reference(LSTMLM(vocab_size=32, seed=0), data.batches(TOKENS, 3, 8, 16),
                                     reference.adamw(1e-2))
    expect_same_training(strategy.TrainResult.merge([r[0] for r in results]), want,
                         "the LSTM split over 2 ranks", rtol=1e-5, atol=1e-6)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    want = reference.train_reference(GPT(cfg, seed=0), data.batches(TOKENS, 3, 8, 8), reference.sgd(0.5))
    expect_same_training(strategy.TrainResult.merge([r[1] for r in results]), want,
                         "the 1F1B-pipelined GPT on 2 ranks", rtol=1e-5, atol=1e-6)
