"""The fake CuPy refuses what a GPU refuses (so passing on it means something), and the GPU-only
paths that it alone can observe on any machine: peer copies between GPUs, GPU names, workers
pinned to GPUs."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from fake_cupy import make_fake_cupy

from costmodel.presets import PRESETS
from costmodel.transfers import transfer_plan
from executor.backend import BackendError, get_backend
from executor.device_run import device_name, run_on_devices
from ir import workloads
from ir.rewrites import place, split


@pytest.fixture
def fake(monkeypatch):
    mod = make_fake_cupy(n_gpus=2)
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


def test_fake_refuses_host_device_mixups_and_foreign_gpus(fake):
    d = fake.asarray(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="numpy.concatenate"):
        np.concatenate([d, d])
    with pytest.raises(TypeError, match="host array"):
        fake.exp(np.ones(3))
    with pytest.raises(TypeError, match="host array"):
        d + np.ones((2, 3))  # noqa: B018
    with fake.cuda.Device(1):
        e = fake.zeros((2, 3), dtype=fake.float32)
        assert e.gpu == 1
        with pytest.raises(ValueError, match="GPU 0"):
            d * 2  # noqa: B018
        with pytest.raises(ValueError, match="GPU 0"):
            e[...] = d
        e[...] = fake.copy(d)  # the explicit peer copy is the way across
    assert fake.stats["peer_copies"] == 1
    assert np.array_equal(fake.asnumpy(e), np.ones((2, 3)))
    assert fake.asnumpy(d.sum(axis=0)).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(fake.cuda.runtime.CUDARuntimeError):
        fake.cuda.Device(2)


def test_unavailable_gpu_is_a_backend_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", make_fake_cupy(available=False))
    with pytest.raises(BackendError, match="no usable NVIDIA GPU.*--backend numpy"):
        get_backend("cupy")


def test_plan_devices_on_two_gpus_copy_between_them_explicitly(fake):
    g = place(split(workloads.mlp(batch=6, widths=(12, 20, 10)), "fc1", "n", 2), "fc1", (0, 1))
    tp = transfer_plan(g, 2)
    a = run_on_devices(g, tp.transfers, tp.residency, backend="numpy")
    b = run_on_devices(g, tp.transfers, tp.residency, backend="cupy", timing=True, repeats=2, warmup=0)
    assert b.device_map == {0: 0, 1: 1}
    assert fake.stats["peer_copies"] >= len(tp.transfers)  # every transfer crosses GPUs here
    for n in a.outputs:
        np.testing.assert_allclose(b.outputs[n], a.outputs[n], rtol=1e-5, atol=1e-6)
    # one plan device per GPU: no copies at all when both plan devices share GPU 0
    fake.stats["peer_copies"] = 0
    c = run_on_devices(g, tp.transfers, tp.residency, backend="cupy", device_map={0: 0, 1: 0})
    assert fake.stats["peer_copies"] == 0 and c.device_map == {0: 0, 1: 0}
    with pytest.raises(ValueError, match="GPU 5"):
        run_on_devices(g, tp.transfers, tp.residency, backend="cupy", device_map={0: 0, 1: 5})


def test_gpu_names_reach_the_measurement_records(fake):
    from optimizer.realrun.sampling import MeasureTaskSpec, measure_task

    assert device_name("cupy", 1) == "Fake GPU 1"
    assert device_name("numpy").startswith("cpu")
    g = place(split(workloads.mlp(batch=6, widths=(12, 20, 10)), "fc1", "n", 2), "fc1", (0, 1))
    recs = measure_task(MeasureTaskSpec(g.digest, json.dumps(g.to_json()), "cupy", 1, PRESETS["h100-sxm-8"].to_dict()))
    plan = recs[-1]
    assert plan["kind"] == "plan" and plan["device_name"] == "Fake GPU 0" and plan["verified"]
    assert {r["device_name"] for r in recs if r["kind"] == "shard"} == {"Fake GPU 0", "Fake GPU 1"}
    assert all(r["backend"] == "cupy" for r in recs)


def test_local_gpus_follow_cuda_visible_devices_then_cupy(fake, monkeypatch):
    from optimizer.campaign.cluster import local_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-7f1e,")
    assert local_gpus() == ["3", "GPU-7f1e"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local_gpus() == ["0", "1"]  # the fake's two GPUs
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy missing: no GPUs
    assert local_gpus() == []


def test_local_gpu_workers_are_pinned_round_robin():
    """Each local GPU worker process sees one GPU (CUDA_VISIBLE_DEVICES), several sharing one when
    there are more workers than GPUs, and advertises the GPU resource."""
    from optimizer.campaign.cluster import dask_client

    with dask_client(None, 3, 1, {"GPU": 1}, gpus=["0", "1"]) as client:
        seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
        info = client.scheduler_info()["workers"]
    by_name = {info[addr]["name"]: gpu for addr, gpu in seen.items()}
    assert by_name == {0: "0", 1: "1", 2: "0"}
    assert all(w["resources"] == {"GPU": 1} for w in info.values())


def run_script(monkeypatch, name: str, *args: str) -> int:
    """``scripts/<name> args...`` run as ``__main__`` in this process; its exit status."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / name
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    return e.value.code


def test_bench_gpu_runs_its_cupy_path(fake, monkeypatch, capsys):
    """``scripts/bench_gpu.py --backend cupy`` end to end (quick spread, 4 plans) on the fake GPU."""
    assert run_script(monkeypatch, "bench_gpu.py", "--backend", "cupy", "--quick", "--plans", "4",
                      "--repeats", "1") == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["device"] == "Fake GPU 0" and line["backend"] == "cupy" and line["hardware"] == "h100-sxm-8"
    assert line["plans"] == 4 and line["verified"] == 4
    assert set(line["factors"]) == {"conv", "elementwise", "matmul", "matmul.attention", "matmul.einsum", "matmul.norm",
                                    "reduction", "rowwise"}
    assert fake.stats["elapsed"] > 0  # timed with (fake) CUDA events


def test_bench_fidelity_runs_its_cupy_path(fake, monkeypatch, capsys):
    """``scripts/bench_fidelity.py --backend cupy`` end to end (quick workloads, 6 plans) on the
    fake GPU: the GPU preset as the model, every plan verified, the three models scored."""
    assert run_script(monkeypatch, "bench_fidelity.py", "--backend", "cupy", "--quick", "--plans", "6", "--rounds", "1",
                      "--repeats", "1", "--cal-plans", "1", "--every", "2") == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["backend"] == "cupy" and line["hardware"] == "h100-sxm-8"
    assert line["machine"].startswith("Fake GPU 0")
    assert line["plans"] == 6 and line["verified"] == 6
    assert {"preset", "calibrated", "online refit (held out)"} <= set(line["models"])
    assert fake.stats["elapsed"] > 0  # timed with (fake) CUDA events
