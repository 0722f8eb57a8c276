"""ONNX ``Pad``, ``Tile``, ``CumSum`` and nearest ``Resize``/``Upsample`` -> kernels (registered in
``HANDLERS``).

- ``Pad`` (pads as an attribute before opset 11, a constant input from 11; ``constant_value`` a
  constant input or the ``value`` attribute; the optional ``axes`` input of opset 18): one op per
  padded axis. Mode ``constant`` is ``pad`` (negative pads crop: ``torch.nn.functional.pad`` with
  negative widths); ``edge``, ``reflect`` and ``wrap`` are ``pad_copy`` (``ir.kernels.padding``),
  whose pads must be >= 0. Padding axis by axis is what ``np.pad`` (ONNX's reference) does, so
  the corners agree. Pads, value or axes that the model computes are refused: they would be a
  shape the graph cannot know.
- ``Tile`` with constant repeats ``r``: per repeated axis, ``expand`` inserts a new dim of ``r``
  before it and a ``reshape`` merges ``[r, n] -> [r·n]`` (row-major: the whole axis, ``r`` times).
  Both kernels shard exactly and have VJPs (the gradient sums the copies).
- ``CumSum`` with a constant axis is ``cumsum`` (``exclusive``, ``reverse`` attributes).
- ``Resize`` (opset 10+) and ``Upsample`` (opset 7-9) in mode ``nearest`` with integer scale
  factors ``s >= 1`` (from ``scales``, or ``sizes`` that are multiples of the input's): per scaled
  axis, ``expand`` inserts a new dim of ``s`` *after* it and a ``reshape`` merges ``[n, s] ->
  [n·s]``, i.e. ``y[i] = x[i // s]`` (UNet's ``nn.Upsample(scale_factor=2)``). That is ONNX's
  nearest map whenever the coordinate transformation and rounding mode give ``i // s`` for every
  output cell (checked on the spec's formulas, Resize-19 §coordinate_transformation_mode and
  §nearest_mode: ``asymmetric`` with ``floor`` as torch exports, ``half_pixel`` with any rounding,
  ...); any other map, mode (``linear``, ``cubic``), a down-scale or a non-integer scale is refused
  naming the node and the reason.
"""

from __future__ import annotations

import math

import numpy as np

from ir.importers.onnx_ops import Unsupported, attr, handles


def _const_input(ctx, node, k: int, what: str) -> np.ndarray | None:
    """The constant value of optional input ``k``, None when absent; refused when computed."""
    if len(node.input) <= k or not node.input[k]:
        return None
    name = node.input[k]
    if not ctx.is_const(name):
        raise Unsupported(f"its {what} {name!r} is not a constant (the model computes it, or it is a graph input); "
                          f"only constant {what} are supported")
    return np.asarray(ctx.const[name])


def _axes_of(ctx, node, k: int, rank: int) -> list[int]:
    axes = _const_input(ctx, node, k, "axes")
    if axes is None:
        return list(range(rank))
    out = [int(a) % rank for a in axes.reshape(-1)]
    if len(set(out)) != len(out):
        raise Unsupported(f"axes {axes.reshape(-1).tolist()} repeat an axis")
    return out


# -- Pad ----------------------------------------------------------------------------------------

