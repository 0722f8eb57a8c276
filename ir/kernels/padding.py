"""Padding along one axis: ``pad`` (a constant around ``x``, or a crop) and ``pad_copy`` (cells of
``x`` copied outward: ONNX ``Pad`` modes ``edge``, ``reflect``, ``wrap``), with ``pad_copy_grad``.

- ``pad(x, axis, before, after, value)``: ``y[i] = x[i - before]`` where that cell exists, else
  ``value``; ``before``/``after`` may be negative (cells cropped, ONNX ``Pad``'s negative pads).
  Index space = output shape, input projection ``i - before`` (affine, exact): cells outside ``x``
  read as zeros, as conv halos do, so with ``value == 0`` the block function is the identity; a
  nonzero ``value`` fills the cells whose source lies outside ``x`` (``run`` knows the box). Its
  gradient is ``pad(dy, -before, -after)``: the adjoint of padding is cropping and vice versa.
- ``pad_copy(x, axis, before, after, mode)`` (``before, after >= 0``): ``y[i] = x[src(i)]`` with
  ``src`` NumPy's ``np.pad`` index map for ``mode`` (``edge``: clamp; ``reflect``: mirror without
  the edge cell; ``wrap``: modulo), which is what the ONNX reference evaluates (ONNX ``Pad``-19
  §modes). ``src`` is not affine near the edges, so the projection reads ``x`` whole along
  ``axis`` (a superset that is exact for any box; other dims map one to one): shards split along
  the other dims read nothing twice, shards along ``axis`` re-read the axis (as the pooling
  gradients re-read a plane).
- ``pad_copy_grad(dy, axis, before, after, mode, size)``: ``dx[j] = Σ_{src(i) = j} dy[i]``, ``size``
  the forward input's extent along ``axis``; reads ``dy`` whole along ``axis``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ir.kernels.base import ELEMENTWISE, Kernel, Signature, SignatureError, TensorSpec
from ir.kernels.elementwise import elementwise_dims
from ir.kernels.select import axis_of
from ir.zspace import Projection, identity_projection

COPY_MODES = ("edge", "reflect", "wrap")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Pad(Kernel):
    name = "pad"
    inputs = ("x",)
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    params_defaults = {"axis": 0, "before": 0, "after": 0, "value": 0.0}

    def base_signature(self, ins, params):
        shape = ins["x"].shape
        ax = axis_of(params, len(shape), "pad")
        before, after, value = params["before"], params["after"], params["value"]
        if not (_int(before) and _int(after)) or shape[ax] + before + after < 1:
            raise SignatureError(f"pad needs integers before, after (negative: cropped) leaving at least one cell "
                                 f"of the {shape[ax]} along axis {ax}, got before={before!r}, after={after!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not np.isfinite(value):
            raise SignatureError(f"pad value must be a finite number, got {value!r}")
        n = len(shape)
        out = shape[:ax] + (shape[ax] + before + after,) + shape[ax + 1:]
        b = tuple(-before if k == ax else 0 for k in range(n))
        return Signature(elementwise_dims(n), out, {"x": Projection(identity_projection(n).A, b, (1,) * n)},
                         identity_projection(n), TensorSpec(out, ins["x"].dtype), 0.0)

    def compute(self, xp, blocks, params):
        # the executor read zeros outside x; a nonzero fill needs the box (``run``), except for a
        # pad of nothing (the only pad ``fuse`` can take as a later stage: an aligned read)
        if params["value"] and (params["before"] or params["after"]):
            raise SignatureError("pad with a nonzero value runs through run() (it needs the shard's box)")
        return blocks["x"]

    def run(self, xp, blocks, params, box, sig):
        x = blocks["x"]
        if not params["value"]:
            return x
        ax = params["axis"] % x.ndim
        src = np.arange(box.start[ax], box.end[ax]) - params["before"]
        outside = (src < 0) | (src >= sig.in_specs["x"].shape[ax])
        if not outside.any():
            return x
        shape = [1] * x.ndim
        shape[ax] = -1
        mask = xp.reshape(xp.asarray(outside), shape)
        return xp.where(mask, x.dtype.type(params["value"]), x)


def source_index(n: int, before: int, after: int, mode: str) -> np.ndarray:
    """``src(i)`` for each output cell ``i`` of ``pad_copy`` (NumPy's ``np.pad`` index map)."""
    return np.pad(np.arange(n), (before, after), mode=mode)


def _check_copy(name: str, params: Mapping[str, Any], ax: int, n: int) -> None:
    """The pads and mode of ``pad_copy`` along axis ``ax`` of ``n`` cells (the input's)."""
    before, after, mode = params["before"], params["after"], params["mode"]
    if mode not in COPY_MODES:
        raise SignatureError(f"{name} mode must be one of {list(COPY_MODES)}, got {mode!r}")
    if not (_int(before) and _int(after)) or before < 0 or after < 0:
        raise SignatureError(f"{name} needs integers before, after >= 0, got before={before!r}, after={after!r}")
    if mode == "reflect" and n < 2 and (before or after):
        raise SignatureError(f"{name} mode 'reflect' needs at least 2 cells along axis {ax}, got {n}")


def _whole_axis(shape: tuple[int, ...], ax: int) -> Projection:
    """Identity on every dim but ``ax``, which is read whole (index dims: the output's)."""
    n = len(shape)
    rows = tuple(tuple(0 if k == ax else int(c == k) for c in range(n)) for k in range(n))
    return Projection(rows, (0,) * n, tuple(shape[ax] if k == ax else 1 for k in range(n)))


class PadCopy(Kernel):
    name = "pad_copy"
    inputs = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"axis": 0, "before": 0, "after": 0, "mode": "edge"}

    def base_signature(self, ins, params):
        shape = ins["x"].shape
        ax = axis_of(params, len(shape), self.name)
        _check_copy(self.name, params, ax, shape[ax])
        out = shape[:ax] + (shape[ax] + params["before"] + params["after"],) + shape[ax + 1:]
        return Signature(elementwise_dims(len(out)), out, {"x": _whole_axis(shape, ax)},
                         identity_projection(len(out)), TensorSpec(out, ins["x"].dtype), 0.0)

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        ax = params["axis"] % x.ndim
        src = source_index(x.shape[ax], params["before"], params["after"], params["mode"])
        return xp.take(x, xp.asarray(src), axis=ax)

    def run(self, xp, blocks, params, box, sig):
        x = blocks["x"]
        ax = params["axis"] % x.ndim
        src = source_index(x.shape[ax], params["before"], params["after"], params["mode"])
        return xp.take(x, xp.asarray(src[box.start[ax]: box.end[ax]]), axis=ax)


