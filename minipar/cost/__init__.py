"""Analytical models that the course compares its measurements against: one function per
formula, each citing its source, one module per family (collectives, data, tensor, pipeline,
context and expert parallelism, ZeRO, hybrid layouts, FLOPs, recomputation).
"""
from .collectives import (OPS, alpha_beta_time, bus_bandwidth, collective_bytes, collective_steps,
    fit_alpha_beta)
from .expert_parallel import (ep_all_to_all_bytes, ep_bytes_received, ep_bytes_routed, ep_memory_per_rank,
    moe_flops_per_token, moe_params)
from .data_parallel import ddp_bytes_per_step, ddp_comm_time, ddp_step_time, expected_staleness
from .hybrid import hybrid_comm_bytes, hybrid_memory_per_rank
from .pipeline import bubble_fraction, peak_activations, pipeline_time
from .tensor_parallel import activation_bytes_per_layer, activation_terms, tp_comm_bytes_per_layer
from .zero import hsdp_comm_bytes, zero3_pipeline_comm_bytes, zero3_pipeline_peak_bytes, zero_bytes_per_rank, zero_comm_bytes
from .context_parallel import (attention_blocks_per_rank, attention_flops_per_rank, cp_activation_bytes,
    cp_comm_bytes, cp_imbalance)
from .flops import (checkpoint_recompute_flops, layer_forward_flops, narayanan_flops, recompute_flops,
    training_flops)
from .recompute import recompute_activation_bytes

__all__ = ["OPS", "collective_bytes", "collective_steps", "alpha_beta_time", "fit_alpha_beta",
           "bus_bandwidth", "ddp_bytes_per_step", "ddp_comm_time", "ddp_step_time", "expected_staleness",
           "bubble_fraction", "peak_activations", "pipeline_time", "activation_bytes_per_layer",
           "activation_terms", "tp_comm_bytes_per_layer", "zero_bytes_per_rank", "zero_comm_bytes",
           "zero3_pipeline_comm_bytes", "zero3_pipeline_peak_bytes", "hsdp_comm_bytes",
           "hybrid_comm_bytes", "hybrid_memory_per_rank", "checkpoint_recompute_flops", "layer_forward_flops",
           "narayanan_flops", "recompute_flops", "training_flops", "recompute_activation_bytes"]
