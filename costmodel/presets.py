"""Hardware presets with their sources.

Sources (figures are dense, i.e. without 2:4 structured sparsity; the datasheets print the sparse
figure with a footnote, twice the dense one):

[H100-DS]  NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): FP64 34 TFLOPS, FP64 Tensor
           67, FP32 67, TF32 Tensor 989*, BF16 Tensor 1,979*, FP16 Tensor 1,979* (* with
           sparsity), GPU memory 80 GB, memory bandwidth 3.35 TB/s, max TDP up to 700 W,
           NVLink 900 GB/s, PCIe Gen5 128 GB/s.
[H100-WP]  NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), table "H100 SXM5":
           peak FP32 66.9 TFLOPS, FP64 33.5, FP64 Tensor 66.9, TF32 Tensor 494.7 (dense),
           FP16/BF16 Tensor 989.4 (dense), at the 1830 MHz boost clock with 132 SMs.
           NVLink 4: 18 links per GPU, 900 GB/s total bidirectional = 450 GB/s per direction;
           on HGX H100 8-GPU all 8 GPUs connect through NVSwitch (full bandwidth any pair).
[H200-DS]  NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): same compute figures as
           H100 SXM (FP32 67, BF16/FP16 1,979* with sparsity), 141 GB HBM3e, 4.8 TB/s,
           max TDP up to 700 W, NVLink 900 GB/s.
[DGX-H100] NVIDIA DGX H100 user guide / DGX SuperPOD reference architecture: 8 single-port
           ConnectX-7 adapters, one per GPU, 400 Gb/s NDR InfiniBand each for the compute fabric
           (400 Gb/s = 50 GB/s per direction per GPU).
[A100-DS]  NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column): FP64 9.7 TFLOPS, FP64
           Tensor 19.5, FP32 19.5, TF32 Tensor 156 (312 with sparsity), BF16/FP16 Tensor 312 (624
           with sparsity), 80 GB HBM2e at 2,039 GB/s, max TDP 400 W, NVLink 600 GB/s (third
           generation, 12 links: 300 GB/s per direction); 108 SMs [NVIDIA Ampere GA100 whitepaper].
[DGX-A100] NVIDIA DGX A100 user guide: 8 single-port ConnectX-6 adapters for the compute fabric,
           200 Gb/s HDR InfiniBand each (25 GB/s per direction per GPU).
[B200-TB]  NVIDIA Blackwell architecture technical brief (2024), HGX B200 at 1,000 W per GPU: FP64
           40 TFLOPS, FP32 80, TF32 Tensor 1,100 dense, FP16/BF16 Tensor 2,250 dense (4,500 with
           sparsity); DGX B200 datasheet: 1,440 GB HBM3e and 64 TB/s for 8 GPUs (180 GB and 8 TB/s
           each), NVLink 5 at 1.8 TB/s per GPU (900 GB/s per direction), 8 single-port ConnectX-7
           for the compute fabric at 400 Gb/s. 148 SMs (two dies of 74).
[GB200]    NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs in one NVLink domain (NVLink 5 through the
           rack's NVLink switches, 1.8 TB/s per GPU, 130 TB/s in all), 13.4 TB HBM3e at 576 TB/s
           (186 GB and 8 TB/s a GPU), BF16/FP16 Tensor 5 PFLOPS per GPU with sparsity (2.5 dense), TF32
           2.5 with sparsity, FP64 45 TFLOPS, FP32 90 [Blackwell technical brief, GB200 at 1,200 W];
           DGX GB200: one single-port ConnectX-7 at 400 Gb/s per GPU for the fabric between racks.

Choices and estimates (not datasheet figures; calibrate where it matters):

* float32 peak = the FP32 *vector* (CUDA core) rate, 66.9 TFLOP/s, not TF32 (494.7): the
  executor runs float32 with exact float32 semantics (CuPy and NumPy do not use TF32 unless asked,
  e.g. CUPY_TF32=1). The TF32 rate is kept under the extra key ``"tf32"`` for what-if studies, and
  FP64 (vector, 33.5) under ``"float64"``. float16/bfloat16 use the dense tensor-core rate; an
  elementwise shard in these dtypes is memory-bound anyway, so the vector rate does not matter.
* A100, B200 and GB200 follow the same choices (float32 = the vector rate, float16/bfloat16 = the
  dense tensor rate, active power = max TDP); their idle power (A100 50 W, B200 140 W, GB200 170
  W) is an ESTIMATE scaled from H100's by TDP; NVLink and InfiniBand latency and energy as for H100 (ESTIMATES).
* memory capacity = the datasheet's decimal 80 GB / 141 GB. The usable amount after the CUDA
  context and allocator reserve is a little lower; leave headroom or override ``mem_capacity``.
* active power = max TDP (700 W): an upper bound; real kernels often draw 400-650 W.
* idle power = 75 W: ESTIMATE. Idle HGX H100/H200 SXM GPUs are commonly reported at roughly
  60-100 W in ``nvidia-smi`` (public user reports, not a datasheet figure). To be measured.
* launch overhead = 5 us per shard: typical CUDA kernel launch plus dispatch; to be calibrated.
* NVLink latency 2.5 us: effective small-message latency of a GPU-to-GPU copy through NVSwitch
  including software (the wire and switch alone are well under 1 us). ESTIMATE.
* InfiniBand latency 5 us: NIC + one switch hop (~1-2 us hardware) plus GPUDirect/NCCL software
  overhead. ESTIMATE.
* transfer energy, ESTIMATES: NVLink 5 pJ/bit (= 40 pJ/B). NVIDIA quotes 1.3 pJ/bit for the
  on-package NVLink-C2C; board-level NVLink through an NVSwitch crosses two SerDes ends and the
  switch, so a few pJ/bit. InfiniBand 30 pJ/bit (= 240 pJ/B): a ConnectX-7 draws on the order of
  20-25 W at 400 Gb/s (~50-60 pJ/bit if all of it were charged to traffic, much of it static);
  30 pJ/bit is our rough incremental figure for NIC + switch + NIC.
* contention 1.2 (GPU presets; ``Hardware.contention``, ``costmodel.simulate``): compute that
  runs while its GPU communicates is slowed by 1.2x for the overlap. ESTIMATE from two sources:
  NCCL's kernels occupy SMs while they run (an NCCL all-gather on H100 launches 24 thread blocks,
  i.e. 24 of the 132 SMs, Nsight trace in the NVIDIA developer forum thread "Compute-communication
  overlap causes severe GEMM performance degradation because of tail effect", 2025), so a
  compute-bound kernel keeps at most ~108/132 = 82 % of the SMs -> 1/0.82 = 1.22x; and Agrawal et
  al., "Optimizing ML Concurrent Computation and Communication with GPU DMA Engines"
  (arXiv:2412.14335, 2024), who measure that overlapped GEMMs and collectives realise on average
  only 21 % of the ideal overlap speedup because of SM, cache and HBM interference (so 1.2 is on
  the mild side; the same forum trace shows a GEMM nearly doubling when a wave spills). The
  ``cpu`` preset keeps 1.0 (its "transfers" are copies the executor runs between shards).
* efficiency factors: 1.0 for every class, i.e. the raw datasheet roofline. Calibration lowers
  them (large GEMMs typically reach 60-80 % of the tensor peak, streaming kernels 80-90 % of the
  HBM bandwidth).

The ``cpu`` preset is this development machine (2 vCPU AMD EPYC, Zen 5 family 26, under KVM, 24 GiB
RAM, NumPy with OpenBLAS 0.3.31), one device, for comparing simulated times with NumPy executions.
Figures measured once while writing this file and rounded DOWN (conservative), to be calibrated:
float32 matmul 2048^3 reached ~235 GFLOP/s (both cores) -> 150e9; float64 ~114 -> 75e9; NumPy
has no BLAS path for float16 (~0.67 GFLOP/s measured) and no native bfloat16 -> 0.5e9 for both;
streaming add/copy ~38 GB/s (read + write counted) -> 25e9 B/s; capacity 20 GiB of the 24 GiB
(headroom for the OS, Python and the unsharded reference run); launch overhead 20 us (the
executor's per-shard Python dispatch; a bare NumPy call is ~0.5 us). Power 10 W active / 3 W idle
is a rough per-2-core share of a server socket: ESTIMATE. Its "links" are memory copies between
buffer sets (~10 GB/s, 2 us). Use ``base: cpu`` with ``devices_per_node: N`` in a YAML file to
simulate several CPU "devices".
"""

