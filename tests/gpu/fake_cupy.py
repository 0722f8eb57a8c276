"""A NumPy-backed stand-in for the slice of CuPy the executor uses (tests only).

It lets the GPU-only code paths (device contexts, CUDA-event clocks, copies between GPUs, GPU
names, ``resources={"GPU": 1}`` bookkeeping) run on machines without a GPU, and it enforces the
rules that make host/device mixups fail on a real GPU, so they fail here too:

- NumPy *functions* refuse device arrays (``np.concatenate(d)`` raises ``TypeError``), and CuPy
  functions and operators refuse host arrays (``cupy.exp(h)``, ``d + h`` raise ``TypeError``);
  ``asarray``/``asnumpy``/``.get()`` are the only ways across.
- A device array lives on one GPU; using it in a kernel (function, operator, or assignment
  into another GPU's array) while another GPU is current raises ``ValueError``. This is stricter
  than CuPy with peer access, which is the point: the executor copies explicitly (``copy`` under
  the destination's ``Device``), and only that counts as a peer copy.

Numerics are NumPy's, events read ``perf_counter``; real GPU behaviour stays for ``-m gpu``.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import numpy as np

_local = threading.local()


def _current() -> int:
    return getattr(_local, "device", 0)


class ndarray(np.ndarray):  # noqa: N801  (CuPy's name)
    """A device array: NumPy memory tagged with the GPU it lives on."""

    gpu: int

    def __array_finalize__(self, obj: Any) -> None:
        self.gpu = getattr(obj, "gpu", _current())

    def get(self) -> np.ndarray:
        """Copy to the host (as ``cupy.ndarray.get``)."""
        return np.array(self.view(np.ndarray))

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, out: Any = None, **kwargs: Any) -> Any:
        _check(inputs + tuple(out or ()), f"{ufunc.__name__}.{method}")
        if out is not None:
            kwargs["out"] = tuple(_plain(o) for o in out)
        res = getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(res)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise TypeError(f"numpy.{func.__name__} was given a device array: use the backend's own function "
                        f"(xp.{func.__name__}) or copy to the host first (.get(), cupy.asnumpy)")

    def __setitem__(self, key: Any, value: Any) -> None:
        _check((self, value), "setitem")
        super().__setitem__(key, _plain(value))


def _plain(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x.view(np.ndarray) if isinstance(x, ndarray) else x


def _wrap(x: Any) -> Any:
    if isinstance(x, np.ndarray) and not isinstance(x, ndarray):
        return x.view(ndarray)
    if isinstance(x, np.generic):  # CuPy reductions return 0-d device arrays, never host scalars
        return np.asarray(x).view(ndarray)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    return x


def _check(args: Any, what: str) -> None:
    """Refuse host arrays and arrays of another GPU than the current one."""
    for a in args:
        if isinstance(a, (list, tuple)):
            _check(a, what)
        elif isinstance(a, ndarray):
            if a.gpu != _current():
                raise ValueError(f"{what}: an array on GPU {a.gpu} was used while GPU {_current()} is current")
        elif isinstance(a, np.ndarray) and a.ndim > 0:
            raise TypeError(f"{what}: unsupported type numpy.ndarray (a host array given to a device function)")


def make_fake_cupy(n_gpus: int = 2, available: bool = True) -> types.ModuleType:
    """A module that imports as ``cupy``; ``stats`` counts events, elapsed-time reads and copies."""
    mod = types.ModuleType("cupy")
    stats = {"events": 0, "elapsed": 0, "peer_copies": 0, "to_device": 0, "to_host": 0}

    def asarray(a: Any, dtype: Any = None) -> ndarray:
        if isinstance(a, ndarray):
            return a if dtype is None else a.astype(dtype)
        stats["to_device"] += 1
        return np.array(a, dtype=dtype).view(ndarray)

    def asnumpy(a: Any) -> np.ndarray:
        stats["to_host"] += 1
        return a.get() if isinstance(a, ndarray) else np.asarray(a)

    def copy(a: ndarray) -> ndarray:
        """A copy on the current GPU (CuPy copies across devices this way)."""
        if isinstance(a, ndarray) and a.gpu != _current():
            stats["peer_copies"] += 1
        return np.array(_plain(a)).view(ndarray)

    def __getattr__(name: str) -> Any:
        value = getattr(np, name)
        if not callable(value) or isinstance(value, type):
            return value  # dtypes, constants

        def device_fn(*args: Any, **kwargs: Any) -> Any:
            _check(args, name)
            return _wrap(value(*(_plain(a) for a in args), **{k: _plain(v) for k, v in kwargs.items()}))

        device_fn.__name__ = name
        return device_fn

    class CUDARuntimeError(RuntimeError):
        pass

    class Device:
        def __init__(self, device: int | None = None) -> None:
            self.id = _current() if device is None else int(device)
            if not 0 <= self.id < n_gpus:
                raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
            self._prev: list[int] = []

        def __enter__(self) -> "Device":
            self._prev.append(_current())
            _local.device = self.id
            return self

        def __exit__(self, *exc: Any) -> None:
            _local.device = self._prev.pop()

        def use(self) -> None:
            _local.device = self.id

        def synchronize(self) -> None:
            pass

    class Event:
        def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
            self.t: float | None = None
            self.gpu = _current()

        def record(self, stream: Any = None) -> None:
            self.t, self.gpu = time.perf_counter(), _current()
            stats["events"] += 1

        def synchronize(self) -> None:
            if self.t is None:
                raise CUDARuntimeError("cudaErrorInvalidResourceHandle: event never recorded")

    def get_elapsed_time(start: Event, end: Event) -> float:
        if start.t is None or end.t is None:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle: event never recorded")
        if start.gpu != end.gpu:
            raise CUDARuntimeError(f"events of GPUs {start.gpu} and {end.gpu} cannot be compared")
        stats["elapsed"] += 1
        return (end.t - start.t) * 1e3  # milliseconds, as CUDA reports

    class Stream:
        def synchronize(self) -> None:
            pass

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: n_gpus,
        getDeviceProperties=lambda i: {"name": f"Fake GPU {Device(i).id}".encode(), "totalGlobalMem": 80 << 30},
        CUDARuntimeError=CUDARuntimeError)
    mod.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_available=lambda: available, Device=Device, Event=Event, get_elapsed_time=get_elapsed_time,
        get_current_stream=lambda: Stream(), runtime=runtime)
    mod.ndarray = ndarray  # type: ignore[attr-defined]
    mod.asarray, mod.asnumpy, mod.copy = asarray, asnumpy, copy  # type: ignore[attr-defined]
    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    mod.stats = stats  # type: ignore[attr-defined]
    return mod


def make_fake_cupyx() -> dict[str, types.ModuleType]:
    """``cupyx.scipy.special`` with ``erf`` (the one cupyx function the kernels use), on the fake's
    arrays: the modules to put in ``sys.modules`` beside the fake ``cupy``."""
    import scipy.special  # noqa: PLC0415

    special = types.ModuleType("cupyx.scipy.special")

    def erf(x: Any) -> Any:
        _check((x,), "erf")
        return _wrap(scipy.special.erf(_plain(x)))

    special.erf = erf
    sci = types.ModuleType("cupyx.scipy")
    sci.special = special
    root = types.ModuleType("cupyx")
    root.scipy = sci
    return {"cupyx": root, "cupyx.scipy": sci, "cupyx.scipy.special": special}
