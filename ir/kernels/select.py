"""Selection kernels for imported programs: where, concat and slice.

- ``where(c, a, b)``: ``a`` where ``c != 0`` else ``b``, numpy broadcasting of all three (the
  condition is a float mask: the IR has no boolean dtype). Elementwise.
- ``concat(a, b, axis)``: index dims are the output's dims without ``axis``; both inputs and the
  output are read and written whole along ``axis`` (hidden in the projection shapes), so a concat
  never splits along its axis and each shard writes one contiguous box. Concats of more than two
  tensors are chains of two-input concats.
- ``slice(x, axis, start, stop, step)``: index space = output shape; the input projection along
  ``axis`` is ``step·i + start`` (affine; a negative step, a reversal, is a negative coefficient),
  so any shard reads exactly the cells it needs.

Padding (``pad``, the gradient of a slice, and ``pad_copy``) is in ``ir.kernels.padding``.
"""

from __future__ import annotations

from ir.kernels.base import ELEMENTWISE, Kernel, Signature, SignatureError, TensorSpec, broadcast_shape, \
    unit_row, zero_row
from ir.kernels.elementwise import broadcast_projection, elementwise_dims
from ir.zspace import Projection, identity_projection


class Where(Kernel):
    name = "where"
    inputs = ("c", "a", "b")
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"

    def base_signature(self, ins, params):
        out = broadcast_shape([ins["c"].shape, ins["a"].shape, ins["b"].shape])
        return Signature(elementwise_dims(len(out)), out,
                         {p: broadcast_projection(ins[p].shape, out) for p in self.inputs},
                         identity_projection(len(out)), TensorSpec(out, ins["a"].dtype), 1.0)

    def compute(self, xp, blocks, params):
        return xp.where(blocks["c"] != 0, blocks["a"], blocks["b"])


def axis_of(params, rank: int, kernel: str) -> int:
    """``params["axis"]`` checked against ``rank`` and made non-negative."""
    a = params["axis"]
    if not isinstance(a, int) or isinstance(a, bool) or not -rank <= a < rank:
        raise SignatureError(f"{kernel} axis {a!r} is out of range for rank {rank}")
    return a % rank


def whole_along(shape: tuple[int, ...], axis: int) -> Projection:
    """Identity on every dim but ``axis``, which is read whole (index dims skip ``axis``)."""
    n = len(shape) - 1
    rows, s = [], []
    for k, ext in enumerate(shape):
        if k == axis:
            rows.append(zero_row(n))
            s.append(ext)
        else:
            rows.append(unit_row(n, k if k < axis else k - 1))
            s.append(1)
    return Projection(tuple(rows), (0,) * len(shape), tuple(s))


class Concat(Kernel):
    name = "concat"
    inputs = ("a", "b")
    kernel_class = "elementwise"
    params_defaults = {"axis": 0}

    def base_signature(self, ins, params):
        a, b = ins["a"].shape, ins["b"].shape
        if len(a) != len(b):
            raise SignatureError(f"concat needs inputs of one rank, got {list(a)} and {list(b)}")
        ax = axis_of(params, len(a), "concat")
        if a[:ax] + a[ax + 1:] != b[:ax] + b[ax + 1:]:
            raise SignatureError(f"concat along axis {ax} needs equal other dims, got {list(a)} and {list(b)}")
        out = a[:ax] + (a[ax] + b[ax],) + a[ax + 1:]
        dims = tuple(f"d{k}" for k in range(len(out)) if k != ax)
        return Signature(dims, out[:ax] + out[ax + 1:], {"a": whole_along(a, ax), "b": whole_along(b, ax)},
                         whole_along(out, ax), TensorSpec(out, ins["a"].dtype), 0.0)

    def compute(self, xp, blocks, params):
        return xp.concatenate([blocks["a"], blocks["b"]], axis=params["axis"])


def slice_bounds(n: int, start: int, stop: int | None, step: int) -> tuple[int, int]:
    """``(stop, cells)`` of a slice along an axis of ``n`` cells: ``stop`` resolved (None: past the
    end the step walks to, ``n`` or -1) and the number of cells read. Raises ``SignatureError``
    unless ``0 <= start < stop <= n`` (``step >= 1``) or ``-1 <= stop < start < n`` (``step <= -1``)."""
    stop = (n if step > 0 else -1) if stop is None else stop
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop, step)) and step != 0 and (
        0 <= start < stop <= n if step > 0 else -1 <= stop < start < n)
    if not ok:
        raise SignatureError(f"slice needs integers 0 <= start < stop <= {n} with step >= 1, or -1 <= stop < start "
                             f"< {n} with step <= -1, got start={start!r}, stop={stop!r}, step={step!r}")
    return stop, (abs(stop - start) + abs(step) - 1) // abs(step)


class Slice(Kernel):
    """``y[i] = x[start + step·i]`` along ``axis``, for ``i`` while the cell lies between ``start``
    and ``stop`` (exclusive); a negative ``step`` walks down from ``start`` (``x[::-1]``,
    ``torch.flip``: ``start = n - 1``, ``stop = -1``), an affine projection with a negative
    coefficient (``ir.zspace`` maps a box through it by interval arithmetic, exactly)."""

    name = "slice"
    inputs = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"axis": 0, "start": 0, "stop": None, "step": 1}

    def base_signature(self, ins, params):
        shape = ins["x"].shape
        ax = axis_of(params, len(shape), "slice")
        start, step = params["start"], params["step"]
        _, cells = slice_bounds(shape[ax], start, params["stop"], step)
        n = len(shape)
        out = shape[:ax] + (cells,) + shape[ax + 1:]
        rows = tuple(tuple(step * int(c == k) if k == ax else int(c == k) for c in range(n)) for k in range(n))
        b = tuple(start if k == ax else 0 for k in range(n))
        return Signature(elementwise_dims(n), out, {"x": Projection(rows, b, (1,) * n)}, identity_projection(n),
                         TensorSpec(out, ins["x"].dtype), 0.0)

    def compute(self, xp, blocks, params):
        # the block is exactly the cells read, lowest first: a negative step starts from its last
        x = blocks["x"]
        idx = [slice(None)] * x.ndim
        idx[params["axis"] % x.ndim] = slice(None, None, params["step"])
        return x[tuple(idx)]


KERNELS = (Where, Concat, Slice)