from __future__ import annotations

from costmodel.hardware import DeviceSpec, Hardware, HardwareError, LinkSpec

__all__ = ["PRESETS", "preset", "preset_names", "A100_SXM", "B200", "GB200", "H100_SXM", "H200_SXM", "NVLINK3",
           "NVLINK4", "NVLINK5", "IB_HDR_200", "IB_NDR_400", "CPU_DEVICE"]

# -- devices -----------------------------------------------------------------------------------

H100_SXM = DeviceSpec(
    name="NVIDIA H100 SXM5 80GB",
    peak_flops={
        "float32": 66.9e12,  # FP32 vector (CUDA cores) [H100-WP]; datasheet rounds to 67
        "float16": 989.4e12,  # FP16 tensor, dense [H100-WP]; 1,979 with sparsity [H100-DS]
        "bfloat16": 989.4e12,  # BF16 tensor, dense [H100-WP]; 1,979 with sparsity [H100-DS]
        "tf32": 494.7e12,  # TF32 tensor, dense [H100-WP] (not used for float32, see above)
        "float64": 33.5e12,  # FP64 vector [H100-WP]; FP64 tensor is 66.9
    },
    mem_bandwidth=3.35e12,  # HBM3 3.35 TB/s [H100-DS]
    mem_capacity=80e9,  # 80 GB [H100-DS]
    launch_overhead=5e-6,  # estimate, see module docstring
    active_power=700.0,  # max TDP [H100-DS]
    idle_power=75.0,  # ESTIMATE (60-100 W reported), see module docstring
)

