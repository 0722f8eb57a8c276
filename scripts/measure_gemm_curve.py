"""Measure GEMM efficiency points on one GPU for ``costmodel.efficiency`` (self-contained).

Needs only NumPy and CuPy (no project imports), so it can run on a bare GPU machine:

    python scripts/measure_gemm_curve.py [--dtype bfloat16|float16|float32] [--peak 989.4e12]
                                         [--repeats 20] > gemm_points.json

For each (M, N, K) of a grid (square GEMMs 256..16384, skinny M = 8..1024 against N = K = 8192,
short K = 64..1024 at M = N = 8192) it times ``a @ b`` with CUDA events (median of ``--repeats``
after warm-up) and prints one JSON document: the device name, and per point ``m, n, k, seconds,
tflops, efficiency`` (= achieved / ``--peak``). Feed the points to
``costmodel.efficiency.fit(curves, [(m*n, k, 2*m*n*k, bytes, seconds - launch), ...], peak, bw)``.

bfloat16 needs CuPy >= 13 with ``cupy.dtype('bfloat16')`` support or ml_dtypes; if it is missing
the script falls back to float16 (same tensor-core rate on H100) and says so in the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys


def _dtype(cp, name: str):
    if name != "bfloat16":
        return cp.dtype(name), name
    try:
        import ml_dtypes  # noqa: F401

        return cp.dtype("bfloat16"), name
    except Exception:
        return cp.dtype("float16"), "float16 (bfloat16 unavailable)"


def grid() -> list[tuple[int, int, int]]:
    pts = [(n, n, n) for n in (256, 512, 1024, 2048, 4096, 6144, 8192, 12288, 16384)]
    pts += [(m, 8192, 8192) for m in (8, 16, 32, 64, 128, 256, 512, 1024)]
    pts += [(8192, 8192, k) for k in (64, 128, 256, 512, 1024)]
    return pts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--peak", type=float, default=989.4e12, help="dense peak FLOP/s of the dtype (H100 SXM bf16)")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    import cupy as cp

    dt, dt_name = _dtype(cp, a.dtype)
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    out = {"device": name, "dtype": dt_name, "peak_flops": a.peak, "repeats": a.repeats, "points": []}
    for m, n, k in grid():
        x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(dt)
        y = cp.random.standard_normal((k, n), dtype=cp.float32).astype(dt)
        for _ in range(3):
            x @ y
        cp.cuda.Device().synchronize()
        times = []
        for _ in range(a.repeats):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            x @ y
            e.record()
            e.synchronize()
            times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
        times.sort()
        t = times[len(times) // 2]
        flops = 2.0 * m * n * k
        out["points"].append({"m": m, "n": n, "k": k, "seconds": t, "tflops": flops / t / 1e12,
                              "efficiency": flops / t / a.peak, "bytes": float(dt.itemsize) * (m * k + k * n + m * n)})
        print(f"{m}x{n}x{k}: {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s", file=sys.stderr, flush=True)
        del x, y
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
