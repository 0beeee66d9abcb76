"""Challenge 10, another way: prune by reasoning, then compare the few that are left.

Tensor parallelism stays inside a node (it communicates every layer); ZeRO-1 shards the
optimizer state for free; selective recomputation removes the attention scores for a few
percent of FLOPs (none where memory allows, full as the fallback when it is tight); the
micro-batch is 1 (long sequences) or 2. What remains is the split of the GPUs between tp, pp
and cp (dp takes the rest), with v = 1, 2 or 4: a few hundred candidates, each predicted."""
import itertools

from minipar import plan


def choose(model, cluster, nodes, global_batch, seq_len):
    per_node = plan.CLUSTERS[cluster].gpus_per_node
    n = nodes * per_node
    powers = [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= n]
    best = None
    for tp, pp, cp in itertools.product([t for t in powers if t <= per_node], powers, powers[:5]):
        if n % (tp * pp * cp):
            continue
        for rc, b, v in itertools.product(("none", "selective", "full"), (1, 2), (1, 2, 4) if pp > 1 else (1,)):
            lay = plan.Layout(dp=n // (tp * pp * cp), tp=tp, pp=pp, cp=cp, zero=1, micro_batch=b,
                              recompute=rc, v=v, schedule="interleaved" if v > 1 else "1f1b")
            try:
                p = plan.predict(model, cluster, lay, global_batch, seq_len, nodes=nodes)
            except ValueError:
                continue
            if p.fits and (best is None or p.step_time < best[0]):
                best = (p.step_time, lay)
    return best[1]