H200_SXM = DeviceSpec(
    name="NVIDIA H200 SXM 141GB",
    peak_flops=dict(H100_SXM.peak_flops),  # same GH100 compute [H200-DS]
    mem_bandwidth=4.8e12,  # HBM3e 4.8 TB/s [H200-DS]
    mem_capacity=141e9,  # 141 GB [H200-DS]
    launch_overhead=5e-6,  # estimate
    active_power=700.0,  # max TDP up to 700 W [H200-DS]
    idle_power=75.0,  # ESTIMATE, as for H100
)

A100_SXM = DeviceSpec(
    name="NVIDIA A100 SXM4 80GB",
    peak_flops={
        "float32": 19.5e12,  # FP32 vector [A100-DS]
        "float16": 312e12,  # FP16 tensor, dense [A100-DS]
        "bfloat16": 312e12,  # BF16 tensor, dense [A100-DS]
        "tf32": 156e12,  # TF32 tensor, dense [A100-DS]
        "float64": 9.7e12,  # FP64 vector [A100-DS]; FP64 tensor is 19.5
    },
    mem_bandwidth=2.039e12,  # HBM2e 2,039 GB/s [A100-DS]
    mem_capacity=80e9,  # 80 GB [A100-DS]
    launch_overhead=5e-6,  # estimate, as for H100
    active_power=400.0,  # max TDP [A100-DS]
    idle_power=50.0,  # ESTIMATE, see module docstring
)

B200 = DeviceSpec(
    name="NVIDIA B200 180GB",
    peak_flops={
        "float32": 80e12,  # FP32 vector, HGX B200 [B200-TB]
        "float16": 2250e12,  # FP16 tensor, dense [B200-TB]
        "bfloat16": 2250e12,  # BF16 tensor, dense [B200-TB]
        "tf32": 1100e12,  # TF32 tensor, dense [B200-TB]
        "float64": 40e12,  # FP64 [B200-TB]
    },
    mem_bandwidth=8e12,  # HBM3e 8 TB/s [B200-TB]
    mem_capacity=180e9,  # 180 GB [B200-TB]
    launch_overhead=5e-6,  # estimate, as for H100
    active_power=1000.0,  # HGX B200 configuration [B200-TB]
    idle_power=140.0,  # ESTIMATE, see module docstring
)

