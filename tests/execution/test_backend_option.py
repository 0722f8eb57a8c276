"""``--backend cupy`` without CuPy or a GPU: exit 2 with a clear message, never a traceback."""

from __future__ import annotations

import pytest

from executor.backend import BackendError, get_backend
from optimizer.cli import main


def _cupy_usable() -> bool:
    try:
        get_backend("cupy")
        return True
    except BackendError:
        return False


pytestmark = pytest.mark.skipif(_cupy_usable(), reason="CuPy and a GPU are present: cupy is a valid backend here")


@pytest.fixture
def plan(tmp_path):
    p = tmp_path / "p.json"
    with pytest.raises(SystemExit) as e:
        main(["graph", "build", "mlp", "-o", str(p), "--set", "batch=4", "--set", "widths=[8,8]",
              "-r", "split{op=fc1,dim=n,parts=2}", "-r", "place{op=fc1,devices=[0,1]}"])
    assert e.value.code == 0
    return str(p)


@pytest.mark.parametrize("cmd", [
    ["verify", "{plan}", "--backend", "cupy"],
    ["execute", "{plan}", "--backend", "cupy"],
    ["calibrate", "--backend", "cupy", "--hardware", "h100-sxm-8", "--out", "{tmp}/cal.yaml", "--quick"],
])
def test_cupy_missing_is_a_user_error(cmd, plan, tmp_path, capsys):
    args = [a.format(plan=plan, tmp=tmp_path) for a in cmd]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "cupy" in err.lower() and "--backend numpy" in err
    assert not (tmp_path / "cal.yaml").exists()


def test_get_backend_names_the_fix():
    with pytest.raises(BackendError, match="--backend numpy"):
        get_backend("cupy")
    with pytest.raises(BackendError, match="unknown backend"):
        get_backend("tpu")


def test_importing_the_executor_never_needs_cupy():
    import importlib

    for mod in ("executor", "executor.device_run", "executor.measure", "optimizer.realrun.grid", "optimizer.realrun.calibration",
                "optimizer.realrun.measurement", "optimizer.cli.gpu_cmds"):
        importlib.import_module(mod)
