"""Communication in minipar: recorded point-to-point calls, ring/tree/halving-doubling collectives
built from them, and the backend's own collectives; all write ``comm`` events to :mod:`minipar.runtime.trace`."""
from .flat import all_reduce_gradients
from .native import all_gather, all_reduce, all_to_all_single, reduce_scatter
from .p2p import (Handle, exchange, global_rank, group_name, group_rank, group_size, irecv,
                  isend, name_group, recv, send, start_exchange)
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .tree import broadcast, halving_doubling_all_reduce

__all__ = ["send", "recv", "isend", "irecv", "exchange", "start_exchange", "Handle", "group_rank", "group_size",
           "global_rank", "name_group", "group_name", "ring_all_reduce", "ring_reduce_scatter",
           "ring_all_gather", "broadcast", "halving_doubling_all_reduce", "all_reduce",
           "reduce_scatter", "all_gather", "all_to_all_single", "all_reduce_gradients"]