@handles("Pad")
def _pad(ctx, node, label):
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    mode = attr(node, "mode", "constant")
    if ctx.opset < 11:
        pads, value, axes = attr(node, "pads", None), float(attr(node, "value", 0.0)), list(range(len(shape)))
        if pads is None:
            raise Unsupported("no pads attribute")
    else:
        pads = _const_input(ctx, node, 1, "pads")
        if pads is None:
            raise Unsupported("no pads input")
        v = _const_input(ctx, node, 2, "constant_value")
        if v is not None and v.size != 1:
            raise Unsupported(f"constant_value of shape {list(v.shape)}; ONNX Pad takes a scalar")
        value = 0.0 if v is None else float(np.asarray(v, dtype=np.float64).reshape(-1)[0])
        axes = _axes_of(ctx, node, 3, len(shape))
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    if len(pads) != 2 * len(axes):
        raise Unsupported(f"{len(pads)} pads for {len(axes)} axes (ONNX wants begin and end for each)")
    if mode not in ("constant", "edge", "reflect", "wrap"):
        raise Unsupported(f"mode {mode!r} (constant, edge, reflect and wrap are supported)")
    if mode == "constant" and not math.isfinite(value):
        raise Unsupported(f"constant_value {value} (only finite fills)")
    cuts = [(a, pads[k], pads[len(axes) + k]) for k, a in enumerate(axes) if pads[k] or pads[len(axes) + k]]
    if mode != "constant" and any(b < 0 or e < 0 for _, b, e in cuts):
        raise Unsupported(f"negative pads {pads} (cropping) in mode {mode!r}; only mode 'constant' crops")
    for a, b, e in cuts:
        if shape[a] + b + e < 1:
            raise Unsupported(f"pads {pads} crop axis {a} of {shape[a]} cells to nothing")
    if not cuts:
        ctx.set(node.output[0], x)
        return
    for k, (a, b, e) in enumerate(cuts):
        last = k == len(cuts) - 1
        kernel, params = ("pad", {"value": value}) if mode == "constant" else ("pad_copy", {"mode": mode})
        x = ctx.emit(kernel, {"x": x}, {"axis": a, "before": b, "after": e, **params},
                     out=node.output[0] if last else None, name=label if k == 0 else f"{label}.{k}")


# -- Tile, Resize, Upsample: expand + reshape ------------------------------------------------------

def _repeat(ctx, x: str, axis: int, times: int, inner: bool, out: str | None, label: str) -> str:
    """``x`` repeated ``times`` along ``axis``: each cell in turn (``inner``: ``y[i] = x[i // times]``)
    or the whole axis in turn (``y[i] = x[i % n]``)."""
    shape = list(ctx.prog.spec(x).shape)
    dim = axis + 1 if inner else axis
    y = ctx.emit("expand", {"x": x}, {"dim": dim, "size": times}, name=label)
    grown = ctx.prog.spec(y).shape
    merged = shape[:axis] + [shape[axis] * times] + shape[axis + 1:]
    return ctx.emit("reshape", {"x": y}, {"shape": merged, "from": list(grown)}, out=out, name=f"{label}.merge")


def _repeat_axes(ctx, node, label: str, factors: list[int], inner: bool) -> None:
    x = ctx.use(node.input[0])
    todo = [(a, f) for a, f in enumerate(factors) if f != 1]
    if not todo:
        ctx.set(node.output[0], x)
        return
    for k, (a, f) in enumerate(todo):
        last = k == len(todo) - 1
        x = _repeat(ctx, x, a, f, inner, node.output[0] if last else None, label if k == 0 else f"{label}.{k}")


@handles("Tile")
def _tile(ctx, node, label):
    shape = ctx.shape(node.input[0])
    reps = _const_input(ctx, node, 1, "repeats")
    if reps is None:
        raise Unsupported("no repeats input")
    reps = [int(r) for r in reps.reshape(-1)]
    if len(reps) != len(shape) or any(r < 1 for r in reps):
        raise Unsupported(f"repeats {reps} for an input of rank {len(shape)} (one repeat >= 1 per axis)")
    _repeat_axes(ctx, node, label, reps, inner=False)


@handles("CumSum")
def _cumsum(ctx, node, label):
    axis = _const_input(ctx, node, 1, "axis")
    if axis is None or axis.size != 1:
        raise Unsupported("the axis input must be one constant integer")
    x = ctx.use(node.input[0])
    ctx.emit("cumsum", {"x": x}, {"axis": int(axis.reshape(-1)[0]) % len(ctx.prog.spec(x).shape),
                                  "exclusive": bool(attr(node, "exclusive", 0)),
                                  "reverse": bool(attr(node, "reverse", 0))}, out=node.output[0], name=label)


