"""Planning at scale: predict memory and step time of a layout, and search for the best.

* :mod:`.models` — model shapes (GPT-3, Llama 3, Nemotron-4, Mixtral, the course GPT), with sources.
* :mod:`.hardware` — accelerators and clusters, with sources.
* :mod:`.layout` — one layout (dp, tp, pp, v, cp, ep, ZeRO with stage 3's policy and HSDP's split, b,
  recomputation, dtype) and its checks.
* :mod:`.memory` — memory per GPU by component (ZeRO, ZeRO-3 under a pipeline and HSDP, Korthikanti
  et al. 2022).
* :mod:`.roofline` — every operation of a layer at the rate its shape allows (GEMMs, attention
  flash or materialized, memory-bound operations, the optimizer step).
* :mod:`.overlap` — communication per dimension and how much of it the schedule hides.
* :mod:`.step_time` — compute from the roofline at the busiest stage's pace, the bubble, the exposed
  communication.
* :mod:`.predict` — :func:`predict` and the :class:`Prediction` breakdown.
* :mod:`.search` — :func:`search`: enumerate, reject with reasons, rank, explain.
* :mod:`.published` — published measurements the planner is validated against (Narayanan et al.'s
  Table 1, the fitting set; Korthikanti et al.'s Table 5, Llama 3's Table 4 and NVIDIA's measured
  H100 step times, never fitted).
* :mod:`.calibrate` — fit the roofline on published runs; α, β and the rates of this machine.
"""
from . import search as search_module
from .calibrate import fit_efficiency, fit_roofline, measure_machine
from .hardware import ACCELERATORS, CLUSTERS, Accelerator, Cluster, get_accelerator, get_cluster
from .layout import Layout, check, problems
from .memory import (comm_buffer_bytes, layer_activation_bytes, memory_per_gpu, model_state_bytes,
                     model_states_at_peak, zero3_states)
from .models import MODELS, ModelSpec, from_gpt_config, get_model
from .predict import Prediction, predict
from .roofline import Efficiency
from .search import SearchResult, layouts, search
from .step_time import comm_times, step_flops, step_time

__all__ = ["ACCELERATORS", "CLUSTERS", "Accelerator", "Cluster", "get_accelerator", "get_cluster", "Layout",
           "check", "problems", "memory_per_gpu", "model_state_bytes", "layer_activation_bytes",
           "comm_buffer_bytes", "model_states_at_peak", "zero3_states", "MODELS", "ModelSpec",
           "from_gpt_config", "get_model", "Prediction",
           "predict", "SearchResult", "search", "layouts", "step_time", "step_flops", "comm_times",
           "fit_efficiency", "fit_roofline", "measure_machine", "Efficiency"]