GB200 = DeviceSpec(
    name="NVIDIA GB200 (B200 186GB)",
    peak_flops={
        "float32": 90e12,  # FP32 vector [GB200]
        "float16": 2500e12,  # FP16 tensor, dense [GB200]
        "bfloat16": 2500e12,  # BF16 tensor, dense [GB200]
        "tf32": 1250e12,  # TF32 tensor, dense [GB200]
        "float64": 45e12,  # FP64 [GB200]
    },
    mem_bandwidth=8e12,  # 576 TB/s over 72 GPUs [GB200]
    mem_capacity=186e9,  # 13.4 TB over 72 GPUs [GB200]
    launch_overhead=5e-6,  # estimate, as for H100
    active_power=1200.0,  # GB200 configuration [GB200]
    idle_power=170.0,  # ESTIMATE, see module docstring
)

CPU_DEVICE = DeviceSpec(
    name="AMD EPYC 2 vCPU (this machine)",
    peak_flops={
        "float32": 150e9,  # measured ~235 GFLOP/s sgemm, rounded down; calibrate
        "float16": 0.5e9,  # NumPy float16 matmul is emulated (~0.67 GFLOP/s measured)
        "bfloat16": 0.5e9,  # no native NumPy bfloat16; assume as slow as float16
        "float64": 75e9,  # measured ~114 GFLOP/s dgemm, rounded down
    },
    mem_bandwidth=25e9,  # measured ~38 GB/s streaming (read+write), rounded down
    mem_capacity=20 * 2**30,  # 20 GiB of 24 GiB, headroom for OS / Python / reference run
    launch_overhead=20e-6,  # executor per-shard dispatch; calibrate
    active_power=10.0,  # ESTIMATE
    idle_power=3.0,  # ESTIMATE
)

# -- links -------------------------------------------------------------------------------------

NVLINK4 = LinkSpec(
    bandwidth=450e9,  # 900 GB/s total per GPU = 450 GB/s per direction [H100-DS, H100-WP]
    latency=2.5e-6,  # ESTIMATE: effective incl. software (2-3 us)
    energy_per_byte=5e-12 * 8,  # ESTIMATE: 5 pJ/bit
)

NVLINK3 = LinkSpec(
    bandwidth=300e9,  # 600 GB/s total per GPU = 300 GB/s per direction [A100-DS]
    latency=2.5e-6,  # ESTIMATE, as NVLINK4
    energy_per_byte=5e-12 * 8,  # ESTIMATE, as NVLINK4
)

NVLINK5 = LinkSpec(
    bandwidth=900e9,  # 1.8 TB/s total per GPU = 900 GB/s per direction [B200-TB]
    latency=2.5e-6,  # ESTIMATE, as NVLINK4
    energy_per_byte=5e-12 * 8,  # ESTIMATE, as NVLINK4
)

IB_HDR_200 = LinkSpec(
    bandwidth=25e9,  # ConnectX-6 HDR 200 Gb/s per GPU = 25 GB/s per direction [DGX-A100]
    latency=5e-6,  # ESTIMATE, as IB_NDR_400
    energy_per_byte=30e-12 * 8,  # ESTIMATE, as IB_NDR_400
)

IB_NDR_400 = LinkSpec(
    bandwidth=50e9,  # ConnectX-7 NDR 400 Gb/s per GPU = 50 GB/s per direction [DGX-H100]
    latency=5e-6,  # ESTIMATE: NIC + switch + software
    energy_per_byte=30e-12 * 8,  # ESTIMATE: 30 pJ/bit end to end
)

CPU_COPY = LinkSpec(
    bandwidth=10e9,  # memcpy between buffer sets, conservative; calibrate
    latency=2e-6,  # Python + NumPy slicing overhead; estimate
    energy_per_byte=0.0,  # not modelled on the CPU
)

_DEFAULT_EFF = {"default": (1.0, 1.0)}  # uncalibrated: raw datasheet roofline
GPU_CONTENTION = 1.2  # compute slowdown under overlapped communication: ESTIMATE, see the module docstring

