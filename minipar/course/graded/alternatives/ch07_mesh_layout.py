"""Challenge 07, another way: reason from which dimension is cheapest in bytes.

A pipeline stage boundary sends one activation per micro-batch, far less than tensor
parallelism's all-reduces in every layer, and it divides the model states as well as tp does;
its price is the bubble. So: the deepest pipeline the bubble allows ((p-1)/m <= 0.5),
then the least tp that makes the model states fit, and data parallelism for the rest. The
model's own limits (heads divisible by tp, layers by pp) come from ``hybrid.valid_configs``."""
from minipar import cost


from minipar import hybrid
def layout(config, world_size, batch_size, microbatches, memory_per_rank):
    psi = hybrid.num_params(config)
    valid = hybrid.valid_configs(config, world_size, batch_size, microbatches)
    for pp in sorted({c["pp"] for c in valid}, reverse=True):
        if cost.bubble_fraction("1f1b", pp, microbatches) > 0.5:
            continue
        for c in sorted((c for c in valid if c["pp"] == pp), key=lambda c: c["tp"]):
            if cost.hybrid_memory_per_rank(psi, c["dp"], pp, c["tp"])["total"] <= memory_per_rank:
                return c
    raise ValueError("nothing meets the memory and bubble goals")
