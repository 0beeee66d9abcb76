"""Published measurements the planner is checked against, each with its source.

**Narayanan et al. 2021**, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC21, arXiv:2104.04473), Table 1 (weak scaling on Selene, A100 80GB, mixed
precision, full activation recomputation, sequence length 2048, vocabulary 51,200): parameters
(billions), heads, hidden size, layers, tensor-parallel size t, pipeline size p, GPUs, global
batch, achieved TFLOP/s per GPU (by their formula, 96·B·s·l·h²·(...)). The table gives no
micro-batch size or schedule; the planner assumes b = 1 and 1F1B (:func:`table1_layout`).

**Korthikanti et al. 2022**, "Reducing Activation Recomputation in Large Transformer Models"
(MLSys 2023, arXiv:2205.05198), §5: sequence parallelism and selective recomputation together
cut the activation memory about 5× (to about 20% of tensor parallelism alone's), and the cost
of recomputation falls from 36-39% (full) to 4-7% (selective) of the step (Table 4: 22B, +39%
full, +7% selective).
"""
from __future__ import annotations

from .layout import Layout
from .models import ModelSpec

#            params(B) heads hidden layers  t   p   GPUs  batch  TFLOP/s
TABLE1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
          (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
          (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
          (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
          (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
          (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
          (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
          (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
          (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
          (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
TABLE1_SOURCE = "Narayanan et al. 2021, arXiv:2104.04473, Table 1"

KORTHIKANTI_SELECTIVE_OVERHEAD = {"full": 0.39, "selective": 0.07}   # 22B, Table 4
KORTHIKANTI_SP_SELECTIVE_MEMORY = 0.2      # "5x" reduction, §1 and §6.1 (Figure 7)


def table1_model(row) -> ModelSpec:
    billions, a, h, l, *_ = row
    return ModelSpec(f"gpt-{billions}b", l, h, a, 51200, 2048, source=TABLE1_SOURCE)


def table1_layout(row, micro_batch: int = 1) -> tuple[Layout, int]:
    """(layout, global batch) of a Table 1 row: dp = GPUs/(t·p), full recomputation, fp16."""
    *_, t, p, gpus, batch, _tf = row
    return Layout(dp=gpus // (t * p), tp=t, pp=p, micro_batch=micro_batch, recompute="full",
                  dtype="fp16"), batch