class PadCopyGrad(Kernel):
    name = "pad_copy_grad"
    inputs = ("dy",)
    kernel_class = "elementwise"
    params_defaults = {"axis": 0, "before": 0, "after": 0, "mode": "edge", "size": None}

    def base_signature(self, ins, params):
        dy = ins["dy"].shape
        size = params["size"]
        if not _int(size) or size < 1:
            raise SignatureError(f"{self.name} needs size >= 1 (the forward input's extent), got {size!r}")
        ax = axis_of(params, len(dy), self.name)
        _check_copy(self.name, params, ax, size)
        if dy[ax] != size + params["before"] + params["after"]:
            raise SignatureError(f"{self.name}: dy has {dy[ax]} cells along axis {ax}, not size + before + after = "
                                 f"{size + params['before'] + params['after']}")
        out = dy[:ax] + (size,) + dy[ax + 1:]
        return Signature(elementwise_dims(len(out)), out, {"dy": _whole_axis(dy, ax)},
                         identity_projection(len(out)), TensorSpec(out, ins["dy"].dtype), 1.0)

    def whole(self, xp: Any, dy: Any, params: Mapping[str, Any]) -> Any:
        ax = params["axis"] % dy.ndim
        before, size = params["before"], params["size"]
        src = source_index(size, before, params["after"], params["mode"])

        def at(i):
            idx = [slice(None)] * dy.ndim
            idx[ax] = slice(i, i + 1)
            return tuple(idx)

        dx = xp.take(dy, xp.asarray(np.arange(before, before + size)), axis=ax)  # the cells copied as they are
        for i in [*range(before), *range(before + size, dy.shape[ax])]:  # the padding adds to its sources
            dx[at(int(src[i]))] += dy[at(i)]
        return dx

    def compute(self, xp, blocks, params):
        return self.whole(xp, blocks["dy"], params)

    def run(self, xp, blocks, params, box, sig):
        dx = self.whole(xp, blocks["dy"], params)
        ax = params["axis"] % dx.ndim
        return xp.take(dx, xp.asarray(np.arange(box.start[ax], box.end[ax])), axis=ax)


KERNELS = (Pad, PadCopy, PadCopyGrad)
