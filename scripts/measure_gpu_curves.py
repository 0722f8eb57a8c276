"""Measure efficiency curves on the GPU at hand: dense bf16/fp32 GEMM by shape, elementwise
bandwidth by size, and row-wise softmax; prints a table and one JSON line.

Standalone (torch with CUDA only; no project imports), so it runs on a bare GPU machine:
``python scripts/measure_gpu_curves.py [--json PATH] [--quick]``. Timings: CUDA events, median of
``--repeats`` after ``--warmup`` runs; inputs are random normal (zeros run faster on Hopper).
Efficiency = achieved FLOP/s (or bytes/s) over the datasheet peak given by ``--peak-bf16``,
``--peak-fp32`` (dense, TFLOP/s) and ``--bandwidth`` (TB/s); defaults are the H100 SXM figures
the cost model's preset cites (989.4 / 66.9 TFLOP/s, 3.35 TB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics


def timed(torch, fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--peak-bf16", type=float, default=989.4)
    ap.add_argument("--peak-fp32", type=float, default=66.9)
    ap.add_argument("--bandwidth", type=float, default=3.35)
    args = ap.parse_args()
    import torch  # noqa: PLC0415

    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "gemm": [], "elementwise": [], "softmax": []}
    sizes = [256, 1024, 4096, 8192] if args.quick else [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    shapes = [(s, s, s) for s in sizes]
    shapes += [(m, 8192, 8192) for m in (16, 64, 256, 1024)] + [(8192, 8192, k) for k in (64, 256, 1024)]
    shapes += [(32768, 4096, 4096), (4096, 11008, 4096), (4096, 4096, 11008), (16384, 12288, 12288)]
    print(f"{'dtype':8} {'M':>6} {'N':>6} {'K':>6} {'time':>10} {'TFLOP/s':>9} {'eff':>6}")
    for dtype, peak in (("bfloat16", args.peak_bf16), ("float32", args.peak_fp32)):
        td = getattr(torch, dtype)
        for m, n, k in shapes:
            if dtype == "float32" and m * n * k > 8192**3:
                continue
            a = torch.randn(m, k, device=dev, dtype=td)
            b = torch.randn(k, n, device=dev, dtype=td)
            t = timed(torch, lambda: a @ b, args.warmup, args.repeats)
            tf = 2 * m * n * k / t / 1e12
            out["gemm"].append({"dtype": dtype, "m": m, "n": n, "k": k, "seconds": t, "tflops": tf,
                                "efficiency": tf / peak})
            print(f"{dtype:8} {m:>6} {n:>6} {k:>6} {t * 1e3:>8.3f}ms {tf:>9.1f} {tf / peak:>6.2f}")
            del a, b
    print(f"\n{'op':8} {'MB':>10} {'time':>10} {'TB/s':>7} {'eff':>6}")
    for mb in ([1, 16, 256] if args.quick else [0.25, 1, 4, 16, 64, 256, 1024]):
        n = int(mb * 2**20 / 2)
        x = torch.randn(n, device=dev, dtype=torch.bfloat16)
        y = torch.randn(n, device=dev, dtype=torch.bfloat16)
        t = timed(torch, lambda: x + y, args.warmup, args.repeats)
        bw = 3 * n * 2 / t / 1e12  # two reads, one write
        out["elementwise"].append({"bytes": 3 * n * 2, "seconds": t, "tbps": bw, "efficiency": bw / args.bandwidth})
        print(f"{'add':8} {3 * n * 2 / 1e6:>10.1f} {t * 1e3:>8.3f}ms {bw:>7.2f} {bw / args.bandwidth:>6.2f}")
    for rows, cols in ((4096, 4096), (32 * 4096, 4096)) if not args.quick else ((4096, 4096),):
        x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
        t = timed(torch, lambda: torch.softmax(x, dim=-1), args.warmup, args.repeats)
        bw = 2 * rows * cols * 2 / t / 1e12
        out["softmax"].append({"rows": rows, "cols": cols, "seconds": t, "tbps": bw, "efficiency": bw / args.bandwidth})
        print(f"{'softmax':8} {2 * rows * cols * 2 / 1e6:>10.1f} {t * 1e3:>8.3f}ms {bw:>7.2f} {bw / args.bandwidth:>6.2f}")
    line = json.dumps(out)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line)


if __name__ == "__main__":
    main()