PRESETS: dict[str, Hardware] = {
    "h100-sxm-8": Hardware(
        name="h100-sxm-8",
        device=H100_SXM,
        n_nodes=1,
        devices_per_node=8,
        intra_link=NVLINK4,
        inter_link=IB_NDR_400,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="one HGX H100 8-GPU node: 8 x H100 SXM5 80GB, NVLink 4 through NVSwitch",
    ),
    "h200-sxm-8": Hardware(
        name="h200-sxm-8",
        device=H200_SXM,
        n_nodes=1,
        devices_per_node=8,
        intra_link=NVLINK4,
        inter_link=IB_NDR_400,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="one HGX H200 8-GPU node: 8 x H200 SXM 141GB, NVLink 4 through NVSwitch",
    ),
    "h100-sxm-64": Hardware(
        name="h100-sxm-64",
        device=H100_SXM,
        n_nodes=8,
        devices_per_node=8,
        intra_link=NVLINK4,
        inter_link=IB_NDR_400,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="8 HGX H100 nodes (64 GPUs), NVLink inside a node, 400 Gb/s NDR InfiniBand per GPU across",
    ),
    "h100-sxm-512": Hardware(
        name="h100-sxm-512",
        device=H100_SXM,
        n_nodes=64,
        devices_per_node=8,
        intra_link=NVLINK4,
        inter_link=IB_NDR_400,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="64 HGX H100 nodes (512 GPUs), NVLink inside a node, 400 Gb/s NDR InfiniBand per GPU across",
    ),
    "a100-sxm-8": Hardware(
        name="a100-sxm-8",
        device=A100_SXM,
        n_nodes=1,
        devices_per_node=8,
        intra_link=NVLINK3,
        inter_link=IB_HDR_200,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="one HGX A100 8-GPU node: 8 x A100 SXM4 80GB, NVLink 3 through NVSwitch",
    ),
    "a100-sxm-64": Hardware(
        name="a100-sxm-64",
        device=A100_SXM,
        n_nodes=8,
        devices_per_node=8,
        intra_link=NVLINK3,
        inter_link=IB_HDR_200,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="8 HGX A100 nodes (64 GPUs), NVLink inside a node, 200 Gb/s HDR InfiniBand per GPU across",
    ),
    "b200-8": Hardware(
        name="b200-8",
        device=B200,
        n_nodes=1,
        devices_per_node=8,
        intra_link=NVLINK5,
        inter_link=IB_NDR_400,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="one HGX B200 8-GPU node: 8 x B200 180GB, NVLink 5 through NVSwitch",
    ),
    "b200-64": Hardware(
        name="b200-64",
        device=B200,
        n_nodes=8,
        devices_per_node=8,
        intra_link=NVLINK5,
        inter_link=IB_NDR_400,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="8 HGX B200 nodes (64 GPUs), NVLink 5 inside a node, 400 Gb/s NDR InfiniBand per GPU across",
    ),
    "gb200-nvl72": Hardware(
        name="gb200-nvl72",
        device=GB200,
        n_nodes=1,
        devices_per_node=72,  # one NVLink domain: a "node" here is the rack
        intra_link=NVLINK5,
        inter_link=IB_NDR_400,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="one GB200 NVL72 rack: 72 B200 GPUs in one NVLink 5 domain",
    ),
    "gb200-nvl72x2": Hardware(
        name="gb200-nvl72x2",
        device=GB200,
        n_nodes=2,
        devices_per_node=72,
        intra_link=NVLINK5,
        inter_link=IB_NDR_400,
        efficiency=dict(_DEFAULT_EFF),
        contention=GPU_CONTENTION,
        description="two GB200 NVL72 racks (144 GPUs): NVLink 5 inside a rack, 400 Gb/s InfiniBand per GPU across",
    ),
    "cpu": Hardware(
        name="cpu",
        device=CPU_DEVICE,
        n_nodes=1,
        devices_per_node=1,
        intra_link=CPU_COPY,
        inter_link=CPU_COPY,
        efficiency=dict(_DEFAULT_EFF),
        description="this development machine (2 vCPU, 24 GiB, NumPy); conservative figures to be calibrated",
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset(name: str) -> Hardware:
    """The preset called ``name``; HardwareError listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise HardwareError(f"unknown hardware preset {name!r}; known presets: {', '.join(preset_names())}") from None
