"""Accelerators and clusters the planner knows, each with its source; add your own.

An :class:`Accelerator` is a peak rate (dense 16-bit tensor-core FLOP/s, no sparsity), a memory
(HBM, in bytes: where known, what the driver reports, ``nvidia-smi``'s MiB; "80 GB" on an H100 is
81,559 MiB, 85.5e9 bytes, not 80e9) with its bandwidth (bytes/s: the roofline's slope, :mod:`minipar.plan.roofline`), and its
link's bandwidth to the node's other GPUs (bytes/s per direction). A
:class:`Cluster` is nodes of such GPUs joined by a network, with each GPU's share of it (bytes/s
per direction) and α, the latency of one message, per level::

    ACCELERATORS["mine"] = Accelerator("mine", 400e12, 96e9, 200e9, "my link", hbm_bw=3e12,
                                       source="my datasheet")
    CLUSTERS["mine"] = Cluster("mine", "mine", gpus_per_node=8, nodes=16, network_bw=50e9)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

GB = 1e9
MiB = 2 ** 20


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float        # dense bf16 (fp16 where the chip has no bf16) FLOP/s
    hbm: float               # bytes
    link_bw: float           # bytes/s per direction to another GPU of the node
    link: str = "NVLink"
    source: str = field(default="", compare=False)
    layer_overhead: float = 0.0   # seconds per layer forward+backward beyond its FLOPs (CPU: op dispatch)
    hbm_bw: float = 2e12          # bytes/s of its memory (HBM; a CPU's DRAM as measured)
    kind: str = "gpu"             # "gpu" (fused attention by default) or "cpu"
    sms: int = 0                  # streaming multiprocessors (compute units): GEMM wave quantization
    efficiency: object = field(default=None, compare=False)   # roofline.Efficiency (None: the Table 1 fit)


@dataclass(frozen=True)
class Cluster:
    name: str
    accelerator: str | Accelerator
    gpus_per_node: int
    nodes: int
    network_bw: float                 # bytes/s per GPU per direction between nodes
    alpha_intra: float = 5e-6         # seconds per message step inside a node
    alpha_inter: float = 10e-6        # ... between nodes
    network: str = "InfiniBand"
    source: str = field(default="", compare=False)
    call_overhead: float = 0.0        # seconds of software per collective or message call (CPU: ~ms)
    cores: int = 0                    # CPU cores the ranks share (0: a device per rank)
    background: float = 0.0           # runnable threads of other work on those cores (load average)

    @property
    def gpu(self) -> Accelerator:
        return get_accelerator(self.accelerator)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def link(self, group_span: int) -> tuple[float, float]:
        """(α, β) of a group whose ranks span ``group_span`` consecutive GPUs: inside a
        node when it fits in one, else the network (β = 1/bandwidth, seconds per byte)."""
        if group_span <= self.gpus_per_node:
            return self.alpha_intra, 1 / self.gpu.link_bw
        return self.alpha_inter, 1 / self.network_bw

    def with_nodes(self, nodes: int) -> "Cluster":
        return replace(self, nodes=nodes)


_SMI = ("the total nvidia-smi reports (MiB): H100 80GB HBM3 81559, A100 80GB 81920, A100 40GB 40960, "
        "L4 23034, T4 15360 (modal-labs/modal-client#2797; H100 also wilicc/gpu-burn#114); the others: "
        "the datasheet's GB")

ACCELERATORS: dict[str, Accelerator] = {
    "T4": Accelerator("T4", 65e12, 15360 * MiB, 16e9, "PCIe 3.0 x16", sms=40, hbm_bw=320e9,
                      source="NVIDIA T4 datasheet (fp16 tensor cores; no bf16; GDDR6 320 GB/s); memory: " + _SMI),
    "V100": Accelerator("V100", 125e12, 32 * GB, 150e9, "NVLink 2", sms=80, hbm_bw=900e9,
                        source="NVIDIA V100 SXM2 datasheet (fp16 tensor cores; HBM2 900 GB/s; "
                               "NVLink 300 GB/s both directions)"),
    "L4": Accelerator("L4", 121e12, 23034 * MiB, 32e9, "PCIe 4.0 x16", sms=58, hbm_bw=300e9,
                      source="NVIDIA L4 datasheet (242 TFLOP/s with sparsity; GDDR6 300 GB/s); memory: " + _SMI),
    "A100-40GB": Accelerator("A100-40GB", 312e12, 40960 * MiB, 300e9, "NVLink 3", sms=108, hbm_bw=1555e9,
                             source="NVIDIA A100 datasheet (SXM4 40GB; HBM2 1,555 GB/s); memory: " + _SMI),
    "A100": Accelerator("A100", 312e12, 81920 * MiB, 300e9, "NVLink 3", sms=108, hbm_bw=2039e9,
                        source="NVIDIA A100 datasheet (SXM4 80GB; 108 SMs; HBM2e 2,039 GB/s; NVLink 600 GB/s "
                               "both directions); memory: " + _SMI),
    "H100": Accelerator("H100", 989e12, 81559 * MiB, 450e9, "NVLink 4", sms=132, hbm_bw=3.35e12,
                        source="NVIDIA H100 datasheet (SXM5; 132 SMs; HBM3 3.35 TB/s; NVLink 900 GB/s both directions); "
                               "memory: " + _SMI),
    "H200": Accelerator("H200", 989e12, 141 * GB, 450e9, "NVLink 4", sms=132, hbm_bw=4.8e12,
                        source="NVIDIA H200 datasheet (SXM; HBM3e 4.8 TB/s; NVLink 900 GB/s both directions)"),
    "B200": Accelerator("B200", 2250e12, 180 * GB, 900e9, "NVLink 5", sms=148, hbm_bw=8e12,
                        source="NVIDIA HGX B200 datasheet (per GPU; HBM3e 8 TB/s; NVLink 1.8 TB/s both "
                               "directions)"),
    "MI300X": Accelerator("MI300X", 1307e12, 192 * GB, 448e9, "Infinity Fabric", sms=304, hbm_bw=5.3e12,
                          source="AMD Instinct MI300X datasheet (dense bf16; 304 CUs; HBM3 5.3 TB/s; 7 links of "
                                 "64 GB/s per direction)"),
}

CLUSTERS: dict[str, Cluster] = {
    "selene": Cluster("selene", "A100", 8, 420, 25e9, network="8x HDR InfiniBand 200 Gb/s per node",
                      source="Narayanan et al. 2021, §5 (DGX A100 nodes, one 200 Gb/s HDR link per GPU)"),
    "dgx-h100": Cluster("dgx-h100", "H100", 8, 128, 50e9, network="8x NDR InfiniBand 400 Gb/s per node",
                        source="NVIDIA DGX H100 user guide (one 400 Gb/s ConnectX-7 per GPU)"),
    "llama3-h100": Cluster("llama3-h100", "H100", 8, 2048, 50e9, network="RoCE 400 Gb/s per GPU",
                           source="Llama Team 2024, §3.3.1 (16K H100 80GB, 400 Gb/s per GPU)"),
    "dgx-h200": Cluster("dgx-h200", "H200", 8, 32, 50e9, network="8x NDR InfiniBand 400 Gb/s per node",
                        source="NVIDIA DGX H200 datasheet"),
    "dgx-b200": Cluster("dgx-b200", "B200", 8, 32, 50e9, network="8x 400 Gb/s ConnectX-7 per node",
                        source="NVIDIA DGX B200 datasheet"),
    "colab-t4": Cluster("colab-t4", "T4", 1, 1, 1.5e9, network="none (one GPU)",
                        source="Google Colab free tier"),
    "cloud-l4": Cluster("cloud-l4", "L4", 8, 4, 12.5e9, network="100 Gb/s Ethernet per node",
                        source="Google Cloud G2 machine type (8 L4 per node)"),
}


def get_accelerator(gpu) -> Accelerator:
    if isinstance(gpu, Accelerator):
        return gpu
    if gpu not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {gpu!r}; the catalogue has {sorted(ACCELERATORS)}")
    return ACCELERATORS[gpu]


def get_cluster(cluster, nodes: int | None = None) -> Cluster:
    """A cluster from a :class:`Cluster` or a catalogue name, optionally with ``nodes`` nodes."""
    if not isinstance(cluster, Cluster):
        if cluster not in CLUSTERS:
            raise ValueError(f"unknown cluster {cluster!r}; the catalogue has {sorted(CLUSTERS)}")
        cluster = CLUSTERS[cluster]
    return cluster.with_nodes(nodes) if nodes is not None else cluster
