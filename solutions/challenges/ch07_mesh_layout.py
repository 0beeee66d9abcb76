"""Challenge 07, one way: measure every valid configuration with the cost model.

Filter by the two hard goals (memory, bubble), then take the fewest bytes: the cost functions
are cheap, and the configurations of 8 ranks are a handful."""
from minipar import cost


from minipar import hybrid
def layout(config, world_size, batch_size, microbatches, memory_per_rank):
    psi, best = hybrid.num_params(config), None
    for c in hybrid.valid_configs(config, world_size, batch_size, microbatches):
        dp, pp, tp = c["dp"], c["pp"], c["tp"]
        if cost.hybrid_memory_per_rank(psi, dp, pp, tp)["total"] > memory_per_rank:
            continue
        if cost.bubble_fraction("1f1b", pp, microbatches) > 0.5:
            continue
        sent = cost.hybrid_comm_bytes(psi, config.n_layer, dp, pp, tp, batch_size, config.block_size,
                                      config.n_embd, microbatches)["total"]
        if best is None or sent < best[0]:
            best = (sent, c)
    return best[1]
