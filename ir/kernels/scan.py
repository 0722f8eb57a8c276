"""``cumsum``: the running sum along one axis (ONNX ``CumSum``, ``torch.cumsum``).

``y[i] = Σ_{j <= i} x[j]``; ``exclusive`` leaves out ``x[i]`` itself (``Σ_{j < i}``, 0 first) and
``reverse`` sums from the end (``Σ_{j >= i}``), the ONNX ``CumSum`` attributes (opset 11 and 14).
Every output cell along the axis depends on a prefix of it, so the axis is read and written whole
(hidden in the projection shapes, as ``concat`` and the row-wise kernels hide theirs): the index
dims are the other dims, which shard with no halo. Its gradient is the cumsum of ``dy`` in the
other direction with the same ``exclusive``: ``dx[j] = Σ_{i >= j} dy[i]`` (rule in
``ir.autodiff.rules``).
"""

from __future__ import annotations

from ir.kernels.base import Kernel, Signature, SignatureError, TensorSpec
from ir.kernels.select import axis_of, whole_along


class CumSum(Kernel):
    name = "cumsum"
    inputs = ("x",)
    kernel_class = "rowwise"
    params_defaults = {"axis": 0, "exclusive": False, "reverse": False}

    def base_signature(self, ins, params):
        shape = ins["x"].shape
        ax = axis_of(params, len(shape), self.name)
        for flag in ("exclusive", "reverse"):
            if not isinstance(params[flag], bool):
                raise SignatureError(f"cumsum {flag} must be true or false, got {params[flag]!r}")
        dims = tuple(f"d{k}" for k in range(len(shape)) if k != ax)
        return Signature(dims, shape[:ax] + shape[ax + 1:], {"x": whole_along(shape, ax)}, whole_along(shape, ax),
                         TensorSpec(shape, ins["x"].dtype), float(shape[ax]))

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        ax = params["axis"] % x.ndim
        if params["reverse"]:
            x = xp.flip(x, axis=ax)
        y = xp.cumsum(x, axis=ax)
        if params["exclusive"]:  # shifted one cell along the axis, 0 first (not y - x: no cancellation)
            y = xp.concatenate([xp.zeros_like(xp.take(y, xp.asarray([0]), axis=ax)),
                                xp.take(y, xp.arange(y.shape[ax] - 1), axis=ax)], axis=ax)
        return xp.flip(y, axis=ax) if params["reverse"] else y


KERNELS = (CumSum,)
