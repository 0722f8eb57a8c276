"""``tapestry calibrate --quick`` on NumPy: a loadable hardware file that fits better."""

from __future__ import annotations

import json

import numpy as np
import pytest

from costmodel.hardware_io import load_hardware
from costmodel.presets import PRESETS
from optimizer.cli import main
from optimizer.realrun.calibration import errors, kernel_spread


def run_cli(*args: str) -> int:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    return int(e.value.code or 0)


def test_quick_numpy_calibration_writes_a_better_hardware_file(tmp_path, capsys):
    out, js = tmp_path / "cal.yaml", tmp_path / "cal.json"
    assert run_cli("calibrate", "--backend", "numpy", "--hardware", "cpu", "--out", str(out), "--quick",
                   "--repeats", "3", "--json", str(js)) == 0
    text = capsys.readouterr().out
    assert "measured vs model" in text and "fitted factors" in text and str(out) in text.replace("\n", "")
    assert out.read_text().startswith("base: cpu")
    cal = load_hardware(out)
    base = PRESETS["cpu"]
    assert cal.device == base.device and cal.n_devices == base.n_devices
    doc = json.loads(js.read_text())
    points = doc["points"]
    classes = {p["kernel_class"] for p in points}
    assert classes == {"matmul", "matmul.attention", "matmul.einsum", "matmul.norm", "elementwise", "rowwise", "conv",
                       "reduction"}
    records = [{"kernel_class": p["kernel_class"], "flops": p["flops"], "bytes": p["bytes"], "dtype": "float32",
                "seconds": p["measured"]} for p in points]
    before, after = errors(records, base), errors(records, cal)  # the file as loaded, not the in-memory fit
    assert after["mean_abs_log"] < before["mean_abs_log"]
    assert after["rms_rel"] < before["rms_rel"]
    assert doc["error_after"]["mean_abs_log"] == pytest.approx(after["mean_abs_log"])
    for k in classes:  # every class got its own factors and launch overhead
        assert k in cal.efficiency and k in cal.launch_overhead_by_class


def test_the_spread_covers_kernels_and_sizes():
    full = kernel_spread("numpy")
    kernels = {c.kernel for c in full}
    assert {"matmul", "linear", "attention", "norm_matmul", "add", "relu", "gelu", "softmax", "layernorm", "conv2d",
            "reduce_sum"} <= kernels
    assert sum(c.kernel == "matmul" for c in full) >= 5
    gpu = kernel_spread("cupy", dtypes=("float32", "float16"))
    assert len(gpu) == 2 * len(kernel_spread("cupy"))
    sizes = [int(np.prod(c.build().tensors["k.out"].shape)) for c in kernel_spread("numpy", quick=True)
             if c.kernel == "add"]
    assert len(set(sizes)) >= 3


@pytest.mark.parametrize("args, needle", [
    ((), "--hardware"),
    (("--hardware", "cpu"), "--out"),
    (("--hardware", "cpu", "--out", "x.txt"), ".yaml"),
    (("--hardware", "nope", "--out", "x.yaml"), "unknown hardware preset"),
    (("--hardware", "cpu", "--out", "x.yaml", "--backend", "tpu"), "tpu"),
])
def test_bad_options_exit_2_without_traceback(args, needle, capsys):
    assert run_cli("calibrate", *args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
