"""Exercise 06: ZeRO: a sharded optimizer step, and stage 3's gather, compute, free
(Rajbhandari et al. 2020).

Every stage shares one layout (``minipar.zero.flat.FlatUnit``): a unit's (a layer's)
parameters are one flat vector, zero-padded to N·k elements for the N ranks of the
data-parallel ``group`` (``None``: the world), and rank r of the group owns the r-th of N
equal slices. What each rank holds, sends and frees is the lesson: notebook 06, "Each stage
removes one redundancy", "What it costs in communication" and "Stage 3 in time" (the
paper's §5.1-5.3 and Figure 1).

A. The reduce path, P_g: ``reduce_shard`` and ``reduce_unit_grads``.
B. The ZeRO-1 optimizer, P_os: ``sharded_step`` and ``ZeroOptimizer``'s flat layout (in
   ``__init__``), ``step`` and ``_step``.
C. Stage 3's storage, P_p: ``gather_unit``, ``free_unit``, ``ShardedFlatUnit.__init__`` and
   ``FlatStorage.gather``, ``.free``, ``.reduce``.
D. Stage 3's schedule: ``UnitSchedule``'s hooks decide when a unit is gathered, freed and
   reduce-scattered, over any storage; the design of that order is yours.

Each function's docstring below is its contract: clauses ``ex06.P.word`` that must hold (the
grader names the clause a failure breaks). The last tests train the GPT with the library's
ZeRO stages 1, 2 and 3 running your code and compare with one process. Stuck?
``minipar.hint("ex06", "A")`` (or "B", "C", "D"). Grade it with ``python -m minipar.grade ex06``.
"""
import torch
import torch.distributed as dist

import minipar
from minipar import cost
from minipar import data, reference, zero
from minipar.runtime import trace
from minipar.course import grading
from minipar.course.grading import breaks, diagnose, expect, expect_close, expect_equal, expect_same_training, attempt, observes, \
    expect_recorded
from minipar.models import GPT, GPTConfig
from minipar.zero.flat import FlatStorage, FlatUnit
from minipar.zero.stage3 import UnitSchedule

