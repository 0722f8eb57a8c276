"""Efficiency curves by shape: what fraction of the datasheet peak a shard reaches.

The roofline in ``costmodel.hardware`` scales the peaks by one constant per kernel class. Real
GEMMs do not run at one efficiency: cuBLAS reaches ~70-80 % of the bf16 tensor peak on large
square GEMMs and far less on skinny ones, because a GEMM is cut into output tiles spread over
the SMs in *waves* (a last, partial wave leaves SMs idle: "wave quantization") and every tile
pays a pipeline prologue and epilogue that only a long reduction (K) amortises; a streaming kernel
reaches ~90 % of HBM bandwidth only once it moves megabytes. :class:`Curves` holds these shapes:

- GEMM-class shards (kernel class ``matmul``; their index points are the output cells ``M·N``
  (times batch), and ``K`` = FLOPs per point / 2):
  ``eff = gemm_peak · occupancy(tiles) · K / (K + k_half)``, ``tiles = ceil(points / tile_points)``,
  ``occupancy = tiles / (ceil(tiles / n_sm) · n_sm)`` (full waves only); a GEMM with fewer
  tiles than SMs is split along K into ``s = min(floor(n_sm / tiles), floor(K / (4·k_half)))``
  pieces (``tiles·s`` tiles of depth ``K / s``), as cuBLAS does with split-K and stream-K for
  such shapes (Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense
  Matrix-Matrix Multiplication on the GPU", PPoPP 2023). Without it, a fp32 16×8192×8192 GEMM
  was predicted 4.1× slower than measured on an H100 (``docs/measurements/h100_curves.json``:
  8 tiles on 132 SMs), with it 0.6×; the partial sums' extra traffic is not charged;
- every shard's memory traffic: ``eff = mem_peak · bytes / (bytes + mem_half)``.

Default curves (ESTIMATES from published measurements; calibrate with :func:`fit`):

* H100 SXM, ``gemm_peak`` 0.78: cuBLAS bf16 GEMMs of 8192³ reach about 700-780 TFLOP/s of the
  989 dense peak in public benchmarks (NVIDIA "NVIDIA Hopper Architecture In-Depth" (2022)
  cuBLAS figures; Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture",
  arXiv:2402.13499, 2024, dense wgmma throughput ~ 660-740 TFLOP/s), i.e. 0.70-0.79; with the
  wave and K factors below an 8192³ bf16 GEMM takes 1.48 ms (``tests/costmodel/test_efficiency.py``).
  ``tile_points`` 128·128 and ``n_sm`` 132: CUTLASS/cuBLAS Hopper GEMMs use 128x128 (or
  128x256) output tiles, one per SM at a time, 132 SMs on H100 SXM [H100-WP]. ``k_half`` 64:
  a tile's fixed cost is about one 64-deep K-step of the mainloop (CUTLASS Hopper mainloops move
  K in steps of 64 for 16-bit types).
* memory ``mem_peak`` 0.90, ``mem_half`` 4 MB: STREAM-like copies on H100 HBM3 reach about
  3.0 TB/s of 3.35 (Luo et al. 2024, memory throughput section), and a kernel must move a few MB
  before launch ramp-up and tail effects fade.
* H200: the same SMs and tensor cores as H100 (same curves for compute); HBM3e at 4.8 TB/s, same
  fractions (no separate public measurement used here).
* A100 SXM, ESTIMATES: ``gemm_peak`` 0.80 (cuBLAS bf16/fp16 GEMMs of a few thousand per side
  reach about 250 of the 312 dense TFLOP/s; NVIDIA's "Matrix Multiplication Background User's
  Guide", Deep Learning Performance documentation, A100 throughput plots), 108 SMs [A100 whitepaper],
  ``k_half`` 32 (Ampere CUTLASS mainloops move K in steps of 32 for 16-bit types); memory
  ``mem_peak`` 0.88 (STREAM-like copies reach about 1.8 of the 2.04 TB/s).
* B200, ESTIMATES: 148 SMs (two dies of 74); ``gemm_peak`` 0.75 (early public bf16 GEMM figures
  of 1.6-1.7 dense PFLOP/s of 2.25); the Hopper tile and K step; memory as H100's fractions.
  Calibrate (``fit``) before trusting B200 prices. GB200's GPU is a B200 (the same curves).

``scripts/measure_gemm_curve.py`` measures GEMM points on a real GPU (CuPy) for calibration.

``costmodel.Evaluator`` applies these curves by default (``curves="default"``) on a device that
has them and whose hardware carries no factors of its own (:func:`curves_for`); ``curves=None``
gives the flat datasheet roofline that the closed-form tests pin.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np

from costmodel._kernels import SPLIT_K_MIN_STEPS
from costmodel.hardware import Hardware

__all__ = ["Curves", "DEFAULT_CURVES", "curves_for", "fit", "gemm_efficiency", "memory_efficiency", "gemm_time",
           "staged_fused_seconds"]


@dataclass(frozen=True)
class Curves:
    """Shape-dependent efficiencies (see the module docstring)."""

    gemm_peak: float = 0.78
    tile_points: float = 128.0 * 128.0
    n_sm: float = 132.0
    k_half: float = 64.0
    mem_peak: float = 0.90
    mem_half: float = 4e6

    def as_array(self) -> np.ndarray:
        """float64[7] for the lowering's kernel: (on, gemm_peak, tile_points, n_sm, k_half,
        mem_peak, mem_half)."""
        return np.array([1.0, self.gemm_peak, self.tile_points, self.n_sm, self.k_half, self.mem_peak,
                         self.mem_half])


OFF = np.zeros(7)
DEFAULT_CURVES = {"H100": Curves(), "H200": Curves(),
                  "A100": Curves(gemm_peak=0.80, n_sm=108.0, k_half=32.0, mem_peak=0.88),
                  "B200": Curves(gemm_peak=0.75, n_sm=148.0)}


def curves_for(hw: Hardware) -> Curves | None:
    """The default curves of ``hw``'s device (by name: H100, H200, A100, B200), or None: no published curve,
    or ``hw`` carries its own efficiency factors (calibrated or written in a hardware file: any
    factor other than 1), which then apply as given (calibration wins over published curves)."""
    if any(f != (1.0, 1.0) for f in hw.efficiency.values()):
        return None
    for key, c in DEFAULT_CURVES.items():
        if key in hw.device.name:
            return c
    return None


def gemm_efficiency(points, k, c: Curves) -> np.ndarray:
    """Fraction of the tensor peak a GEMM shard with ``points`` output cells and reduction ``k``
    reaches (broadcast over arrays)."""
    p = np.asarray(points, np.float64)
    k = np.asarray(k, np.float64)
    tiles = np.maximum(np.ceil(p / c.tile_points), 1.0)
    splits = np.maximum(1.0, np.minimum(np.floor(c.n_sm / tiles), np.floor(k / (SPLIT_K_MIN_STEPS * c.k_half))))
    tiles = tiles * splits
    kk = k / splits
    occ = tiles / (np.ceil(tiles / c.n_sm) * c.n_sm)
    return c.gemm_peak * occ * kk / (kk + c.k_half)


def memory_efficiency(nbytes, c: Curves) -> np.ndarray:
    """Fraction of the HBM bandwidth a shard moving ``nbytes`` reaches."""
    b = np.asarray(nbytes, np.float64)
    return c.mem_peak * b / (b + c.mem_half)


def gemm_time(m: int, n: int, k: int, dtype: str, hw: Hardware, c: Curves | None = None,
              itemsize: int = 2) -> float:
    """Seconds for one ``m x k @ k x n`` GEMM shard on one device of ``hw`` under curves ``c``
    (default: :func:`curves_for`): roofline with the curves' efficiencies plus launch."""
    c = c or curves_for(hw) or Curves()
    flops = 2.0 * m * n * k
    nbytes = float(itemsize) * (m * k + k * n + m * n)
    tf = flops / (hw.peak_flops(dtype) * gemm_efficiency(m * n, k, c))
    tb = nbytes / (hw.device.mem_bandwidth * memory_efficiency(nbytes, c))
    return float(max(tf, tb)) + hw.launch_overhead_for("matmul")


