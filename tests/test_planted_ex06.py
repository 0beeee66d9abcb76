"""ex06's contract has no hole: for every clause of CONTRACT, an answer that breaks it (the
solution with a line or two changed) fails the clause's graded test, with a message naming it.
The answer that ignores each tensor's dtype (once 5/5) is among them."""

from minipar.course.graded import test_ex06_zero as g
from tests.planted import contract_tests

RS = '    reduce_scatter(mine, flat_grad, op="avg", group=group, **labels)\n'
GATHER_STEP = "        all_gather(f, s.detach().to(f.dtype), group=group)      # in place for the fp32 view"
STEP = "        self._step([reduce_shard(g, self.group) for g in self.flat_grads])"
SHARD = "            shard = u.shard_of(master).clone() if self.mixed else u.shard_of(flat)"
COMM = '__import__("minipar").comm'
PLANTS = {  # clause -> (edits, graded test, what the message must name)
    "ex06.*.group": (
        [("    return reduce_shard(flat, flat_unit.group, **labels)", "    return reduce_shard(flat, None, **labels)")],
        g.test_reduce_unit_grads, r"rank \d \(rank \d of group \[\d, \d\]\), dtype=None: the call raised"),
    "ex06.A.mean": (
        [(RS, RS.replace('"avg"', '"sum"'))], g.test_reduce_shard, r"seen: the slice holds the sum over the 4 ranks"),
    "ex06.A.memory": (
        [(RS + "    return mine\n", RS + "    return mine.clone()\n")], g.test_reduce_shard,
        r"is not the view of flat_grad the contract names"),
    "ex06.A.bytes": (
        [(RS, f'    {COMM}.all_reduce(flat_grad, op="avg", group=group, **labels)\n')], g.test_reduce_shard,
        r"bytes sent \(one reduce-scatter of 12 floats\)"),
    "ex06.*.recorded": (   # the right values, through torch.distributed: nothing recorded
        [(RS, '    __import__("torch").distributed.all_reduce(flat_grad, group=group); flat_grad.div_(n)\n')],
        g.test_reduce_shard, r"bytes sent"),
    "ex06.A.zeros": (
        [("    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in flat_unit.params]",
          "    grads = [p.grad for p in flat_unit.params if p.grad is not None]")],
        g.test_reduce_unit_grads, r"missing gradient count as 0"),
    "ex06.A.dtype": (
        [("flat_unit.flatten(grads, dtype=dtype)", "flat_unit.flatten(grads)")], g.test_reduce_unit_grads,
        r"dtype=torch.float64: the dtype of the reduced slice"),
    "ex06.A.fresh": (
        [("**labels).clone()     # `flat` is freed", "**labels)")], g.test_reduce_unit_grads,
        r"bytes of the storage behind the returned slice"),
    "ex06.A.cleared": (
        [("    for p in flat_unit.params:\n        p.grad = None\n", "")], g.test_reduce_unit_grads,
        r"each parameter's \.grad is None afterwards"),
    "ex06.B.full_step": (
        [(GATHER_STEP, "        pass")], g.test_sharded_step_is_a_full_step,
        r"rank \d, fp32, unit \d: full parameters after the step"),
    "ex06.B.state": (   # a whole copy on every rank
        [(SHARD, "            shard = master.clone() if self.mixed else flat"),
         (STEP, f'        self._step([({COMM}.all_reduce(g, op="avg", group=self.group), g)[1] for g in self.flat_grads])'),
         (GATHER_STEP, "        f.copy_(s.detach())")],
        g.test_zero_optimizer, r"fp32, Adam: elements of optimizer state"),
    "ex06.B.dtypes": (
        [("        s.grad = g if g.dtype == s.dtype else g.to(s.dtype)", "        s.grad = g"),
         (GATHER_STEP, "        all_gather(f, s.detach(), group=group)")],
        g.test_sharded_step_is_a_full_step, r"bf16 flat parameters and gradient slices, fp32 shards: sharded_step: "
                                            r"the call raised"),
    "ex06.B.views": (
        [("            u.use(flat)\n", "")], g.test_zero_optimizer,
        r"fp32, Adam: the parameter's memory is one of opt\.flat_params'"),
    "ex06.B.step": (
        [(STEP, "        self._step([u.shard_of(g) for u, g in zip(self.units, self.flat_grads)])")],
        g.test_zero_optimizer, r"fp32, Adam: parameter w after step 1"),
    "ex06.B.clip": (
        [("        if self.max_grad_norm is not None:\n            self.grad_norm = clip_grad_norm_(grad_shards, "
          "self.max_grad_norm, self.group)\n", "")],
        g.test_zero_optimizer, r"SGD, max_grad_norm=0\.5: parameter w after step 1"),
    "ex06.B.no_copy": (
        [("        if self.mixed:\n            for s in self.shards:\n                s.grad = None", "        if False:\n"
          "            for s in self.shards:\n                s.grad = None")],
        g.test_zero_optimizer, r"bfloat16, Adam: the shards' \.grad is None after step 1"),
    "ex06.B.second": (
        [(STEP, '        self._first = getattr(self, "_first", None) or [reduce_shard(g, self.group) for g in '
          'self.flat_grads]\n        self._step(self._first)')],
        g.test_zero_optimizer, r"fp32, Adam: parameter \w after step 2"),
    "ex06.C.free": (
        [("    full.untyped_storage().resize_(0)\n", "    full.zero_()\n")], g.test_gather_and_free,
        r"storage bytes after free_unit: expected 0"),
    "ex06.C.gather": (
        [("shard.detach().to(full.dtype), group=group, async_op", "shard.detach(), group=group, async_op")],
        g.test_gather_and_free, r"a torch\.bfloat16 buffer, fp32 shards: the call raised"),
    "ex06.C.async": (
        [("group=group, async_op=async_op, **labels)", "group=group, async_op=False, **labels)")],
        g.test_gather_and_free, r"returned an object without \.wait\(\)"),
    "ex06.C.shard": (
        [("self.shard = nn.Parameter(self.flat.shard_of(master).clone())",
          "self.shard = nn.Parameter(self.flat.shard_of(master).to(dtype))")],
        g.test_flat_storage, r"dtype=torch\.bfloat16: the (unit's shard|call raised RuntimeError: attempting to assign a gradient)"),
    "ex06.C.full": (
        [("        self.flat.use(self.full)\n", "")], g.test_flat_storage, r"the parameter's memory is the full buffer's"),
    "ex06.C.storage": (
        [("        free_unit(self.units[i].full)\n", "        pass\n")], g.test_flat_storage,
        r"storage bytes of the full buffer after free\(0\)"),
    "ex06.C.reduce": (
        [("dtype=self.dtype, unit=i).to(torch.float32)", "dtype=self.dtype, unit=i)")], g.test_flat_storage,
        r"dtype=torch\.bfloat16: the call raised"),
    "ex06.C.accumulate": (
        [("        u.shard.grad = g if u.shard.grad is None else u.shard.grad.add_(g)", "        u.shard.grad = g")],
        g.test_flat_storage, r"after a second backward"),
    "ex06.D.use": (
        [("        self.storage.use(i, True)\n", "")], g.test_schedule_gathers,
        r"prefetch=True, the first micro-batch: unit 0 as its forward starts \(a unit's forward runs only"),
    "ex06.D.prefetch": (
        [('self.gather(i + 1, wait=False, phase="forward", prefetch=True)',
          'self.gather(i + 1, wait=True, phase="forward", prefetch=True)')], g.test_schedule_gathers,
        r"prefetch=True, the first micro-batch: unit 1 as unit 0's forward starts \(with ``prefetch``"),
    "ex06.D.on_demand": (
        [("        if self.prefetch and i + 1 < len(self.units):", "        if i + 1 < len(self.units):")],
        g.test_schedule_gathers, r"prefetch=False, the first micro-batch: units in flight as unit 0's forward starts"),
    "ex06.D.free": (
        [("        if self.reshard:\n            self.free(i)\n        for t in", "        for t in")],
        g.test_schedule_frees, r"unit 0 after its forward returned \(with ``reshard_after_forward``"),
    "ex06.D.free_again": (
        [("        self.free(i)\n        self.storage.reduce(i)", "        self.storage.reduce(i)")],
        g.test_schedule_frees, r"the units reduce-scattered so far, at 'B 1' \(none is gathered once its gradients"),
    "ex06.D.peak": (   # two units prefetched in a backward
        [('            self.gather(self.order[pos - 1], wait=False, phase="backward", prefetch=True)',
          '            self.gather(self.order[pos - 1], wait=False, phase="backward", prefetch=True)\n'
          '            if pos > 1:\n'
          '                self.gather(self.order[pos - 2], wait=False, phase="backward", prefetch=True)')],
        g.test_schedule_frees, r"prefetch=True, the first micro-batch: 3 units gathered at once \(at any time at most two"),
    "ex06.D.counted": (   # the storage freed behind the schedule's back
        [("        if self.reshard:\n            self.free(i)\n        for t in",
          "        if self.reshard:\n            self.storage.free(i)\n        for t in")],
        g.test_schedule_frees, r"the schedule's peak_gathered_bytes after two steps"),
    "ex06.D.keep": (
        [("        if self.reshard:\n            for i in range(len(self.units)):\n                self.free(i)\n"
          "        else:                                              # the next micro-batch's backward\n",
          "        for i in range(len(self.units)):\n            self.free(i)\n        if not self.reshard:\n")],
        g.test_schedule_frees, r"reshard_after_forward=False, prefetch=True, the first step: \(gathers, frees\)"),
    "ex06.D.reduce": (
        [("            self.reduction.grad_ready(i, p)", "            self.reduce(i)")], g.test_schedule_reduces,
        r"the units reduce-scattered, in order \(with resharding"),
    "ex06.D.deferred": (
        [("        if self.reshard:                                   # else: accumulated until finish_step\n"
          "            self.reduction.grad_ready(i, p)", "        self.reduction.grad_ready(i, p)")],
        g.test_schedule_reduces, r"reshard_after_forward=False, prefetch=True, the first step: reduce-scatters before"),
    "ex06.D.repeat": (
        [("        self.storage.reduce(i)\n        self.bw[i] = False", "        self.storage.reduce(i)")],
        g.test_schedule_repeats, r"micro-batch 1 of step 0, against the first one"),
    "ex06.*.train": (
        [(RS, RS.replace('"avg"', '"sum"'))], g.test_stage3_trains_like_one_process, r"rank \d, ZeRO-3"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex06", g, PLANTS)


def test_a_step_that_does_not_repoint_the_gradients_fails(tmp_path):
    """A step that reduces self.flat_grads without pointing the parameters' .grad back into them: after the
    model's own zero_grad (set_to_none) the backward writes new .grad tensors and the step misses them."""
    from tests.planted import fails, planted
    with planted("ex06", tmp_path, ("        self._point_grads()\n" + STEP, STEP)):
        fails(g.test_zero_optimizer, match=r"fp32, Adam: parameter \w after step 2 .*the model's zero_grad\(\) before "
              r"its backward(.*\n)*  breaks ex06\.B\.second")


def test_a_reduce_that_drops_the_labels_fails(tmp_path):
    """reduce_shard that does not pass its ``**labels`` on: the reduce-scatter is right and recorded, but
    not under the unit it was asked for."""
    from tests.planted import fails, planted
    with planted("ex06", tmp_path, ('    reduce_scatter(mine, flat_grad, op="avg", group=group, **labels)',
                                    '    reduce_scatter(mine, flat_grad, op="avg", group=group)')):
        fails(g.test_reduce_shard, match=r"the label unit=5 given to reduce_shard(.*\n)*  breaks ex06\.A\.bytes")
