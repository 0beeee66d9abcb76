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
    "on a non-world group, ranks count within it": (
        [("    return reduce_shard(flat, flat_unit.group, **labels)", "    return reduce_shard(flat, None, **labels)")],
        g.test_reduce_unit_grads, r"rank \d \(rank \d of group \[\d, \d\]\), dtype=None: the call raised"),
    "holding the mean over the group's ranks of that slice": (
        [(RS, RS.replace('"avg"', '"sum"'))], g.test_reduce_shard, r"seen: the slice holds the sum over the 4 ranks"),
    "as a view of ``flat_grad`` (reduced in place, no copy)": (
        [(RS + "    return mine\n", RS + "    return mine.clone()\n")], g.test_reduce_shard,
        r"is not the view of flat_grad the contract names"),
    "each rank sends (N-1)/N of the unit's bytes": (
        [(RS, f'    {COMM}.all_reduce(flat_grad, op="avg", group=group, **labels)\n')], g.test_reduce_shard,
        r"bytes sent \(one reduce-scatter of 12 floats\)"),
    "a parameter without a gradient on this rank takes part as zeros": (
        [("    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in flat_unit.params]",
          "    grads = [p.grad for p in flat_unit.params if p.grad is not None]")],
        g.test_reduce_unit_grads, r"missing gradient count as 0"),
    "the result is in the dtype asked for": (
        [("flat_unit.flatten(grads, dtype=dtype)", "flat_unit.flatten(grads)")], g.test_reduce_unit_grads,
        r"dtype=torch.float64: the dtype of the reduced slice"),
    "a new tensor of k elements (the full flat gradient is not kept)": (
        [("**labels).clone()     # `flat` is freed", "**labels)")], g.test_reduce_unit_grads,
        r"bytes of the storage behind the returned slice"),
    "afterwards every parameter's ``.grad`` is None": (
        [("    for p in flat_unit.params:\n        p.grad = None\n", "")], g.test_reduce_unit_grads,
        r"each parameter's \.grad is None afterwards"),
    "hold the parameters of one full optimizer step on the mean gradient": (
        [(GATHER_STEP, "        pass")], g.test_sharded_step_is_a_full_step,
        r"rank \d, fp32, unit \d: full parameters after the step"),
    "the optimizer only ever saw (and kept state for) this rank's slices": (   # a whole copy on every rank
        [(SHARD, "            shard = master.clone() if self.mixed else flat"),
         (STEP, f'        self._step([({COMM}.all_reduce(g, op="avg", group=self.group), g)[1] for g in self.flat_grads])'),
         (GATHER_STEP, "        f.copy_(s.detach())")],
        g.test_zero_optimizer, r"fp32, Adam: elements of optimizer state"),
    "each tensor keeps its own dtype": (
        [("        s.grad = g if g.dtype == s.dtype else g.to(s.dtype)", "        s.grad = g"),
         (GATHER_STEP, "        all_gather(f, s.detach(), group=group)")],
        g.test_sharded_step_is_a_full_step, r"bf16 flat parameters and gradient slices, fp32 shards: sharded_step: "
                                            r"the call raised"),
    "the model's parameters become views into the flat parameters, in ``param_dtype``": (
        [("            u.use(flat)\n", "")], g.test_zero_optimizer,
        r"fp32, Adam: the parameter's memory is one of opt\.flat_params'"),
    "``step()`` equals the wrapped optimizer's step on the mean gradient over the group": (
        [(STEP, "        self._step([u.shard_of(g) for u, g in zip(self.units, self.flat_grads)])")],
        g.test_zero_optimizer, r"fp32, Adam: parameter w after step 1"),
    "clipped by its global norm with ``max_grad_norm``": (
        [("        if self.max_grad_norm is not None:\n            self.grad_norm = clip_grad_norm_(grad_shards, "
          "self.max_grad_norm, self.group)\n", "")],
        g.test_zero_optimizer, r"SGD, max_grad_norm=0\.5: parameter w after step 1"),
    "after a bf16 step no fp32 gradient copy is left on the shards": (
        [("        if self.mixed:\n            for s in self.shards:\n                s.grad = None", "        if False:\n"
          "            for s in self.shards:\n                s.grad = None")],
        g.test_zero_optimizer, r"bfloat16, Adam: the shards' \.grad is None after step 1"),
    "a second step after the first (another gradient) is as exact as the first": (
        [(STEP, '        self._first = getattr(self, "_first", None) or [reduce_shard(g, self.group) for g in '
          'self.flat_grads]\n        self._step(self._first)')],
        g.test_zero_optimizer, r"fp32, Adam: parameter \w after step 2"),
    "``free_unit`` releases the memory of ``full`` but keeps the tensor, its shape and every view into it": (
        [("    full.untyped_storage().resize_(0)\n", "    full.zero_()\n")], g.test_gather_and_free,
        r"storage bytes after free_unit: expected 0"),
    "every rank's ``shard`` in rank order again, in ``full``'s dtype": (
        [("shard.detach().to(full.dtype), group=group, async_op", "shard.detach(), group=group, async_op")],
        g.test_gather_and_free, r"a torch\.bfloat16 buffer, fp32 shards: the call raised"),
    "with ``async_op`` it returns the collective's Handle, else None": (
        [("group=group, async_op=async_op, **labels)", "group=group, async_op=False, **labels)")],
        g.test_gather_and_free, r"returned an object without \.wait\(\)"),
    "keeps a leaf fp32 shard": (
        [("self.shard = nn.Parameter(self.flat.shard_of(master).clone())",
          "self.shard = nn.Parameter(self.flat.shard_of(master).to(dtype))")],
        g.test_flat_storage, r"dtype=torch\.bfloat16: the (unit's shard|call raised RuntimeError: attempting to assign a gradient)"),
    "a ``full`` buffer of N·k elements in ``dtype`` that the parameters are views of, its memory freed from the start": (
        [("        self.flat.use(self.full)\n", "")], g.test_flat_storage, r"the parameter's memory is the full buffer's"),
    "``FlatStorage.gather(i)`` returns the Handle of unit i's gather, ``free(i)`` releases it": (
        [("        free_unit(self.units[i].full)\n", "        pass\n")], g.test_flat_storage,
        r"storage bytes of the full buffer after free\(0\)"),
    "adds this rank's mean gradient slice, in fp32, to the shard's ``.grad``": (
        [("dtype=self.dtype, unit=i).to(torch.float32)", "dtype=self.dtype, unit=i)")], g.test_flat_storage,
        r"dtype=torch\.bfloat16: the call raised"),
    "a second backward before the step accumulates": (
        [("        u.shard.grad = g if u.shard.grad is None else u.shard.grad.add_(g)", "        u.shard.grad = g")],
        g.test_flat_storage, r"after a second backward"),
    "a unit's forward runs only with its parameters gathered and in use (its shards again once it returns), its "
    "backward only with them gathered": (
        [("        self.storage.use(i, True)\n", "")], g.test_schedule_gathers,
        r"prefetch=True, the first micro-batch: unit 0 as its forward starts \(a unit's forward runs only"),
    "with ``prefetch``, the gather of the unit that computes next (the next one in a forward, the one before in a "
    "backward) starts before this one computes, without waiting for it": (
        [('self.gather(i + 1, wait=False, phase="forward", prefetch=True)',
          'self.gather(i + 1, wait=True, phase="forward", prefetch=True)')], g.test_schedule_gathers,
        r"prefetch=True, the first micro-batch: unit 1 as unit 0's forward starts \(with ``prefetch``"),
    "without it, a unit is gathered only when it computes": (
        [("        if self.prefetch and i + 1 < len(self.units):", "        if i + 1 < len(self.units):")],
        g.test_schedule_gathers, r"prefetch=False, the first micro-batch: units in flight as unit 0's forward starts"),
    "with ``reshard_after_forward``, a unit is freed when its forward returns": (
        [("        if self.reshard:\n            self.free(i)\n        for t in", "        for t in")],
        g.test_schedule_frees, r"unit 0 after its forward returned \(with ``reshard_after_forward``"),
    "and again when its gradients are reduce-scattered": (
        [("        self.free(i)\n        self.storage.reduce(i)", "        self.storage.reduce(i)")],
        g.test_schedule_frees, r"the units reduce-scattered so far, at 'B 1' \(and again when its gradients"),
    "at most two units are gathered at once (one without prefetch)": (   # two units prefetched in a backward
        [('            self.gather(self.order[pos - 1], wait=False, phase="backward", prefetch=True)',
          '            self.gather(self.order[pos - 1], wait=False, phase="backward", prefetch=True)\n'
          '            if pos > 1:\n'
          '                self.gather(self.order[pos - 2], wait=False, phase="backward", prefetch=True)')],
        g.test_schedule_frees, r"prefetch=True, the first micro-batch: 3 units gathered at once \(at most two"),
    "as ``peak_gathered_bytes`` counts": (   # the storage freed behind the schedule's back
        [("        if self.reshard:\n            self.free(i)\n        for t in",
          "        if self.reshard:\n            self.storage.free(i)\n        for t in")],
        g.test_schedule_frees, r"the schedule's peak_gathered_bytes after two steps"),
    "without it, a unit is gathered once per step, at its first forward, and freed only by ``finish_step``": (
        [("        if self.reshard:\n            for i in range(len(self.units)):\n                self.free(i)\n"
          "        else:                                              # the next micro-batch's backward\n",
          "        for i in range(len(self.units)):\n            self.free(i)\n        if not self.reshard:\n")],
        g.test_schedule_frees, r"reshard_after_forward=False, prefetch=True, the first step: \(gathers, frees\)"),
    "with resharding, each backward reduce-scatters every unit's gradients once, after they are all in, in the "
    "reverse of this forward's order": (
        [("            self.reduction.grad_ready(i, p)", "            self.reduce(i)")], g.test_schedule_reduces,
        r"the units reduce-scattered, in order \(with resharding"),
    "without, none is reduce-scattered before ``finish_step``": (
        [("        if self.reshard:                                   # else: accumulated until finish_step\n"
          "            self.reduction.grad_ready(i, p)", "        self.reduction.grad_ready(i, p)")],
        g.test_schedule_reduces, r"reshard_after_forward=False, prefetch=True, the first step: reduce-scatters before"),
    "every later micro-batch and step runs the schedule of the first": (
        [("        self.storage.reduce(i)\n        self.bw[i] = False", "        self.storage.reduce(i)")],
        g.test_schedule_repeats, r"micro-batch 1 of step 0, against the first one"),
    "train the GPT with the library's ZeRO stages 1, 2 and 3": (
        [(RS, RS.replace('"avg"', '"sum"'))], g.test_stage3_trains_like_one_process, r"rank \d, ZeRO-3"),
}


test_every_clause_is_planted, test_planted_answer_fails = contract_tests("ex06", g, PLANTS)