def nearest_source(n: int, s: int, transform: str, rounding: str) -> np.ndarray:
    """The input cell ONNX's nearest ``Resize`` reads for each of the ``n·s`` output cells of an
    axis of ``n`` scaled by ``s`` (Resize-19: the coordinate transformation, then the rounding,
    then clamped into the axis)."""
    m = n * s
    i = np.arange(m, dtype=np.float64)
    if transform in ("half_pixel", "half_pixel_symmetric"):  # symmetric: its centre shift is 0 at m = n·s
        c = (i + 0.5) / s - 0.5
    elif transform == "pytorch_half_pixel":
        c = (i + 0.5) / s - 0.5 if m > 1 else np.zeros(m)
    elif transform == "align_corners":
        c = i * (n - 1) / (m - 1) if m > 1 else np.zeros(m)
    elif transform == "asymmetric":
        c = i / s
    elif transform == "tf_half_pixel_for_nn":
        c = (i + 0.5) / s
    else:
        raise Unsupported(f"coordinate_transformation_mode {transform!r} (it needs a region of interest)")
    r = {"round_prefer_floor": np.ceil(c - 0.5), "round_prefer_ceil": np.floor(c + 0.5), "floor": np.floor(c),
         "ceil": np.ceil(c)}.get(rounding)
    if r is None:
        raise Unsupported(f"nearest_mode {rounding!r}")
    return np.clip(r, 0, n - 1).astype(np.int64)


def _integer_scales(ctx, node, shape, scales, sizes, axes) -> list[int]:
    full = [1.0] * len(shape)
    if sizes is not None and sizes.size:
        if attr(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
            raise Unsupported("keep_aspect_ratio_policy other than 'stretch'")
        for a, m in zip(axes, sizes.reshape(-1).tolist()):
            full[a] = m / shape[a]
    elif scales is not None and scales.size:
        for a, v in zip(axes, scales.reshape(-1).tolist()):
            full[a] = float(v)
    else:
        raise Unsupported("neither scales nor sizes is given")
    out = []
    for a, v in enumerate(full):
        if v < 1 or v != int(v):
            raise Unsupported(f"scale {v:g} on axis {a}; only integer up-scales (1, 2, 3, ...) are supported")
        out.append(int(v))
    return out


@handles("Resize")
def _resize(ctx, node, label):
    mode = attr(node, "mode", "nearest")
    if mode != "nearest":
        raise Unsupported(f"mode {mode!r}; only 'nearest' with integer scales is supported")
    shape = ctx.shape(node.input[0])
    if ctx.opset < 11:  # Resize-10: (X, scales), asymmetric coordinates, rounded
        scales, sizes, axes = _const_input(ctx, node, 1, "scales"), None, list(range(len(shape)))
        transform, rounding = "asymmetric", "round_prefer_floor"
    else:
        scales, sizes = _const_input(ctx, node, 2, "scales"), _const_input(ctx, node, 3, "sizes")
        axes = attr(node, "axes", None)
        axes = list(range(len(shape))) if axes is None else [int(a) % len(shape) for a in axes]
        transform = attr(node, "coordinate_transformation_mode", "half_pixel")
        rounding = attr(node, "nearest_mode", "round_prefer_floor")
    factors = _integer_scales(ctx, node, shape, scales, sizes, axes)
    for a, s in enumerate(factors):
        if s > 1 and not np.array_equal(nearest_source(shape[a], s, transform, rounding),
                                        np.arange(shape[a] * s) // s):
            raise Unsupported(f"coordinate_transformation_mode {transform!r} with nearest_mode {rounding!r} at "
                              f"scale {s} on axis {a} does not read each input cell {s} times in turn; only "
                              f"that block repeat is supported")
    _repeat_axes(ctx, node, label, factors, inner=True)


@handles("Upsample")
def _upsample(ctx, node, label):
    mode = attr(node, "mode", "nearest")
    if mode != "nearest":
        raise Unsupported(f"mode {mode!r}; only 'nearest' with integer scales is supported")
    shape = ctx.shape(node.input[0])
    scales = attr(node, "scales", None)
    scales = np.asarray(scales) if scales is not None else _const_input(ctx, node, 1, "scales")
    # Upsample's nearest is ``y[i] = x[floor(i / s)]`` (Upsample-9, and onnx.reference repeats cells)
    _repeat_axes(ctx, node, label, _integer_scales(ctx, node, shape, scales, None, list(range(len(shape)))),
                 inner=True)
