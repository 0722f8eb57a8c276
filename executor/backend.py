"""Array backends: NumPy always; CuPy when installed and a GPU is present.

Kernels are written once against the array API; this module hands them ``xp``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class BackendError(RuntimeError):
    """The requested backend cannot run here (e.g. CuPy or a GPU is missing)."""


BACKENDS = ("numpy", "cupy")


def get_backend(name: str) -> Any:
    if name == "numpy":
        return np
    if name == "cupy":
        try:
            import cupy  # noqa: PLC0415  (optional dependency, imported lazily)
        except ImportError:
            raise BackendError("backend 'cupy' needs CuPy: pip install 'tapestry[gpu]' on a machine with an "
                               "NVIDIA GPU, or use --backend numpy") from None
        try:
            ok = cupy.cuda.is_available()
        except Exception:  # noqa: BLE001  (driver errors surface as assorted exception types)
            ok = False
        if not ok:
            raise BackendError("backend 'cupy' found no usable NVIDIA GPU (cupy.cuda.is_available() is false); "
                               "use --backend numpy") from None
        return cupy
    raise BackendError(f"unknown backend {name!r}; backends are {list(BACKENDS)}")


def to_numpy(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def exec_dtype(xp: Any, dtype: str) -> Any:
    """Storage dtype used for execution: bfloat16 runs as float32 where the backend lacks it."""
    if dtype == "bfloat16":
        return xp.float32
    return getattr(xp, dtype)
