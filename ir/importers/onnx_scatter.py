"""ONNX ``ScatterND`` that writes a box -> ``slice`` and ``concat`` (registered in ``HANDLERS``).

PyTorch exports slice assignment (``y[..., a:b] = x``, ``y[..., a:b].copy_(x)``) as ``ScatterND``
with constant indices that enumerate every cell of the box, in row-major order: DeepSeek's MLA
builds its keys so, writing the positional-free and the rotary parts of a ``new_empty`` tensor.
The result is ``data`` with that box replaced by ``updates``: along each axis the box does not
cover, the kept part of ``data`` before it, the box, and the kept part after it are concatenated
(axes outer to inner). A kept part of a ``concat`` (an earlier scatter's result) that is one of
its operands is that operand, not a slice of the concat: two scatters filling a tensor end as
one ``concat`` of the two updates, and the ``new_empty`` constant they overwrote is pruned.
Indices that are computed, repeated, out of order or not a box (a gather-like scatter), and a
``reduction`` other than ``none``, are refused naming the reason.
"""

from __future__ import annotations

import numpy as np

from ir.importers.onnx_ops import Unsupported, attr, handles


def _box(idx: np.ndarray, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[(lo, hi)]`` over the first ``q`` axes when the index rows ``idx[N, q]`` enumerate the box
    ``lo <= i < hi`` in row-major order, else Unsupported."""
    q = idx.shape[1]
    idx = np.where(idx < 0, idx + np.asarray(shape[:q]), idx)
    if idx.size == 0 or idx.min() < 0 or (idx >= np.asarray(shape[:q])).any():
        raise Unsupported("its indices are empty or fall outside the data")
    box = [(int(idx[:, a].min()), int(idx[:, a].max()) + 1) for a in range(q)]
    grid = np.stack(np.meshgrid(*[np.arange(lo, hi) for lo, hi in box], indexing="ij"), -1).reshape(-1, q)
    if grid.shape != idx.shape or not np.array_equal(grid, idx):
        raise Unsupported("its indices are not a box of cells in row-major order (only slice assignment maps)")
    return box


def _piece(ctx, x: str, axis: int, start: int, stop: int, label: str) -> str | None:
    """Graph tensor of ONNX value or graph tensor ``x`` sliced to ``[start, stop)`` on ``axis``;
    None when empty. Constants are sliced here; a ``concat`` on ``axis`` is looked through."""
    if start >= stop:
        return None
    if ctx.is_const(x):
        v = ctx.const[x]
        if start == 0 and stop == v.shape[axis]:
            return ctx.use(x)
        name = f"{x}[{axis}:{start}:{stop}]"
        ctx.const[name] = np.take(v, np.arange(start, stop), axis=axis)
        return ctx.use(name)
    t = ctx.use(x)
    shape = ctx.prog.spec(t).shape
    if start == 0 and stop == shape[axis]:
        return t
    op = ctx.prog.producer(t)
    if op is not None and op.kernel == "concat" and op.params.get("axis", 0) % len(shape) == axis:
        na = ctx.prog.spec(op.inputs["a"]).shape[axis]
        if stop <= na:
            return _piece(ctx, op.inputs["a"], axis, start, stop, label)
        if start >= na:
            return _piece(ctx, op.inputs["b"], axis, start - na, stop - na, label)
    return ctx.emit("slice", {"x": t}, {"axis": axis, "start": start, "stop": stop, "step": 1}, name=label)


def _replace(ctx, data: str, region: str, box: list[tuple[int, int]], axis: int, label: str, out: str | None) -> str:
    """``data`` (an ONNX value or graph tensor, of the box's extent on axes before ``axis``) with
    ``box`` from ``axis`` on replaced by ``region``."""
    shape = ctx.shape(data)
    while axis < len(box) and box[axis] == (0, shape[axis]):
        axis += 1
    if axis == len(box):  # the box covers the rest: the region is the result
        if out is not None:
            ctx.set(out, region)
        return region
    lo, hi = box[axis]
    middle = _replace(ctx, _piece(ctx, data, axis, lo, hi, f"{label}.in{axis}"), region, box, axis + 1,
                      f"{label}.{axis}", None)
    parts = [p for p in (_piece(ctx, data, axis, 0, lo, f"{label}.before{axis}"), middle,
                         _piece(ctx, data, axis, hi, shape[axis], f"{label}.after{axis}")) if p is not None]
    y = parts[0]
    for k, p in enumerate(parts[1:], start=1):
        last = k == len(parts) - 1
        y = ctx.emit("concat", {"a": y, "b": p}, {"axis": axis}, out=out if last and out is not None else None,
                     name=f"{label}.cat{axis}" if k == 1 else f"{label}.cat{axis}.{k}")
    return y


@handles("ScatterND")
def _scatter_nd(ctx, node, label):
    data, indices, updates = node.input[:3]
    if attr(node, "reduction", "none") != "none":
        raise Unsupported(f"reduction {attr(node, 'reduction')!r} (only a plain write maps)")
    if not ctx.is_const(indices):
        raise Unsupported("its indices are computed (only constant indices, slice assignment, map)")
    shape = tuple(ctx.shape(data))
    idx = np.asarray(ctx.value(indices)).astype(np.int64)
    q = idx.shape[-1]
    box = _box(idx.reshape(-1, q), shape)
    region_shape = [hi - lo for lo, hi in box] + list(shape[q:])
    region = ctx.use(updates)
    upd_shape = list(ctx.prog.spec(region).shape)
    if upd_shape != region_shape:  # the index grid's own shape (a row-major regrouping of the box)
        region = ctx.emit("reshape", {"x": region}, {"shape": region_shape, "from": upd_shape},
                          name=f"{label}.box")
    _replace(ctx, data, region, box, 0, label, node.output[0])
