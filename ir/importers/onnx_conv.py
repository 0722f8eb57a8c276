"""ONNX handlers for convolutions and pooling (registered in ``HANDLERS``).

- ``Conv`` is ``conv2d`` (+ a broadcast ``add`` of the bias) with ONNX's strides, dilations and
  pads per axis, any stride (ResNet's 1x1 stride-2 downsample included); 1-D convolutions run as
  2-D ones between two ``reshape`` views; ``group`` > 1 is one conv per group on ``slice``s,
  joined by ``concat``.
- ``ConvTranspose`` is ``conv2d_input_grad`` (the transposed convolution a strided conv's input
  gradient already is) cropped by ``slice`` to ONNX's output size, with ``output_padding``; 1-D,
  groups and the bias as for ``Conv``.
- ``MaxPool``/``AveragePool`` are ``maxpool2d``/``avgpool2d`` with per-side pads, ``ceil_mode``
  and ``dilations``; ``GlobalAveragePool``/``GlobalMaxPool`` pool the whole plane.
- ``auto_pad`` (``SAME_UPPER``, ``SAME_LOWER``, ``VALID``) becomes explicit pads (``auto_pads``).

``BatchNormalization`` (inference and training mode): ``ir.importers.onnx_batchnorm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ir.importers.onnx_ops import Context, Unsupported, attr, handles


def compact(vals: list[int]) -> Any:
    """Kernel parameter forms: one int when all equal, ``[h, w]`` when symmetric per axis, else
    ``[top, left, bottom, right]`` (or the list as given)."""
    if len(set(vals)) == 1:
        return int(vals[0])
    if len(vals) == 4 and vals[:2] == vals[2:]:
        return [int(v) for v in vals[:2]]
    return [int(v) for v in vals]


def auto_pads(node: Any, spatial: tuple[int, ...], kernel: list[int], strides: list[int],
              dilations: list[int]) -> list[int]:
    """ONNX's pads ``[x1_begin, x2_begin, ..., x1_end, x2_end, ...]`` of a Conv or pooling node:
    its ``pads`` attribute, or those its ``auto_pad`` implies.

    ``SAME_UPPER``/``SAME_LOWER`` pad so that each output size is ``ceil(in / stride)``: the total
    ``max(0, (out - 1)·stride + dilation·(k - 1) + 1 - in)`` is split in half, the odd cell at the
    end (``UPPER``) or the beginning (``LOWER``) (ONNX operator spec, ``Conv`` and ``MaxPool``;
    onnxruntime's ``ComputePad``). ``VALID`` is no padding.
    """
    mode = attr(node, "auto_pad", "NOTSET")
    nd = len(spatial)
    if mode == "NOTSET":
        return [int(v) for v in (attr(node, "pads", None) or [0] * (2 * nd))]
    if mode == "VALID":
        return [0] * (2 * nd)
    if mode not in ("SAME_UPPER", "SAME_LOWER"):
        raise Unsupported(f"auto_pad={mode!r} (NOTSET, SAME_UPPER, SAME_LOWER and VALID only)")
    begin, end = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):
        out = -(-size // s)
        total = max(0, (out - 1) * s + d * (k - 1) + 1 - size)
        small, large = total // 2, total - total // 2
        begin.append(small if mode == "SAME_UPPER" else large)
        end.append(large if mode == "SAME_UPPER" else small)
    return begin + end


def per_group(ctx: Context, x: str, w: str, groups: int, w_rows: int, conv: Callable[[str, str, str], str],
              label: str, out: str | None = None) -> str:
    """A grouped convolution as one ``conv(x_k, w_k, name)`` per group, joined by ``concat`` along
    the channels (into ``out`` where given): group ``k`` reads its ``C/groups`` input channels and
    its ``w_rows`` rows of the weight."""
    gi = ctx.prog.spec(x).shape[1] // groups
    y = None
    for k in range(groups):
        xk = ctx.emit("slice", {"x": x}, {"axis": 1, "start": k * gi, "stop": (k + 1) * gi, "step": 1},
                      name=f"{label}.x{k}")
        wk = ctx.emit("slice", {"x": w}, {"axis": 0, "start": k * w_rows, "stop": (k + 1) * w_rows, "step": 1},
                      name=f"{label}.w{k}")
        yk = conv(xk, wk, f"{label}.g{k}")
        y = yk if y is None else ctx.emit("concat", {"a": y, "b": yk}, {"axis": 1},
                                          out=out if k == groups - 1 else None, name=f"{label}.cat{k}")
    return y


@handles("Conv")
def _conv(ctx: Context, node: Any, label: str) -> None:
    x, w = ctx.use(node.input[0]), ctx.use(node.input[1])
    xs, ws = ctx.prog.spec(x).shape, ctx.prog.spec(w).shape
    if len(xs) not in (3, 4):
        raise Unsupported(f"only 1-D and 2-D convolutions (NCL, NCHW); input has rank {len(xs)}")
    one_d = len(xs) == 3
    nd = len(xs) - 2
    strides = [int(v) for v in (attr(node, "strides", None) or [1] * nd)]
    dil = [int(v) for v in (attr(node, "dilations", None) or [1] * nd)]
    pads = auto_pads(node, xs[2:], list(ws[2:]), strides, dil)
    if one_d:
        n, c, length = xs
        x = ctx.emit("reshape", {"x": x}, {"shape": [n, c, 1, length], "from": list(xs)}, name=f"{label}.as_2d")
        w = ctx.emit("reshape", {"x": w}, {"shape": [ws[0], ws[1], 1, ws[2]], "from": list(ws)},
                     name=f"{label}.w_as_2d")
        strides, dil, pads = [1, strides[0]], [1, dil[0]], [0, pads[0], 0, pads[1]]  # the unit height: no pads
    groups = int(attr(node, "group", 1))
    has_b = len(node.input) > 2 and node.input[2]
    direct_out = None if (has_b or one_d) else node.output[0]
    p = {"stride": compact(strides), "padding": compact(pads)}
    if set(dil) != {1}:
        p["dilation"] = compact(dil)
    if groups == 1:
        y = ctx.emit("conv2d", {"x": x, "w": w}, p, out=direct_out, name=label)
    else:
        c_in, c_out = ctx.prog.spec(x).shape[1], ws[0]
        if c_in % groups or c_out % groups or ws[1] != c_in // groups:
            raise Unsupported(f"group={groups} does not divide {c_in} input and {c_out} output channels into "
                              f"weights of {ws[1]} input channels")
        y = per_group(ctx, x, w, groups, c_out // groups,
                      lambda xk, wk, name: ctx.emit("conv2d", {"x": xk, "w": wk}, p, name=name), label, direct_out)
    if has_b:
        b = ctx.use(node.input[2])
        co = ctx.prog.spec(b).shape[0]
        b3 = ctx.emit("reshape", {"x": b}, {"shape": [co, 1, 1], "from": [co]}, name=f"{label}.bias_view")
        y = ctx.emit("add", {"a": y, "b": b3}, out=None if one_d else node.output[0], name=f"{label}.bias")
    if one_d:
        ys = ctx.prog.spec(y).shape
        ctx.emit("reshape", {"x": y}, {"shape": [ys[0], ys[1], ys[3]], "from": list(ys)}, out=node.output[0],
                 name=f"{label}.as_1d")


def transpose_pads(node: Any, spatial: tuple[int, ...], kernel: list[int], strides: list[int],
                   dilations: list[int], out_pad: list[int]) -> list[int]:
    """ONNX's pads ``[x1_begin, ..., x1_end, ...]`` of a ``ConvTranspose`` node: its ``pads``, or
    none for ``auto_pad=VALID``. ``SAME_*`` and ``output_shape`` (pads the spec derives from a
    wanted output size) are refused, as is an ``output_padding`` not below its stride (the spec
    allows it below the dilation instead; the cells would then lie past every block)."""
    mode = attr(node, "auto_pad", "NOTSET")
    if mode not in ("NOTSET", "VALID"):
        raise Unsupported(f"ConvTranspose auto_pad={mode!r} (NOTSET and VALID only; give pads)")
    if attr(node, "output_shape", None):
        raise Unsupported("ConvTranspose output_shape (give pads and output_padding instead)")
    for op, s in zip(out_pad, strides):
        if not 0 <= op < s:
            raise Unsupported(f"ConvTranspose output_padding {out_pad} with strides {strides} "
                              f"(each must lie in [0, stride))")
    if mode == "VALID":
        return [0] * (2 * len(spatial))
    pads = [int(v) for v in (attr(node, "pads", None) or [0] * (2 * len(spatial)))]
    if min(pads) < 0:
        raise Unsupported(f"ConvTranspose negative pads {pads}")
    return pads


@handles("ConvTranspose")
def _conv_transpose(ctx: Context, node: Any, label: str) -> None:
    """``conv2d_input_grad`` (the transposed convolution: ``y[o·s - begin + i·d] += x[o]·w[i]``,
    ONNX ``ConvTranspose``), whose output is whole blocks of ``stride`` rows, cropped by ``slice``
    to the spec's size ``s·(in - 1) + output_padding + d·(k - 1) + 1 - begin - end``; the weight
    ``[C, M/group, kH, kW]`` is the kernel's ``w`` as it is. 1-D runs as 2-D between ``reshape``
    views, ``group`` > 1 as one op per group joined by ``concat``, the bias a broadcast ``add``
    (as ``Conv``)."""
    x, w = ctx.use(node.input[0]), ctx.use(node.input[1])
    xs, ws = ctx.prog.spec(x).shape, ctx.prog.spec(w).shape
    if len(xs) not in (3, 4):
        raise Unsupported(f"only 1-D and 2-D transposed convolutions (NCL, NCHW); input has rank {len(xs)}")
    nd = len(xs) - 2
    k = list(ws[2:])
    strides = [int(v) for v in (attr(node, "strides", None) or [1] * nd)]
    dil = [int(v) for v in (attr(node, "dilations", None) or [1] * nd)]
    out_pad = [int(v) for v in (attr(node, "output_padding", None) or [0] * nd)]
    pads = transpose_pads(node, xs[2:], k, strides, dil, out_pad)
    size = [s * (n - 1) + op + d * (kk - 1) + 1 - b - e
            for n, s, d, kk, op, b, e in zip(xs[2:], strides, dil, k, out_pad, pads[:nd], pads[nd:])]
    if min(size) < 1:
        raise Unsupported(f"ConvTranspose pads {pads} leave an empty output")
    one_d = nd == 1
    if one_d:
        n, c, length = xs
        x = ctx.emit("reshape", {"x": x}, {"shape": [n, c, 1, length], "from": list(xs)}, name=f"{label}.as_2d")
        w = ctx.emit("reshape", {"x": w}, {"shape": [ws[0], ws[1], 1, ws[2]], "from": list(ws)},
                     name=f"{label}.w_as_2d")
        strides, dil, pads, size = [1, strides[0]], [1, dil[0]], [0, pads[0], 0, pads[1]], [1, size[0]]
    p = {"stride": compact(strides), "padding": compact(pads), "size": size}
    if set(dil) != {1}:
        p["dilation"] = compact(dil)
    groups = int(attr(node, "group", 1))
    c_in = ctx.prog.spec(x).shape[1]
    if c_in != ws[0] or c_in % groups:
        raise Unsupported(f"group={groups} with {c_in} input channels and a weight of shape {list(ws)} "
                          f"(ConvTranspose weights are [C, M/group, kH, kW])")

    def one(xk: str, wk: str, name: str) -> str:
        y = ctx.emit("conv2d_input_grad", {"dy": xk, "w": wk}, p, name=name)
        for axis in (2, 3):  # whole blocks of stride rows, cropped to the spec's size
            if ctx.prog.spec(y).shape[axis] != size[axis - 2]:
                y = ctx.emit("slice", {"x": y}, {"axis": axis, "start": 0, "stop": size[axis - 2], "step": 1},
                             name=f"{name}.crop{axis}")
        return y

    if groups == 1:
        y = one(x, w, label)
    else:
        y = per_group(ctx, x, w, groups, c_in // groups, one, label)
    if len(node.input) > 2 and node.input[2]:
        b = ctx.use(node.input[2])
        co = ctx.prog.spec(b).shape[0]
        b3 = ctx.emit("reshape", {"x": b}, {"shape": [co, 1, 1], "from": [co]}, name=f"{label}.bias_view")
        y = ctx.emit("add", {"a": y, "b": b3}, name=f"{label}.bias")
    ys = ctx.prog.spec(y).shape
    if one_d:
        ctx.emit("reshape", {"x": y}, {"shape": [ys[0], ys[1], ys[3]], "from": list(ys)}, out=node.output[0],
                 name=f"{label}.as_1d")
    else:
        ctx.set(node.output[0], y)


@handles("MaxPool", "AveragePool")
def _pool(ctx: Context, node: Any, label: str) -> None:
    """``maxpool2d``/``avgpool2d``; MaxPool's indices output is refused, and so is ``ceil_mode``
    with an ``auto_pad`` (ONNX's reference refuses the pair; its output size is ``ceil(in/stride)``
    for SAME whatever the mode)."""
    x = ctx.use(node.input[0])
    xs = ctx.prog.spec(x).shape
    if len(xs) != 4:
        raise Unsupported("only 2-D pooling (NCHW)")
    if len(node.output) > 1 and node.output[1]:
        raise Unsupported("the indices output (argmax positions; no kernel produces integers)")
    mode = attr(node, "auto_pad", "NOTSET")
    if attr(node, "ceil_mode", 0) and mode != "NOTSET":
        raise Unsupported(f"ceil_mode with auto_pad={mode} (ONNX's reference refuses the pair)")
    k = [int(v) for v in attr(node, "kernel_shape")]
    st = [int(v) for v in (attr(node, "strides", None) or [1, 1])]
    dil = [int(v) for v in (attr(node, "dilations", None) or [1, 1])]
    params = {"window": k, "stride": st, "padding": compact(auto_pads(node, xs[2:], k, st, dil))}
    if set(dil) != {1}:
        params["dilation"] = compact(dil)
    if attr(node, "ceil_mode", 0):
        params["ceil_mode"] = True
    if node.op_type == "AveragePool":
        params["count_include_pad"] = bool(attr(node, "count_include_pad", 0))
    kernel = "maxpool2d" if node.op_type == "MaxPool" else "avgpool2d"
    ctx.emit(kernel, {"x": x}, params, out=node.output[0], name=label)


@handles("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(ctx: Context, node: Any, label: str) -> None:
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    if len(shape) != 4:
        raise Unsupported("only 2-D pooling (NCHW)")
    kernel = "avgpool2d" if node.op_type == "GlobalAveragePool" else "maxpool2d"
    ctx.emit(kernel, {"x": x}, {"window": [shape[2], shape[3]], "stride": [1, 1], "padding": 0},
             out=node.output[0], name=label)