def fit(c: Curves, samples: Iterable[tuple[float, float, float, float, float]], peak: float,
        bandwidth: float) -> Curves:
    """Refit ``gemm_peak`` and ``mem_peak`` of ``c`` from measured GEMM shards: ``samples`` of
    (points, k, flops, bytes, seconds without launch). Compute-bound samples give
    ``gemm_peak = flops / (peak · seconds · shape)``, memory-bound ones ``mem_peak``; each the
    median (robust to a few outliers); a class without samples keeps its value."""
    g, m = [], []
    for points, k, flops, nbytes, secs in samples:
        if secs <= 0:
            continue
        shape_g = float(gemm_efficiency(points, k, c)) / c.gemm_peak
        shape_m = float(memory_efficiency(nbytes, c)) / c.mem_peak
        t_f = flops / (peak * c.gemm_peak * shape_g)
        t_b = nbytes / (bandwidth * c.mem_peak * shape_m)
        if t_f >= t_b:
            g.append(flops / (peak * secs * shape_g))
        else:
            m.append(nbytes / (bandwidth * secs * shape_m))
    out = c
    if g:
        out = replace(out, gemm_peak=float(np.clip(np.median(g), 1e-3, 1.0)))
    if m:
        out = replace(out, mem_peak=float(np.clip(np.median(m), 1e-3, 1.0)))
    return out


def staged_fused_seconds(hw: Hardware, sig, params, kernel_class: str, dtype: str, f: np.ndarray) -> np.ndarray:
    """Per shard, the seconds of a fused op whose stages run one after another (a Hardware with
    ``staged_fusion``: this repository's executor, where ``ir.kernels.fused`` calls each stage's
    kernel in turn and every intermediate makes a round trip through memory).

    ``f``: the lowering's rows ``(device, seconds, output bytes, FLOPs, bytes)`` of the fused op's
    shards. Stage 0 is charged at ``kernel_class`` with the op's FLOPs less the epilogue's and the
    op's own bytes; each later stage (``Fused.epilogue_work``) at its own kernel class, with its
    FLOPs and bytes per output cell times the shard's output cells, plus its launch overhead.
    Measured on this 2-vCPU VM (NumPy, one BLAS thread): a fused linear+gelu shard of the
    benchmark MLP took 16.6 ms against 5.4 ms charged as one GEMM-class kernel, because NumPy's
    gelu costs ~8 ns per element (docs/benchmarks.md, "Model fidelity on this CPU")."""
    from ir.kernels import ITEMSIZE, get_kernel

    work = get_kernel("fused").epilogue_work(sig, params)
    cells = f[:, 2] / float(ITEMSIZE[sig.out_spec.dtype])
    ep_flops = sum(fl for _, fl, _ in work) * cells
    t = hw.shard_time(np.maximum(f[:, 3] - ep_flops, 0.0), f[:, 4], dtype, kernel_class)
    for kclass, fl, by in work:
        t = t + hw.shard_time(fl * cells, by * cells, dtype, kclass)
    return np.asarray(t, dtype=np.float64)