EXERCISE = "ex06_zero"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNodjkESwjAIRa/yd+68QselJ3CNCRqmETqB2PH20i55fHj/0aQ0FOudS8iX0Zm+7GBKPEhX7BIN0'
        'RiD68yMKewF0/6DhMN2hXcpvOB+jDO2GSik6Mc7UZfKZ1I0N1fctGI/re9BVVgD1dJI2GjQh4NH6igQZivUD'
        'hx5nFD8rHRxdHPP1hpDnjN4+QNwYEiz',
        'sealed:eNpNUFFuwzAIvQrqTzepywEi7Qq7QsRsklhNjAUkVXv6YTdq92OZ9x7vAUJxCzTojBJ7QJBWf2lAM'
        'xK4JZvBZoKVMMMHl+8T7tPpE24zKwFvVjaDpK7xRzBfzwq6pODc2BrHBQ0mwZgou9KUlrFvTJO5fKE8eUozO'
        'fQHxLuPUMFJeCug6UGXauHeo5L9o2oyWFqpmrwMumOdYcvJhjqE9vAgYfX5SQi6itXkH85uXbONMkX4vTfz2'
        'gcpt3+0eyFAvTo9slwaWFBwJb+Ung+zKFwKxSf9jI/HRQKX5IUfDZTfy+4UjAWCH3ji7g9PlY//',
        'sealed:eNpdkFFuwyAMhq9i9QkyRLXXRLnCLlBVEU2cFIUCMjBpPX2BJlu0F/PLWJ8/IJzSiEO4K5pasAIIe'
        'ljIJT8E/URWIxdbi5Rdt1YHa56cjYrDQmqSNj3QMA7nM9gOHtri8fpCzdoy+vjkzXrtgLato4oRiZVp8Tcsw'
        'Pn+pL6X07a3r1VA0xh1QxN4IcREtu6ROy5Z/QaEFuqRDS5elgh6hj0FsC7Cl8uGmYXwRHJhMHpF5jlIKbNgc'
        'dn9C1aWFNGyyhUwxR+Pfa1ZZiP3b+jsCFCN919JOvwxKyBxAP9/mhxNhjAuX126jYE=',
    ),
    'B': (
        'sealed:eNpVjjEOwkAMBL+yJUg0NBQ0fAIeYDijOyWxT7ZDFF6PIRWNpd0dr32tDO3RpvZmg8q4YhBdHJGBV'
        '7LiZyyVAtPsAdo8PMhsxZ2faokF990errmUYPxVzr1QsKPFASQFVRcU3aAcBiMZHCOTyc8VXvCicWa/4CYli'
        'fvzeMrImFFi7Vk2MQea5L/b9e+L7VF/umgCTKmCxdUwMPfLB0LQU2o=',
        'sealed:eNpdUtFuwyAM/JV7aytFedjeuo+JvGBWlAQQON26r5+BNIv6EhFs353vyDdKhs2QheMVJELjDVw+i'
        'c06ssFXIuPYC/LsRgZlOMnIZe6U0Zcyzs5DbrzfGnlEvnQoqLUQorjF/XJC8ApiQwLNM1avWF3p8Mr3ubrZg'
        'O+cHrWiQHbVrkiJFhZO+p/CUicT+SmfsEZDoiIrcd512JnkMHbaBRVYkNXLdnzq1kYENaLo2xQUhh7D4LRvG'
        'K6I20xX0YXb5EHb2cb3t7oMFtLNk/JNrAZQ6xqqCIwhPvBdNl7cD5sOMTh19wVM9Rcq8kbBJv53V08uV3FqT'
        '4sk2La00uPOo6i5Z3rlufRoGbdcW8bVpz1gCS3aAvqB7UmMs4twVnOfith8eC9bcCaFFrLwEkMi9a5KeeLmg'
        '4r+D2el3kc=',
        'sealed:eNpdUk1vwyAM/Ss+EinyD2jV647TLjtVFULBpEgJICBS118/G5Kt2wXhr+dnP5e7yZasLpXSCVzMU'
        'EaYwQd4+qSKRMWRDac0YzhBQbHhAjPWqAra+pVoOENM1a/+SRkFTbFH8NwI5cBzi6k6mWxWBv3BM8uiZ1Pvl'
        'JUko6VqprsaBN3t6MIhbunS3gFBax981ZrZ0OJwY6Mwo+sbd/hkQ6WylwyAiLczrIZZZc7ZUGhUCmrDzkWYs'
        'otjPUkat4juzcE7WP2DLNBSaE869wEaYPvp6FQPDTgtMZD6X/iSKP247YZbocMwKVGwnYrhTwj4ISyIIbsUP'
        'HgXqg2tU/ShahGjyLa7s+3+msluE3XN1Dz22L4PUaVJ3JxNk4Zxk712fOFtHs2tQ8zr6QDYbZ56Wnz6TdDq5'
        'UbGv8WHEPvG9mtTLAu7jg29nNU7766RJD6DXoPfsI7s/A==',
    ),
    'C': (
        'sealed:eNo1jEsSwkAIRK/SS914AReWp3CNIxmoGEgNxLm+Ez8LCrp4r69ItvAGDRBeyh1u6eOO9EaVz0jhf'
        '0AhQ0hTmzEg8xS1CrIHavOOO5UZXVN8y4/3Kz+M2bsDPkHziCJkdVdDaOUTbqJFcN+miRuWLb72So0WTm6B1'
        'dUSlAgfr7EJlQYzaJo5dnxBF3/y5Q1jDUwQ',
        'sealed:eNpNUctOwzAQ/JW5AVKIENzaO0cuiHO1ideJVceO/KAKP8KncIcfYx03bY+7O7M7M6sD8yE7kxA4m'
        'i+OSCMju7TMrBCTDzQwkscTuiVxbDGQIELlaBPilSmNjvpjQbs8scXfN9jyxC4dCqJuaMoFB7L2sa6K4E8OC'
        'wK5411EHCko3Pckm2VTkdNlrTnITBVZDzBOBiY10D6cBG3cAIqL6w9+Bjm1kix1bOVaqQOnHFzEaaS0Dq/Xt'
        '1mL93KY1aul9CHmdiuwqjERhN56x/Ba+lJvaq3pz02GFmpiJ8Hp+eUZMwWaOInD/Y2NsoynOS0N3n5/jltCo'
        'tS4arCir2zkyGJ3XwIWspaXKYgR73puUfS+1z/tzs+pYYzBO5+jlUOFciNhC0Xlns//NknMDIGUKVouUhpsf'
        'yiOhKckoVJeklwDEm5byBi9VbH9B++g150=',
        'sealed:eNqFUctuxCAM/BUfYRVZVXvbKtceq0pVz4gGQyIREvGolH59DXS3u6deENgz4xljI9EZbPEeS8jHT'
        'kalvEXtSEiMlJZvUuJBIjidZ4r/Qls7lJW8kHDqaPK0UsiqIoSUzxAplxhAe6+6bKMNkGYdDRrKeppZM29dz'
        'tRhcgAXt7KP7RxApyNMatvHy2WA08nrT/KJ3b5XJTIvXuePsOQzrDplijBCIm/Rcr0dmYJolV1HvSb21l7NC'
        'INDwLfaIOaKP2Zrq82Kripx8lvo0TqIXTOblzPNSOuejxvyrg07G6ClGtvJD/paJhoR8apRsSWRuCpyx/Jvq'
        'cKBbqrI6zRl4l90PLPfG0a5qE0SpUld5jXe79AKGpe2527V+k3np0ceVHpGrBKs6mCx97UlwStnBl433XWQ4'
        'ynhJP4AqkrURQ==',
    ),
    'D': (
        'sealed:eNo1TzlywzAM/Mp2aeIPpPEzXMPSRsSE1xCQZf8+EJ1UmFnseZP8g1aJvarD02j7liAwZ//CkVhRd'
        'nOoG7oMKXQOA58a4JFa5iekrm+mWjgQlJGV8S+tsDpq86R1QyXXySghecV38IpbEsfS9rxObeXTZ5cPwyaBD'
        'LQHR5aOQz2dfF0S2vfJNv5FWNwH3yUEXTuzxqaxV4Mx9JJRdBntchdfQogexufGWf4MnvvN5fWfy/X6Czyea'
        'Hs=',
        'sealed:eNp1UmtuwyAMvor/rZPSHCCXqVxwAyqByDjrevsZJ03XPf4g4Qffi5npdCl8Q/YDjCiBGPSAJUeBw'
        'w2jxDy+d5CLEGgpZmtvK1DYE3cw4bV1K0zFL0m3K9nY+iB5mJFxIiGuHWD2cIsSYGa6kLgAVZDFFjJ9imG/1'
        'QebNloWgY1LD3Op8uR8RncFKbZdg5YU4cJkZG+BMjBZWVdX6FDKFeiD+A767Lw0YBRFJl8BYWT0kbJALWujy'
        'WogptdhSrURPz1K/cttgJIdway8zcEGuC8fzLmEzU+hlIyzurM4iWX1dZ9lQhfUuL9UbMa050eMeZW1m7mnd'
        'yY16d/Q+hWZBnOr227H6lCkReoS4foVGuPefDkpK38fIDRAy/dh1hbAU0zJ6f6TeQ+U/TerLCZLQoK2fwulp'
        'P/olUhtKp5fZYqOy/GMKrz/AmTwA5g=',
        'sealed:eNqFUkFywjAM/IpuhJZmyjU0PfYFvTFMxsRK4pLarmyX8vsqhpAQ0unNI612V1pbwqIydBQkM3DYV'
        'mktfIOUqBXYRjjMF5f2Yrk5AwxJpFRYi1omqq86b0jUmAaH3ew7BeSWqs5dS1ihLxsQWoKCR1jDC7Sok9gNW'
        'nm3nOh3oBUchfL5m2gd3vnhwoU1j2opWOP8ZJuJrcg08kXomgFcEWLciDnAg9LAVsAEb4N3/BYeCL+CIoSaB'
        'E95JqiV80hFY8whacXnXgqoV6BylV1XL/aiPHSmmJzZCX0g3fGmMO5mV1v741btsgtwM6pBHi/71wKEMpReG'
        'c0vUTY4yucu1l61y5UPx8yjdJWW+BOHZxPs8K/wfJvYML7t+k+w3s3mdxW+DzD6x2kaN0GeIUO9P0vUSGMuB'
        'S8vT9m/Nxqw8Syszz96Jo2ZT/KxjH8Ev5FO8LEBZPGsN8RuttHODh6mnzz9BUIMMPg=',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT
CFG = dict(vocab_size=67, n_embd=30, n_head=2, n_layer=2, block_size=16)  # no unit divisible by 4
STEPS, BATCH = 3, 8


def _batches():
    toks, _ = data.corpus_tokens()
    return data.batches(toks, STEPS, BATCH, CFG["block_size"])


def _grad(r, m, n):
    """Rank r's padded flat gradient of a unit of m elements."""
    k = -(-m // n)
    g = torch.zeros(n * k)
    g[:m] = torch.arange(m, dtype=torch.float32) * (r + 1) / 10
    return g


def _raised(got, where):
    expect(not isinstance(got, str), f"{where}: the call {got}")


def _pairs():
    """Two groups of 2 out of 4 ranks: (the group, its index, this rank's index in it)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]    # every rank creates both
    return groups[dist.get_rank() // 2], dist.get_rank() // 2, dist.get_rank() % 2


def _in_group(rank):
    return f"rank {rank} (rank {rank % 2} of group {[rank // 2 * 2, rank // 2 * 2 + 1]})"


# ----------------------------------------------------------------------------- A: reduce_shard
def _reduce(m):
    r, n = dist.get_rank(), dist.get_world_size()
    flat = _grad(r, m, n)
    mark = trace.mark()
    mine = zero.reduce_shard(flat, None, unit=5)
    events = trace.since(mark)
    sent = sum(e["bytes_sent"] for e in events)
    k = flat.numel() // n
    return (mine.clone(), mine.data_ptr() == flat[r * k:].data_ptr(), sent, flat.numel(),
            [e["labels"].get("unit") for e in events if e["kind"] == "comm"])


def _reduce_on_pairs(m):
    """reduce_shard on this rank's group of 2 (of 4 ranks): (the slice, whether it is in place, the
    bytes sent, the group labels recorded), or the call's error as text."""
    group, gi, gr = _pairs()
    minipar.comm.name_group(group, "dp")
    flat = _grad(dist.get_rank(), m, 2)

    def call():
        mark = trace.mark()
        mine = zero.reduce_shard(flat, group)
        events = trace.since(mark)
        return (mine.clone(), mine.data_ptr() == flat[gr * (flat.numel() // 2):].data_ptr(),
                sum(e["bytes_sent"] for e in events), sorted({str(e["labels"].get("dim")) for e in events}))
    return attempt(call)


@observes("ex06.A.mean", "ex06.A.memory", "ex06.A.bytes", "ex06.*.group", "ex06.*.recorded")
def test_reduce_shard(impl):
    """reduce_shard on 4 ranks (10 elements padded to 12), then on two groups of 2 of them: the mean this
    rank owns, where the contract says it is left, what it returns, the bytes each rank sends and their
    label, the group."""
    n, m = 4, 10
    mean = sum(_grad(q, m, n) for q in range(n)) / n
    total = sum(_grad(q, m, n) for q in range(n))
    for r, (mine, in_place, sent, numel, units) in enumerate(minipar.launch(_reduce, n, args=(m,), timeout=TIMEOUT)):
        want = mean[r * 3:(r + 1) * 3]
        with diagnose(lambda e: mine.shape == want.shape and torch.allclose(mine, total[r * 3:(r + 1) * 3]),
                      f"the slice holds the sum over the {n} ranks, {n} times the mean"):
            with diagnose(lambda e: any(mine.shape == want.shape and torch.allclose(mine, mean[q * 3:(q + 1) * 3])
                                        for q in range(n) if q != r), "the slice holds the mean of another "
                          "rank's elements"):
                with breaks("ex06.A.mean"):
                    expect_close(mine, want, "the slice reduce_shard returned",
                                 where=f"rank {r}", rtol=1.3e-6, atol=1e-5)
        expect(in_place, f"rank {r}: the tensor reduce_shard returned is not the view of flat_grad the contract names "
                         "(it does not start at flat_grad's element r·k) (ex06.A.memory)")
        with breaks("ex06.*.recorded" if sent == 0 else "ex06.A.bytes"):
            expect_recorded(sent, int(cost.collective_bytes("reduce_scatter", numel * 4, n)),
                            f"bytes sent (one reduce-scatter of {numel} floats)", f"rank {r}")
        with breaks("ex06.A.bytes"):
            expect_equal(units, [5], f"rank {r}: the label unit=5 given to reduce_shard, as each recorded collective "
                         "carries it (one collective that receives ``**labels``)")
    # the same on two groups of 2 out of 4 ranks ([0, 1] and [2, 3]), each its own gradients
    m = 8   # 4 elements per rank of a pair (2 on each of 4 ranks, were it the world's)
    for rank, got in enumerate(minipar.launch(_reduce_on_pairs, 4, args=(m,), timeout=TIMEOUT)):
        where = f"{_in_group(rank)}, group of 2"
        _raised(got, f"{where} (ex06.*.group)")
        mine, in_place, sent, dims = got
        pair = [rank // 2 * 2, rank // 2 * 2 + 1]
        want = (sum(_grad(q, m, 2) for q in pair) / 2).tensor_split(2)[rank % 2]
        expect_close(mine, want, "the slice reduce_shard returned on a group of 2 (ex06.*.group)", where=where,
                     rtol=1.3e-6, atol=1e-5)
        expect(in_place, f"{where}: the tensor reduce_shard returned is not the view of flat_grad the contract "
                         "names (it does not start at flat_grad's element r·k, r the group rank) (ex06.A.memory)")
        with breaks("ex06.*.recorded" if sent == 0 else "ex06.*.group"):
            expect_recorded(sent, int(cost.collective_bytes("reduce_scatter", 2 * (-(-m // 2)) * 4, 2)),
                            "bytes sent (one reduce-scatter over the group of 2)", where)
        expect_equal(dims, ["dp"], f"{where}: the group labels of the recorded reduce-scatter (ex06.*.group)")


UNIT_DTYPES = [(None, torch.float32), (torch.float64, torch.float64)]   # (dtype asked, dtype returned)


def _unit_grads(group, gr, dtype):
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]      # 9 elements: padded to 10 on 2 ranks
    for i, p in enumerate(ps):
        if not (gr == 1 and i == 0):                                  # group rank 1: no gradient on ps[0]
            p.grad = torch.arange(3, dtype=torch.float32) + 10 * i + 100 * dist.get_rank()
    unit = FlatUnit(ps, group)
    out = zero.reduce_unit_grads(unit, dtype=dtype)
    return {"value": out.clone(), "dtype": str(out.dtype), "numel": out.numel(),
            "storage": out.untyped_storage().nbytes(), "grads": [p.grad is None for p in ps]}


def _reduce_units():
    group, gi, gr = _pairs()
    return [attempt(_unit_grads, group, gr, dtype) for dtype, _ in UNIT_DTYPES]


@observes("ex06.*.group", "ex06.A.zeros", "ex06.A.dtype", "ex06.A.fresh", "ex06.A.cleared")
def test_reduce_unit_grads(impl):
    """reduce_unit_grads on two groups of 2 out of 4 ranks, a gradient missing on one rank: the mean, its
    dtype and size, and the parameters' .grad afterwards."""
    results = minipar.launch(_reduce_units, 4, timeout=TIMEOUT)
    for rank, cases in enumerate(results):
        gi, gr = rank // 2, rank % 2
        flats = []
        for q in (2 * gi, 2 * gi + 1):
            g = torch.zeros(10, dtype=torch.float64)
            for i in range(3):
                if not (q % 2 == 1 and i == 0):
                    g[3 * i:3 * i + 3] = torch.arange(3) + 10 * i + 100 * q
            flats.append(g)
        want = ((flats[0] + flats[1]) / 2)[5 * gr:5 * gr + 5]
        for (asked, dtype), got in zip(UNIT_DTYPES, cases):
            where = f"{_in_group(rank)}, dtype={asked}"
            with breaks("ex06.A.zeros", "ex06.*.group"):
                _raised(got, where)
            with breaks("ex06.A.dtype"):
                expect_equal(got["dtype"], str(dtype), f"{where}: the dtype of the reduced slice")
            with breaks("ex06.A.fresh"):
                expect_equal(got["numel"], 5, f"{where}: elements of the reduced slice (k = 10 / 2)")
            with breaks("ex06.A.zeros", "ex06.*.group"):
                expect_close(got["value"].double(), want, "the reduced slice (the mean over the group; elements "
                             "of group rank 1's missing gradient count as 0)", where=where, rtol=1e-6, atol=1e-6)
            with breaks("ex06.A.fresh"):
                expect_equal(got["storage"], 5 * got["value"].element_size(),
                             f"{where}: bytes of the storage behind the returned slice (5 elements' worth)")
            with breaks("ex06.A.cleared"):
                expect_equal(got["grads"], [True, True, True], f"{where}: each parameter's .grad is None afterwards",
                             keys="parameter")


# ----------------------------------------------------------------------------- B: sharded_step
def _one_step(mixed):
    """Two units of 10 and 7 elements, Adam on the shards: the result should be a full Adam
    step on the mean gradient. ``mixed``: bf16 flat parameters and gradients, fp32 shards."""
    r, n = dist.get_rank(), dist.get_world_size()
    low = torch.bfloat16 if mixed else torch.float32
    sizes, fulls, grad_shards, shards, want = [10, 7], [], [], [], []
    for u, m in enumerate(sizes):
        k = -(-m // n)
        w = torch.zeros(n * k)
        w[:m] = torch.linspace(-1, 1, m) * (u + 1)
        mean = sum(_grad(q, m, n) for q in range(n)) / n
        ref = torch.nn.Parameter(w[:m].clone())
        ref.grad = mean[:m].to(low).float()
        torch.optim.Adam([ref], lr=0.1).step()
        want.append(ref.detach().to(low))
        fulls.append(w.to(low) if mixed else w)
        grad_shards.append(mean[r * k:(r + 1) * k].to(low))                 # what reduce_shard gives
        # a view, like the library, or (mixed) the fp32 master copy
        shards.append(torch.nn.Parameter(w[r * k:(r + 1) * k].clone() if mixed else w[r * k:(r + 1) * k]))
    opt = torch.optim.Adam(shards, lr=0.1)
    zero.sharded_step(fulls, grad_shards, shards, opt, None)
    state = sum(v.numel() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    return ([f[:m].clone() for f, m in zip(fulls, sizes)], want, state, sum(-(-m // n) for m in sizes),
            [str(f.dtype) for f in fulls], [str(s.dtype) for s in shards])


def _steps():
    return [attempt(_one_step, mixed) for mixed in (False, True)]


@observes("ex06.B.full_step", "ex06.B.state", "ex06.B.dtypes")
def test_sharded_step_is_a_full_step(impl):
    """After sharded_step every rank holds the full parameters of an Adam step on the mean
    gradient (4 ranks, unit sizes not divisible by 4), with optimizer state for its shard only;
    then again with bf16 flat parameters and gradients and fp32 shards, each dtype kept."""
    for rank, cases in enumerate(minipar.launch(_steps, 4, timeout=TIMEOUT)):
        for mixed, got in zip((False, True), cases):
            name = "bf16 flat parameters and gradient slices, fp32 shards" if mixed else "fp32"
            with breaks("ex06.B.dtypes" if mixed else "ex06.B.full_step"):   # fp32 passed first: a dtype's fault
                _raised(got, f"rank {rank}, {name}: sharded_step")
            got, want, state, k, flat_dtypes, shard_dtypes = got
            with breaks("ex06.B.dtypes"):
                expect_equal({"flat parameters": flat_dtypes, "shards": shard_dtypes},
                             {"flat parameters": [str(torch.bfloat16 if mixed else torch.float32)] * 2,
                              "shards": [str(torch.float32)] * 2}, f"rank {rank}, {name}: dtypes after the step")
            with breaks("ex06.B.dtypes" if mixed else "ex06.B.full_step"):
                for u, (g, w) in enumerate(zip(got, want)):
                    expect_close(g.float(), w.float(), "full parameters after the step (one Adam step on the mean "
                                 "gradient)", where=f"rank {rank}, {name}, unit {u}",
                                 rtol=0 if mixed else 1e-6, atol=1e-2 if mixed else 1e-6)
            with breaks("ex06.B.state"):
                expect_equal(state, 2 * k, f"rank {rank}, {name}: optimizer state elements (Adam's 2 per element of "
                                           f"its shards, {k} elements)")


# ----------------------------------------------------------------------------- B: ZeroOptimizer
OPT_CASES = [  # (name, param_dtype, max_grad_norm, optimizer, lr), run in turn on each group
    ("fp32, Adam", None, None, torch.optim.Adam, 0.1),
    ("fp32, SGD, max_grad_norm=0.5", None, 0.5, torch.optim.SGD, 0.5),
    ("param_dtype=bfloat16, Adam", torch.bfloat16, None, torch.optim.Adam, 0.1),
]
OPT_STEPS = 2


def _opt_params():
    """Units [[w (7,), u (2,)], [b (3,)]]: 9 elements padded to 10, and 3 padded to 4."""
    return [torch.nn.Parameter(torch.linspace(-1, 1, 7)), torch.nn.Parameter(torch.tensor([0.5, -0.5])),
            torch.nn.Parameter(torch.tensor([1.0, 2.0, -1.0]))]


def _coeff(step, rank, m, i):
    """d loss / d param i on ``rank`` at ``step``: multiples of 1/8 (exact in bf16)."""
    return (torch.arange(m, dtype=torch.float32) - 3 + 2 * step + rank + 5 * i) / 8


def _opt_case(group, name, param_dtype, clip, optim, lr):
    w, u, b = ps = _opt_params()
    r, k = dist.get_rank() % 2, (5, 2)                        # a unit's k: 10 and 4 padded elements over 2
    slices = [torch.cat([torch.cat(us).detach(), torch.zeros(2 * kk - sum(x.numel() for x in us))])[r * kk:(r + 1) * kk]
              for us, kk in (((w, u), k[0]), ((b,), k[1]))]     # this rank's fp32 slice of each unit
    opt = zero.ZeroOptimizer([[w, u], [b]], optim, group=group, param_dtype=param_dtype, max_grad_norm=clip, lr=lr)
    flats = {f.untyped_storage().data_ptr() for f in opt.flat_params}
    views = [p.untyped_storage().data_ptr() in flats for p in ps]
    dtypes = [str(p.dtype) for p in ps]
    shard_views = [s.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                   and s.storage_offset() == f.storage_offset() + r * kk
                   for s, f, kk in zip(opt.shards, opt.flat_params, k)]
    masters = [s.dtype == torch.float32 and torch.equal(s.detach(), want) for s, want in zip(opt.shards, slices)]
    out = {"views": views, "dtypes": dtypes, "shards": [str(s.dtype) for s in opt.shards], "steps": [],
           "shard views": shard_views, "masters": masters}
    for step in range(OPT_STEPS):
        if step == 0:
            opt.zero_grad()
        else:                                               # the model's zero_grad (set_to_none), not the optimizer's:
            for p in ps:                                    # backward writes new .grad tensors, the step must use them
                p.grad = None
        loss = sum((p * _coeff(step, dist.get_rank(), p.numel(), i).to(p.dtype)).sum()
                   for i, p in enumerate((w, b)))           # u takes no part: no gradient on any rank
        loss.backward()
        opt.step()
        out["steps"].append({"params": [p.detach().float().clone() for p in ps],
                             "shard grads": [s.grad is None for s in opt.shards]})
    out["state"] = sum(v.numel() for st in opt.optim.state.values() for v in st.values() if v.dim() > 0)
    return out


def _zero_optimizers():
    group, gi, gr = _pairs()
    return [attempt(_opt_case, group, *case) for case in OPT_CASES]


def _opt_reference(gi, clip, optim, lr):
    ps = _opt_params()
    opt = optim(ps, lr=lr)
    out = []
    for step in range(OPT_STEPS):
        for i, p in zip((0, 1), (ps[0], ps[2])):
            p.grad = sum(_coeff(step, q, p.numel(), i) for q in (2 * gi, 2 * gi + 1)) / 2
        ps[1].grad = torch.zeros(2)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()
        out.append([p.detach().clone() for p in ps])
    return out


@observes("ex06.*.group", "ex06.B.state", "ex06.B.dtypes", "ex06.B.views", "ex06.B.step", "ex06.B.clip", "ex06.B.no_copy", "ex06.B.second")
def test_zero_optimizer(impl):
    """ZeroOptimizer on two groups of 2 out of 4 ranks (one parameter without a gradient): Adam, clipped SGD
    and Adam under param_dtype=bfloat16, two steps each: the parameters (views into the flat parameters, in
    param_dtype) equal the optimizer's steps on the group's mean gradient; optimizer state for the rank's
    shard only; no fp32 gradient left after a bf16 step."""
    results = minipar.launch(_zero_optimizers, 4, timeout=TIMEOUT)
    names = ("w", "u", "b")
    for rank, cases in enumerate(results):
        gi = rank // 2
        for (name, param_dtype, clip, optim, lr), got in zip(OPT_CASES, cases):
            where = f"{_in_group(rank)}, {name}"
            _raised(got, where)
            low = param_dtype or torch.float32
            with breaks("ex06.B.views"):
                expect_equal(dict(zip(names, got["dtypes"])), dict.fromkeys(names, str(low)),
                             f"{where}: the model parameters' dtype after ZeroOptimizer(...)", keys="parameter")
                expect_equal(got["shards"], [str(torch.float32)] * 2, f"{where}: the dtype of the optimizer's shards",
                             keys="unit")
                expect_equal(dict(zip(names, got["views"])), dict.fromkeys(names, True),
                             f"{where}: the parameter's memory is one of opt.flat_params'", keys="parameter")
            want = _opt_reference(gi, clip, optim, lr)
            for step, (g, ws) in enumerate(zip(got["steps"], want)):
                with breaks("ex06.B.second" if step else "ex06.B.clip" if clip else "ex06.B.step"):
                    for pname, p, w in zip(names, g["params"], ws):
                        expect_close(p, w.to(low).float(), f"parameter {pname} after step {step + 1} (the optimizer's "
                                     "step on the group's mean gradient" + (", the model's zero_grad() before its backward"
                                                                            if step else "") + ")", where=where,
                                     rtol=0 if param_dtype else 1e-6, atol=1e-2 if param_dtype else 1e-6)
                if param_dtype is not None:
                    with breaks("ex06.B.no_copy"):
                        expect_equal(g["shard grads"], [True, True], f"{where}: the shards' .grad is None after step "
                                     f"{step + 1}", keys="unit")
            want_state = (2 if optim is torch.optim.Adam else 0) * (5 + 2)
            with breaks("ex06.B.state"):
                expect_equal(got["state"], want_state, f"{where}: elements of optimizer state (per element of its "
                             "shards of 5 and 2 elements)")
            expect_equal(got["masters"], [True, True], f"{where}: the shard holds this rank's slice of the unit's "
                         "fp32 parameters, exactly (ex06.B.views)", keys="unit")
            expect_equal(got["shard views"], [param_dtype is None] * 2,
                         f"{where}: the shard is a view of this rank's slice of opt.flat_params (fp32), its own "
                         "memory under bfloat16 (ex06.B.views)", keys="unit")


# ----------------------------------------------------------------------------- training
def _stages(stages):
    """The library's zero.train under each stage, in one launch."""
    out = {}
    for stage in stages:
        res = zero.train(GPT(GPTConfig(**CFG), seed=0), _batches(), reference.adamw(1e-2, 0.1), stage=stage)
        m = res["measured"]
        out[stage] = {"losses": res["losses"], "params": res["params"], "memory": m["memory"],
                      "comm_bytes": m["bytes_sent"], "unit_sizes": m["unit_sizes"]}
    return out


def _want():
    return reference.train_reference(GPT(GPTConfig(**CFG), seed=0), _batches(), reference.adamw(1e-2, 0.1))


@observes("ex06.B.second", "ex06.*.train")
def test_stages_1_and_2_train_like_one_process(impl):
    """The library's ZeRO-1 and ZeRO-2 (both step with your sharded_step on your reduce_shard) train the GPT
    on 4 ranks like one process (AdamW, fp32), with the contract's optimizer state per unit and bytes per
    step."""
    results = minipar.launch(_stages, 4, args=([1, 2],), timeout=TIMEOUT)
    want = _want()
    for rank, got in enumerate(results):
        for stage, res in got.items():
            with breaks("ex06.*.train"):
                expect_same_training(res, want, f"rank {rank}, ZeRO-{stage}", rtol=1e-4, atol=5e-5)
                want_state = cost.zero_bytes_per_rank(res["unit_sizes"], 4, stage, k=8)["optimizer"]
                expect_equal(res["memory"]["optimizer"], want_state,
                             f"rank {rank}, ZeRO-{stage}: optimizer state bytes (cost.zero_bytes_per_rank)")
                expect_equal(res["comm_bytes"], cost.zero_comm_bytes(res["unit_sizes"], 4, stage),
                             f"rank {rank}, ZeRO-{stage}: bytes sent per run (cost.zero_comm_bytes)")


# ----------------------------------------------------------------------------- C: gather and free
GATHER_DTYPES = [torch.float32, torch.bfloat16]     # the buffer's dtype; the shards are fp32


def _gather_free(dtype):
    r, n = dist.get_rank(), dist.get_world_size()
    full = torch.empty(3 * n, dtype=dtype)
    view = full[1:4]                                  # a parameter-like view into the buffer
    zero.free_unit(full)
    freed = full.untyped_storage().nbytes()
    shard = torch.arange(3, dtype=torch.float32) + 10 * r
    mark = trace.mark()
    ret = zero.gather_unit(full, shard, unit=7)
    comms = [e for e in trace.since(mark) if e["kind"] == "comm"]
    sync = (full.float().clone(), full.untyped_storage().nbytes(), ret is None, view.float().clone(), str(full.dtype),
            [e["bytes_sent"] for e in comms], [e["labels"].get("unit") for e in comms])
    zero.free_unit(full)
    after = (full.untyped_storage().nbytes(), full.shape)
    handle = zero.gather_unit(full, shard * 2, async_op=True)
    waits = callable(getattr(handle, "wait", None))
    if waits:
        handle.wait()
    return freed, sync, after, full.float().clone(), waits


def _gathers_and_frees():
    return [attempt(_gather_free, dtype) for dtype in GATHER_DTYPES]


@observes("ex06.C.free", "ex06.C.gather", "ex06.C.async")
def test_gather_and_free(impl):
    """free_unit and gather_unit: the memory a freed unit holds, the values and their order once gathered
    (views see them), synchronously or with a Handle; fp32 and bf16 buffers."""
    n = 2
    for rank, cases in enumerate(minipar.launch(_gathers_and_frees, n, timeout=TIMEOUT)):
        for dtype, got in zip(GATHER_DTYPES, cases):
            where = f"rank {rank}, a {dtype} buffer, fp32 shards"
            with breaks("ex06.C.gather"):
                _raised(got, where)
            freed, (vals, nbytes, is_none, view, kept, sends, units), (after, shape), async_vals, waits = got
            want = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * q for q in range(n)])
            size = dtype.itemsize
            with breaks("ex06.C.free"):
                expect_equal(freed, 0, f"{where}: storage bytes after free_unit")
            with breaks("ex06.C.gather"):
                expect_equal(kept, str(dtype), f"{where}: the buffer's dtype after gather_unit")
                expect_close(vals, want, "the gathered unit (every rank's shard, in rank order)", where=where,
                             rtol=0, atol=0)
            with breaks("ex06.C.gather", "ex06.C.async"):
                expect_equal({"storage bytes": nbytes, "returns None": is_none},
                             {"storage bytes": 3 * n * size, "returns None": True}, f"{where}: synchronous gather_unit")
            expect_equal(sends, [int(cost.collective_bytes("all_gather", 3 * n * size, n))],
                         f"{where}: bytes sent by each recorded collective of one gather_unit (one all-gather of "
                         f"{3 * n} elements) (ex06.C.gather)")
            expect_equal(units, [7], f"{where}: the label unit=7 given to gather_unit, as the recorded "
                         "all-gather carries it (ex06.C.async)")
            with breaks("ex06.C.gather"):
                expect_close(view, want[1:4], "a view into the unit (a parameter) after the gather", where=where,
                             rtol=0, atol=0)
            with breaks("ex06.C.free"):
                expect_equal({"storage bytes": after, "shape": tuple(shape)}, {"storage bytes": 0, "shape": (3 * n,)},
                             f"{where}: after the second free_unit (memory released, the tensor kept)")
            with breaks("ex06.C.async"):
                expect(waits, f"{where}: gather_unit(..., async_op=True) returned an object without .wait()")
                expect_close(async_vals, 2 * want, "the unit gathered with async_op=True, after handle.wait()",
                             where=where, rtol=0, atol=0)


# ----------------------------------------------------------------------------- C: FlatStorage
def _module(gi):
    """nn.Linear(2, 3): 9 elements, padded to 10 on a group of 2 (k = 5); the same on a group's ranks."""
    m = torch.nn.Linear(2, 3)
    with torch.no_grad():
        m.weight.copy_(_randn(3, 2, seed=gi))
        m.bias.copy_(_randn(3, seed=10 + gi))
    return m


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _inputs(rank, backward):
    return _randn(4, 2, seed=100 + 10 * rank + backward)


def _storage_case(group, gi, dtype):
    m = _module(gi)
    st = FlatStorage([(m, list(m.parameters()))], group, dtype=dtype)
    u = st.units[0]
    out = {"shard": (u.shard.detach().clone(), str(u.shard.dtype), u.shard.is_leaf, u.shard.requires_grad),
           "full": (u.full.untyped_storage().nbytes(), str(u.full.dtype), u.full.numel())}
    handle = st.gather(0)
    out["handle"] = callable(getattr(handle, "wait", None))
    if out["handle"]:
        handle.wait()
    out["views"] = [p.untyped_storage().data_ptr() == u.full.untyped_storage().data_ptr() for p in m.parameters()]
    out["gathered"] = (u.full.untyped_storage().nbytes(), [p.detach().float().clone() for p in m.parameters()])
    out["grads"] = []
    for backward in range(2):                             # two backwards before one step
        m(_inputs(dist.get_rank(), backward).to(dtype)).float().sum().backward()
        mark = trace.mark()
        st.reduce(0)
        out.setdefault("sent", []).append([e["bytes_sent"] for e in trace.since(mark) if e["kind"] == "comm"])
        g = u.shard.grad
        out["grads"].append((None if g is None else g.detach().clone(), None if g is None else str(g.dtype),
                             [p.grad is None for p in m.parameters()]))
    st.free(0)
    out["freed"] = u.full.untyped_storage().nbytes()
    return out


def _storages():
    group, gi, gr = _pairs()
    return [attempt(_storage_case, group, gi, dtype) for dtype in GATHER_DTYPES]


def _storage_want(gi, gr):
    """(this rank's fp32 shard, its mean gradient slice after one and after two backwards)."""
    m = _module(gi)
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts] + [torch.zeros(1)])  # noqa: E731
    grads = []
    for backward in range(2):
        mean = 0
        for q in (2 * gi, 2 * gi + 1):
            m.zero_grad()
            m(_inputs(q, backward)).sum().backward()
            mean = mean + flat([p.grad for p in m.parameters()]) / 2
        grads.append(mean[5 * gr:5 * gr + 5])
    return flat(m.parameters())[5 * gr:5 * gr + 5], [grads[0], grads[0] + grads[1]], list(m.parameters())


@observes("ex06.*.group", "ex06.C.shard", "ex06.C.full", "ex06.C.storage", "ex06.C.reduce", "ex06.C.accumulate")
def test_flat_storage(impl):
    """FlatStorage on two groups of 2 out of 4 ranks, one unit, in fp32 and in bf16: the shard, the buffer the
    parameters are views of, gather's Handle, two backwards' gradients on the shard, free."""
    results = minipar.launch(_storages, 4, timeout=TIMEOUT)
    for rank, cases in enumerate(results):
        gi, gr = rank // 2, rank % 2
        shard, grads, params = _storage_want(gi, gr)
        for dtype, got in zip(GATHER_DTYPES, cases):
            where = f"{_in_group(rank)}, dtype={dtype}"
            _raised(got, where)
            value, sdtype, leaf, requires = got["shard"]
            with breaks("ex06.C.shard"):
                expect_equal({"dtype": sdtype, "is_leaf": leaf, "requires_grad": requires},
                             {"dtype": str(torch.float32), "is_leaf": True, "requires_grad": True},
                             f"{where}: the unit's shard")
                expect_close(value, shard, "the shard (this rank's 5 of the 10 flat padded elements)", where=where,
                             rtol=0, atol=0)
            with breaks("ex06.C.full"):
                expect_equal(dict(zip(("storage bytes", "dtype", "elements"), got["full"])),
                             {"storage bytes": 0, "dtype": str(dtype), "elements": 10},
                             f"{where}: the unit's full buffer when FlatStorage is built")
            with breaks("ex06.C.storage"):
                expect(got["handle"], f"{where}: FlatStorage.gather(0) returned an object without .wait()")
            with breaks("ex06.C.full"):
                expect_equal(got["views"], [True, True], f"{where}: the parameter's memory is the full buffer's",
                             keys="parameter (weight, bias)")
            nbytes, values = got["gathered"]
            with breaks("ex06.C.storage"):
                expect_equal(nbytes, 10 * dtype.itemsize, f"{where}: storage bytes of the full buffer after the gather")
                for name, v, p in zip(("weight", "bias"), values, params):
                    expect_close(v, p.detach().to(dtype).float(), f"the {name} after the gather", where=where,
                                 rtol=0, atol=0)
            tol = 1e-6 if dtype == torch.float32 else 5e-2
            for b, ((g, gdtype, nones), want) in enumerate(zip(got["grads"], grads)):
                what = "after one backward" if b == 0 else "after a second backward (the sum of both means)"
                with breaks("ex06.C.accumulate" if b else "ex06.C.reduce"):
                    expect(g is not None, f"{where}: the shard's .grad is None {what} and reduce(0)")
                    expect_equal(gdtype, str(torch.float32), f"{where}: the dtype of the shard's .grad {what}")
                    expect_close(g, want, f"the shard's .grad {what} and reduce(0) (the group's mean gradient, this "
                                 "rank's 5 elements)", where=where, rtol=tol, atol=tol)
                    expect_equal(nones, [True, True], f"{where}: the parameters' .grad is None {what} and reduce(0)",
                                 keys="parameter (weight, bias)")
            expect_equal(got["sent"], [[int(cost.collective_bytes("reduce_scatter", 10 * dtype.itemsize, 2))]] * 2,
                         f"{where}: bytes sent by reduce(0), each backward (one reduce-scatter of the 10 padded "
                         f"elements in {dtype}) (ex06.C.reduce)")
            with breaks("ex06.C.storage"):
                expect_equal(got["freed"], 0, f"{where}: storage bytes of the full buffer after free(0)")


@observes("ex06.*.train")
def test_stage3_trains_like_one_process(impl):
    """The library's FullyShardedDataParallel with your gather_unit/free_unit, reduce_shard and schedule: 2
    ranks train the GPT like one process, with the contract's bytes held per unit after the step and bytes
    sent."""
    results = minipar.launch(_stages, 2, args=([3],), timeout=TIMEOUT)
    want = _want()
    for rank, got in enumerate(results):
        got = got[3]
        expect_same_training(got, want, f"rank {rank}, ZeRO-3", rtol=1e-4, atol=5e-5)
        formula = cost.zero_bytes_per_rank(got["unit_sizes"], 2, 3, k=8, dtype_bytes=4)
        expect_equal({k: got["memory"][k] for k in formula}, formula,
                     f"rank {rank}, ZeRO-3: bytes held after the step, by kind", keys="kind")
        expect_equal(got["comm_bytes"], cost.zero_comm_bytes(got["unit_sizes"], 2, 3),
                     f"rank {rank}, ZeRO-3: bytes sent per run (cost.zero_comm_bytes)")


# ----------------------------------------------------------------------------- D: the schedule
N_UNITS, UNIT_BYTES = 3, 4 * 12                   # three nn.Linear(3, 3): 12 fp32 elements each
SCHEDULE_CASES = [(reshard, prefetch) for reshard in (True, False) for prefetch in (True, False)]


class _Waited:
    def __init__(self, i, log):
        self.i, self.log = i, log

    def wait(self):
        self.log.append(f"wait {self.i}")


class _Unit:
    def __init__(self, module):
        self.module, self.params = module, list(module.parameters())
        self.full = torch.empty(sum(p.numel() for p in self.params))


class _Recorder:
    """A Storage that moves nothing and writes down what the schedule asks of it."""

    def __init__(self, modules, log):
        self.units, self.log = [_Unit(m) for m in modules], log

    def gather(self, i, **labels):
        self.log.append(f"gather {i}")
        return _Waited(i, self.log)

    def use(self, i, gathered):
        self.log.append(f"use {i} {'gathered' if gathered else 'shards'}")

    def free(self, i):
        self.log.append(f"free {i}")

    def reduce(self, i):
        self.log.append(f"reduce {i}")


def _schedule_log(reshard, prefetch):
    """Two steps of two micro-batches over three units, and what the schedule did, in order:
    the storage's calls, each unit's forward starting ("F i") and returning ("F end i"), its
    output's gradient arriving ("B i"), each parameter's gradient ("grad i"), the markers."""
    torch.manual_seed(0)
    units = [torch.nn.Linear(3, 3) for _ in range(N_UNITS)]
    net = torch.nn.Sequential(units[0], torch.nn.Tanh(), units[1], torch.nn.Tanh(), units[2])
    log = []
    for i, u in enumerate(units):                  # before the schedule's hooks: they see a grad first
        for p in u.parameters():
            p.register_post_accumulate_grad_hook(lambda p, i=i: log.append(f"grad {i}"))
    schedule = UnitSchedule(_Recorder(units, log), net, prefetch=prefetch, reshard_after_forward=reshard)
    for i, u in enumerate(units):                  # after the schedule's: they see what it did
        u.register_forward_pre_hook(lambda m, a, i=i: log.append(f"F {i}"))
        u.register_forward_hook(lambda m, a, out, i=i: (log.append(f"F end {i}"),
                                                        out.register_hook(lambda g: log.append(f"B {i}"))) and None)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        for mb in range(2):
            log.append(f"micro-batch {mb}")
            net(x + step + mb).pow(2).sum().backward()
            log.append("backward ended")
        schedule.finish_step()
        log.append("finish_step returned")
    return log, schedule.peak_gathered_bytes


def _replay(log):
    """Each event with the units' states just after it: "freed", "in flight" (gather started,
    not waited on) or "gathered"; and whether each unit's module uses its gathered parameters."""
    state, used, out = ["freed"] * N_UNITS, [False] * N_UNITS, []
    for e in log:
        *kind, i = e.split()
        if kind == ["gather"]:
            state[int(i)] = "in flight"
        elif kind == ["wait"]:
            state[int(i)] = "gathered"
        elif kind == ["free"]:
            state[int(i)] = "freed"
        elif kind[:1] == ["use"]:
            used[int(kind[1])] = i == "gathered"
        out.append((e, list(state), list(used)))
    return out


def _segments(log, prefix):
    """The log cut before each event starting with ``prefix`` (what precedes the first dropped)."""
    cuts = [k for k, e in enumerate(log) if e.startswith(prefix)] + [len(log)]
    return [log[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _event(e):
    """("F", 2) from "F 2", ("F end", 2) from "F end 2", ("backward ended", None)."""
    *kind, i = e.split()
    return (" ".join(kind), int(i)) if i.isdigit() else (e, None)


def _cases():
    """For each case: its name, reshard, prefetch, the log, the first micro-batch replayed, the
    schedule's peak_gathered_bytes."""
    for reshard, prefetch in SCHEDULE_CASES:
        log, peak_bytes = _schedule_log(reshard, prefetch)
        first = _replay(log)[:log.index("backward ended") + 1]
        yield f"reshard_after_forward={reshard}, prefetch={prefetch}", reshard, prefetch, log, first, peak_bytes


@observes("ex06.D.use", "ex06.D.prefetch", "ex06.D.on_demand")
def test_schedule_gathers(impl):
    """Stage 3's schedule over a storage that records its calls (three units, two steps of two micro-batches,
    with and without reshard_after_forward and prefetch): what is gathered when each unit computes (the
    prefetch clause)."""
    for case, reshard, prefetch, log, first, _ in _cases():
        at = f"{case}, the first micro-batch"
        for e, state, used in first:
            kind, i = _event(e)
            if kind == "F":
                with breaks("ex06.D.use"):
                    expect_equal({"state": state[i], "in use": used[i]}, {"state": "gathered", "in use": True},
                                 f"{at}: unit {i} as its forward starts (a unit's forward runs only with its "
                                 "parameters gathered and in use)")
            elif kind == "F end":
                with breaks("ex06.D.use"):
                    expect_equal(used[i], False, f"{at}: unit {i} in use after its forward returned (its shards "
                                 "again once it returns)")
            elif kind == "B":
                with breaks("ex06.D.use"):
                    expect_equal(state[i], "gathered", f"{at}: unit {i} as its backward starts (its backward only "
                                 "with them gathered)")
        for e, state, _ in first:
            kind, i = _event(e)
            nxt = {"F": (i or 0) + 1, "B": (i or 0) - 1}.get(kind)
            if nxt is None or not 0 <= nxt < N_UNITS or (kind == "B" and not reshard):
                continue                              # without resharding a backward gathers nothing
            what = "forward" if kind == "F" else "backward"
            if prefetch:
                with breaks("ex06.D.prefetch"):
                    expect_equal(state[nxt], "in flight", f"{at}: unit {nxt} as unit {i}'s {what} starts (with "
                                 "``prefetch``, when a unit starts computing, the gather of the unit that computes next is "
                                 "already in flight, and nothing has waited for it)")
            else:
                with breaks("ex06.D.on_demand"):
                    expect_equal([j for j, s in enumerate(state) if s == "in flight"], [], f"{at}: units in flight as "
                                 f"unit {i}'s {what} starts (without it, a unit is gathered only when it computes)")


@observes("ex06.D.free", "ex06.D.free_again", "ex06.D.peak", "ex06.D.counted", "ex06.D.keep")
def test_schedule_frees(impl):
    """The same runs: when units are freed, the most units gathered at once, and peak_gathered_bytes."""
    for case, reshard, prefetch, log, first, peak_bytes in _cases():
        at = f"{case}, the first micro-batch"
        if reshard:
            reduced = []
            for e, state, _ in first:
                kind, i = _event(e)
                if kind == "F end":
                    with breaks("ex06.D.free"):
                        expect_equal(state[i], "freed", f"{at}: unit {i} after its forward returned (with "
                                     "``reshard_after_forward``, none is gathered once its forward has returned)")
                elif kind == "reduce":
                    reduced.append(i)
                elif kind in ("B", "backward ended"):
                    with breaks("ex06.D.free_again"):
                        expect_equal({j: state[j] for j in reduced}, dict.fromkeys(reduced, "freed"),
                                     f"{at}: the units reduce-scattered so far, at '{e}' (none is gathered once its "
                                     "gradients are reduce-scattered, nor once the backward has ended)", keys="unit")
            peak = max(sum(s != "freed" for s in state) for _, state, _ in first)
            with breaks("ex06.D.peak"):
                expect(peak <= (2 if prefetch else 1), f"{at}: {peak} units gathered at once (at any time at most two "
                       "units are gathered (one without prefetch))")
        else:
            step = _segments(log, "micro-batch 0")[0]
            before = step[:len(step) - step[::-1].index("backward ended")]     # finish_step's own come after
            with breaks("ex06.D.keep"):
                expect_equal({i: (before.count(f"gather {i}"), before.count(f"free {i}")) for i in range(N_UNITS)},
                             dict.fromkeys(range(N_UNITS), (1, 0)), f"{case}, the first step: (gathers, frees) of each "
                             "unit before finish_step (without it, a unit is gathered once per step, at its first "
                             "forward, and freed only by ``finish_step``)", keys="unit")
        peak = max(sum(s != "freed" for s in state) for _, state, _ in _replay(log))
        with breaks("ex06.D.counted"):
            expect_equal(peak_bytes, peak * UNIT_BYTES, f"{case}: the schedule's peak_gathered_bytes after two steps, "
                         f"its storage having held at most {peak} units of {UNIT_BYTES} bytes gathered at once (as "
                         "``peak_gathered_bytes`` counts)")


@observes("ex06.D.reduce", "ex06.D.deferred")
def test_schedule_reduces(impl):
    """The same runs: when, and how often, each unit is reduce-scattered."""
    for case, reshard, prefetch, log, first, _ in _cases():
        if reshard:
            at = f"{case}, the first micro-batch"
            mine = [e for e, _, _ in first if e.startswith(("grad", "reduce"))]
            with breaks("ex06.D.reduce"):
                expect_equal([i for kind, i in map(_event, mine) if kind == "reduce"], list(reversed(range(N_UNITS))),
                             f"{at}: the units reduce-scattered, in order (with resharding, each backward "
                             "reduce-scatters every unit's gradients once, after they are all in, in the reverse of this "
                             "forward's order)", keys="reduce-scatter")
                for i in range(N_UNITS):
                    expect_equal(mine[:mine.index(f"reduce {i}")].count(f"grad {i}"), 2, f"{at}: the parameter "
                                 f"gradients of unit {i} in before its reduce-scatter (after they are all in)")
        else:
            step = _segments(log, "micro-batch 0")[0]
            before = step[:len(step) - step[::-1].index("backward ended")]
            with breaks("ex06.D.deferred"):
                expect_equal([e for e in before if e.startswith("reduce")], [], f"{case}, the first step: "
                             "reduce-scatters before finish_step (without, none is reduce-scattered before ``finish_step``)")


@observes("ex06.D.repeat")
def test_schedule_repeats(impl):
    """The same runs: every later micro-batch (with resharding) and the second step (without)
    log the same calls as the first."""
    for case, reshard, prefetch, log, first, _ in _cases():
        if reshard:
            mbs = [s[1:s.index("backward ended")] for s in _segments(log, "micro-batch ")]
            for k, seg in enumerate(mbs[1:], 1):
                expect_equal(seg, mbs[0], f"{case}: micro-batch {k % 2} of step {k // 2}, against the first one "
                             "(every later micro-batch and step runs the schedule of the first)", keys="event")
        else:
            steps = _segments(log, "micro-batch 0")
            expect_equal(steps[1], steps[0], f"{case}: the second step, against the first (every later micro-batch "
                         "and step runs the schedule of the first)", keys="event")


# ----------------------------------------------------------------------------- D: on the real storage
class _Layer(torch.nn.Module):
    """tanh(Linear(4, 4)); ``spare``: one more parameter the forward never uses (no gradient, ever)."""

    def __init__(self, spare=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        if spare:
            self.spare = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return torch.tanh(self.lin(x))


REAL_UNITS = 4          # the last unit (the first one backward reaches) holds the spare parameter


def _real_schedule(prefetch):
    """Two steps of FullyShardedDataParallel over four units on the world of 2 ranks (the
    library's flat storage, your schedule): after each gather, how many units hold their full
    parameters (gathered or in flight); when unit 0's backward starts, the units whose shard
    holds a reduced gradient of this backward."""
    torch.manual_seed(0)
    layers = [_Layer(spare=i == REAL_UNITS - 1) for i in range(REAL_UNITS)]
    net = torch.nn.Sequential(*layers)
    fsdp = zero.shard_module(net, units=layers, prefetch=prefetch)
    storage = fsdp.schedule.storage
    held, reduced = [], []
    gather = storage.gather

    def counted(i, **labels):
        h = gather(i, **labels)
        held.append(sum(u.full.untyped_storage().nbytes() > 0 for u in storage.units))
        return h
    storage.gather = counted
    layers[0].register_forward_hook(lambda m, a, out: out.register_hook(
        lambda g: reduced.append([i for i, u in enumerate(storage.units) if u.shard.grad is not None])) and None)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        fsdp(x).pow(2).sum().backward()
        fsdp.finish_step()
        for u in storage.units:                    # as an optimizer's zero_grad(set_to_none=True)
            u.shard.grad = None
    return {"held": max(held), "reduced": reduced}


def _real_schedules():
    return {prefetch: attempt(_real_schedule, prefetch) for prefetch in (True, False)}


@observes("ex06.D.peak", "ex06.D.reduce")
def test_schedule_on_the_real_storage(impl):
    """Your schedule over the library's flat storage (2 ranks, four units, one parameter never gets a
    gradient), two steps: the most units holding their parameters at once, and the reductions done by the time
    unit 0's backward starts."""
    results = minipar.launch(_real_schedules, 2, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        for prefetch, got in res.items():
            where = f"rank {rank}, prefetch={prefetch}, unit {REAL_UNITS - 1} holding a parameter without a gradient"
            expect(not isinstance(got, str), f"{where}: the step {got}")
            limit = 2 if prefetch else 1
            # the reductions first: one held back (a unit never reached) also keeps units gathered
            with breaks("ex06.D.reduce"):
                expect_equal(got["reduced"], [[1, 2, 3]] * 2, f"{where}: the units whose shard holds its reduced "
                             "gradient when unit 0's backward starts (with resharding, each backward reduce-scatters every "
                             "unit's gradients once, after they are all in, in the reverse of this forward's order: "
                             "units 3, 2 and 1 come before unit 0)", keys="step")
            with breaks("ex06.D.peak"):
                expect(got["held"] <= limit, f"{where}: {got['held']} units held their full parameters at once "
                       f"(at any time at most two units are gathered (one without prefetch)), counted on the storage "
                       "after each gather")
