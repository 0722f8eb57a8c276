"""The ``cupy`` fixture: every test here runs on a NumPy-backed fake of CuPy with two GPUs
(always; it exercises the GPU-only code paths on any machine) and on the real CuPy when a GPU is
present (marked ``gpu``: ``pytest -m gpu``)."""

from __future__ import annotations

import sys

import pytest
from fake_cupy import make_fake_cupy, make_fake_cupyx


def _real_cupy():
    cupy = pytest.importorskip("cupy")
    try:
        ok = bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001  (driver errors come as assorted types)
        ok = False
    if not ok:
        pytest.skip("no usable NVIDIA GPU (cupy.cuda.is_available() is false)")
    return cupy


@pytest.fixture(params=["fake", pytest.param("gpu", marks=pytest.mark.gpu)])
def cupy(request, monkeypatch):
    if request.param == "gpu":
        return _real_cupy()
    fake = make_fake_cupy(n_gpus=2)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for name, module in make_fake_cupyx().items():
        monkeypatch.setitem(sys.modules, name, module)
    return fake


@pytest.fixture
def real_cupy():
    """Only the real CuPy (e.g. for Dask worker processes, which never see the fake)."""
    return _real_cupy()
