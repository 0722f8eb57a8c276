"""CuPy backend: kernels, device-aware execution and timing agree with NumPy.

Each test runs on the fake CuPy of ``fake_cupy`` (two GPUs, host/device mixups refused) on every
machine, and on the real CuPy where a GPU is present (``pytest -m gpu``); see conftest.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.transfers import transfer_plan
from executor.device_run import run_on_devices
from executor.run import execute, read_box
from executor.verify import TOLERANCE, rel_error
from ir import workloads
from ir.builder import GraphBuilder
from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import REGISTRY, get_kernel
from ir.autodiff import training_step
from ir.rewrites import fuse, fuse_attention, place, random_walk, split, split_reduction
from ir.validate import check
from ir.zspace import ZRange, project_boxes
from tests.ir.test_kernel_signatures import CASES
from tests.ir.test_kernel_signatures import data as case_data

SMALL = {
    "mlp": dict(batch=6, widths=(12, 20, 10)),
    "transformer": dict(batch=2, seq=6, d_model=8, heads=2, d_ff=12),
    "convnet": dict(batch=2, channels=(3, 4, 4), size=6),
}


def extra_graphs():
    """One-op graphs for kernels the workloads do not use, a split reduction and a fusion."""
    out = []
    for k in ("exp", "tanh"):
        b = GraphBuilder()
        b.op(k, "k", {"x": b.input("x", (5, 7))})
        out.append(b.build())
    for k in ("sub", "mul", "div"):
        b = GraphBuilder()
        b.op(k, "k", {"a": b.input("a", (5, 7)), "b": b.parameter("b", (7,))})
        out.append(b.build())
    b = GraphBuilder()
    b.op("matmul", "mm", {"a": b.input("a", (6, 8)), "b": b.parameter("b", (8, 5))})
    out.append(split_reduction(b.build(), "mm", 2))  # partial matmul + accumulate
    b = GraphBuilder()
    b.op("reduce_max", "k", {"x": b.input("x", (4, 6, 5))}, dim=1)
    out.append(b.build())
    b = GraphBuilder()
    b.op("transpose", "k", {"x": b.input("x", (4, 6))})
    out.append(b.build())
    out.append(fuse(workloads.mlp(**SMALL["mlp"]), "fc1", "act1"))
    return out


def training_graphs():
    """Training steps (forward, backward, optimizer) of tiny models, one with fused attention."""
    tiny = dict(layers=1, d_model=8, heads=2, d_ff=12, vocab=10, seq=4, batch=2)
    out = [workloads.build("gpt", mode="train", **tiny),
           workloads.build("llama", mode="train", kv_heads=1, **tiny),
           workloads.build("convnet", mode="train", optimizer="sgd", **SMALL["convnet"])]
    fwd = workloads.build("gpt", **tiny)
    out.append(training_step(fuse_attention(fwd, "l0.attn_qk"), loss="cross_entropy"))
    return out


def case_graphs(covered: set[str]):
    """One-op graphs, with the inputs of their kernel-signature case, for the kernels still missing."""
    out = []
    for case in CASES:
        if case.kernel in covered or case.kernel == "fused":
            continue
        covered.add(case.kernel)
        tensors = {p: Tensor(p, shape, "int32" if p in case.ints else "float32", "input")
                   for p, shape in case.shapes.items()}
        sig = get_kernel(case.kernel).signature({p: t.spec for p, t in tensors.items()}, case.params)
        result = "out" if "y" in case.shapes else "y"  # a port named y (log_softmax_grad) is not the output
        tensors[result] = Tensor(result, sig.out_spec.shape, sig.out_spec.dtype, "output")
        op = Op("k", case.kernel, tuple((p, p) for p in case.shapes), result, dict(case.params),
                Shards.whole(sig.extents))
        values = {p: (v if p in case.ints else v.astype(np.float32)) for p, v in case_data(case).items()}
        out.append((check(Graph(tensors, {"k": op})), values))
    return out


def all_graphs():
    """(graph, inputs or None) pairs that use every registered kernel."""
    graphs = [workloads.build(n, **p) for n, p in SMALL.items()] + extra_graphs() + training_graphs()
    covered = {o.kernel for g in graphs for o in g.ops.values()}
    return [(g, None) for g in graphs] + case_graphs(covered)


def test_every_kernel_on_random_boxes_equals_numpy(cupy):
    rng = np.random.default_rng(0)
    seen = set()
    for g, values in all_graphs():
        env = execute(g, values)  # every tensor, on NumPy
        for name in g.topo_order:
            o = g.ops[name]
            sig = g.signature(o)
            k = get_kernel(o.kernel)
            params = o.params if o.kernel == "fused" else k.check_params(o.params)
            seen.add(o.kernel)
            ext = np.array(sig.extents)
            for _ in range(4):
                lo = np.array([rng.integers(0, e) for e in ext], np.int64)
                hi = np.array([rng.integers(a + 1, e + 1) for a, e in zip(lo, ext)], np.int64)
                blocks_np, blocks_cp = {}, {}
                for port, proj in sig.inputs.items():
                    plo, phi = project_boxes(proj, lo[None], hi[None])
                    arr = env[o.input_map[port]]
                    blocks_np[port] = read_box(np, arr, plo[0], phi[0])
                    blocks_cp[port] = read_box(cupy, cupy.asarray(arr), plo[0], phi[0])
                box = ZRange(lo, hi)
                y_np = k.run(np, blocks_np, params, box, sig)
                y_cp = k.run(cupy, blocks_cp, params, box, sig)
                assert isinstance(y_cp, cupy.ndarray)
                assert y_cp.shape == y_np.shape, (o.kernel, box)
                y_cp, y_np = np.asarray(cupy.asnumpy(y_cp), np.float64), np.asarray(y_np, np.float64)
                same_inf = np.isinf(y_np) & (y_cp == y_np)  # masked scores: -inf on both sides
                err = rel_error(np.where(same_inf, 0.0, y_cp), np.where(same_inf, 0.0, y_np))
                assert err <= TOLERANCE[g.tensors[o.output].dtype], (o.kernel, box, err)
    assert seen == set(REGISTRY), sorted(set(REGISTRY) - seen)


def random_plan(name, seed, n_devices=4):
    rng = np.random.default_rng(seed)
    return random_walk(workloads.build(name, **SMALL[name]), rng, n_devices, 14)


@pytest.mark.parametrize("name", list(SMALL))
def test_run_on_devices_cupy_equals_numpy(name, cupy):
    for seed in range(3):
        g = random_plan(name, seed)
        tp = transfer_plan(g, 4)
        a = run_on_devices(g, tp.transfers, tp.residency, backend="numpy")
        b = run_on_devices(g, tp.transfers, tp.residency, backend="cupy")
        n_gpus = cupy.cuda.runtime.getDeviceCount()
        assert all(v == d % n_gpus for d, v in b.device_map.items())  # round-robin, several per GPU allowed
        for n in a.outputs:
            assert isinstance(b.outputs[n], np.ndarray)
            assert rel_error(b.outputs[n], a.outputs[n]) <= TOLERANCE["float32"], (name, seed, n)


def test_incomplete_communication_is_caught_on_gpu_too(cupy):
    from executor.device_run import IncompleteCommunication

    g = place(split(workloads.mlp(**SMALL["mlp"]), "fc1", "n", 2), "fc1", (0, 1))
    tp = transfer_plan(g, 2)
    assert tp.transfers
    with pytest.raises(IncompleteCommunication):
        run_on_devices(g, tp.transfers[1:], tp.residency, backend="cupy")


def test_timing_uses_cuda_events(monkeypatch, cupy):
    calls = []
    real = cupy.cuda.get_elapsed_time

    def counting(start, end):
        calls.append((start, end))
        return real(start, end)

    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", counting)
    g = random_plan("transformer", 1)
    tp = transfer_plan(g, 4)
    res = run_on_devices(g, tp.transfers, tp.residency, backend="cupy", timing=True, repeats=3, warmup=1)
    assert len(res.shards) == g.n_shards and len(res.transfers) == len(tp.transfers)
    assert all(s["seconds"] > 0 and s["gpu"] is not None for s in res.shards)
    assert all(t["seconds"] > 0 for t in res.transfers)
    # one event pair per shard and per transfer (at least: cross-GPU transfers use two), per timed repeat
    assert len(calls) >= 3 * (len(res.shards) + len(res.transfers))
    assert res.plan_seconds > 0


def test_time_plan_and_measure_on_cupy(cupy):
    from executor.measure import time_ops, time_plan

    g = workloads.mlp(batch=64, widths=(256, 512, 256))
    assert time_plan(g, "cupy", repeats=3) > 0
    assert all(v > 0 for v in time_ops(g, "cupy", repeats=3).values())


def test_measure_plan_records_on_cupy(cupy):
    from optimizer.realrun.measurement import measure_plan

    g = random_plan("mlp", 2)
    recs = measure_plan(g, "h100-sxm-8", backend="cupy", repeats=3)
    assert recs[-1]["kind"] == "plan" and recs[-1]["verified"]
    assert all(r["backend"] == "cupy" and r["measured_seconds"] > 0 for r in recs)


def test_calibrate_quick_on_cupy(tmp_path, cupy):
    from costmodel.hardware_io import load_hardware
    from optimizer.cli import main

    out = tmp_path / "gpu.yaml"
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--backend", "cupy", "--hardware", "h100-sxm-8", "--out", str(out), "--quick"])
    assert e.value.code == 0
    assert load_hardware(out).n_devices == 8


def test_grid_on_gpu_workers(real_cupy):
    from optimizer.campaign.cluster import grid_client
    from optimizer.realrun.grid import run_plan_on_grid

    g = place(split(workloads.mlp(**SMALL["mlp"]), "fc1", "n", 2), "fc1", (0, 1))
    with grid_client(None, 2, backend="cupy") as client:
        rep = run_plan_on_grid(g, client, backend="cupy")
    assert rep.ok, str(rep)
