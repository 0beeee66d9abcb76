"""Challenge 02, one way: DDP's buckets (Li et al. 2020, §3.2). Parameters in reverse order
(the order backward finishes them) fill buckets of at most CAP bytes; when a bucket's last
gradient arrives its flat buffer is all-reduced asynchronously, in bucket order, while the
backward goes on. Only the last bucket (the embeddings and the first layer's start) is left
exposed."""
import torch

from minipar import comm

CAP = 24 * 1024   # bytes per bucket


class GradSync:
    def __init__(self, model, group=None):
        self.group = group
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets, size = [[]], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and size + nbytes > CAP:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.where = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                        for b in self.buckets]
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)
        self._reset()

    def _reset(self):
        self.missing = [len(b) for b in self.buckets]
        self.next, self.handles = 0, []

    def _slot(self, i, p):
        offset = 0
        for q in self.buckets[i]:
            if q is p:
                return self.buffers[i][offset:offset + p.numel()]
            offset += q.numel()

    def _ready(self, p):
        i = self.where[id(p)]
        self._slot(i, p).copy_(p.grad.reshape(-1))
        self.missing[i] -= 1
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self.handles.append(comm.all_reduce(self.buffers[self.next], op="avg", group=self.group,
                                                async_op=True, name="ch02_bucket"))
            self.next += 1

    def finish(self):
        for i, b in enumerate(self.buckets):            # parameters without a gradient: zeros
            for p in b:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                    self._slot(i, p).zero_()
                    self.missing[i] -= 1
        self.missing = [0] * len(self.buckets)
        self._ready_rest()
        for h in self.handles:
            h.wait()
        for i, b in enumerate(self.buckets):
            for p in b:
                p.grad.copy_(self._slot(i, p).view_as(p))
        self._reset()

    def _ready_rest(self):
        while self.next < len(self.buckets):
            self.handles.append(comm.all_reduce(self.buffers[self.next], op="avg", group=self.group,
                                                async_op=True, name="ch02_bucket"))
            self.next += 1
