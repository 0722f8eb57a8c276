"""2-D pooling over NCHW: ``maxpool2d`` and ``avgpool2d`` (window, stride, padding, dilation).

Index dims ``(n, c, oh, ow)``; the input projection for ``oh`` is ``[oh·stride - pad,
oh·stride - pad + dilation·(kh - 1) + 1)`` as in ``ir.kernels.conv``: shards of neighbouring
rows overlap by the halo, and a dilated window takes every ``dilation``-th row of that box. The executor reads padding cells as zeros; ``run`` knows the shard's box, hence which rows
and columns of its block lie outside the tensor, and treats them as ONNX does: ``-inf`` for a
max, and for an average either zeros counted in the divisor (``count_include_pad``, the default)
or cells left out of it. Global average pooling is ``avgpool2d`` with the whole plane as window.

Their gradients, ``maxpool2d_grad`` (``x``, ``dy``) and ``avgpool2d_grad`` (``dy``), have index
dims ``(n, c, h, w)`` over ``dx`` and read whole ``(H, W)`` planes of their inputs: with a
stride above 1 the output rows whose windows cover an input row ``h`` are ``(h + pad - i) /
stride``, every stride-th row, which is no affine box of ``h`` (``conv2d_input_grad`` indexes
blocks of stride rows instead, ``ir.kernels.conv.phase_rows``; the max's first-maximum rule
needs each window's whole input, which is what the plane read keeps simple). Reading the plane is
exact for any window, stride, dilation and padding;
splits along ``n`` and ``c`` read nothing twice, splits along ``h``/``w`` re-read the plane. The
max's gradient goes to the first maximum of each window in row-major order (PyTorch's and ONNX's
argmax), padding never wins (it is ``-inf``).

``padding`` is an int, ``[h, w]`` or ``[top, left, bottom, right]`` (ONNX's ``pads``);
``dilation`` an int or ``[h, w]`` (ONNX's ``dilations``: the divisor of an average counts the
window's taps, as ``onnx.reference`` does; a window whose taps all fall in padding is refused);
``ceil_mode`` rounds the output size up (ONNX and PyTorch: the last window must start inside the
input or its begin padding). The cells a ceil-mode window reaches past the bottom/right padding
are neither maxed nor counted (PyTorch's ``ceil_mode``; ``count_include_pad`` counts the
declared padding only).
"""

from __future__ import annotations

from ir.kernels.base import Kernel, Signature, SignatureError, TensorSpec, unit_row, zero_row
from ir.kernels.conv import conv_out, pads4, pair
from ir.zspace import Projection, ZRange, identity_projection


def _framed(xp, x, top: int, left: int, rows: int, cols: int, fill: float):
    """``x``'s cells in a ``rows x cols`` frame whose origin is ``(-top, -left)``; ``fill`` elsewhere."""
    out = xp.full(x.shape[:2] + (rows, cols), fill, dtype=x.dtype)
    H, W = x.shape[2], x.shape[3]
    r0, r1 = max(0, -top), min(H, rows - top)
    c0, c1 = max(0, -left), min(W, cols - left)
    if r1 > r0 and c1 > c0:
        out[:, :, r0 + top: r1 + top, c0 + left: c1 + left] = x[:, :, r0:r1, c0:c1]
    return out


class Pool2d(Kernel):
    inputs = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"window": [2, 2], "stride": [2, 2], "padding": 0, "ceil_mode": False, "dilation": 1}

    def geometry(self, x: tuple[int, ...], params) -> tuple[int, int, int, int, int, int]:
        """``(oh, ow, top, left, bottom, right)`` of input shape ``x``."""
        k, st = params["window"], params["stride"]
        ok = (isinstance(k, (list, tuple)) and len(k) == 2 and isinstance(st, (list, tuple)) and len(st) == 2
              and all(isinstance(v, int) and v >= 1 for v in (*k, *st)) and isinstance(params["ceil_mode"], bool))
        if len(x) != 4 or not ok:
            raise SignatureError(f"{self.name} needs x[N, C, H, W], window [kh, kw] and stride [sh, sw] >= 1 and "
                                 f"padding >= 0; got x{list(x)}, window={k!r}, stride={st!r}, "
                                 f"padding={params['padding']!r}")
        t, l, b, r = pads4(params["padding"], f"{self.name} padding")
        (dh, dw) = pair(params["dilation"], f"{self.name} dilation", 1)
        eh, ew = dh * (k[0] - 1) + 1, dw * (k[1] - 1) + 1
        if max(t, b) >= eh or max(l, r) >= ew:  # then every undilated window holds a cell of the tensor
            raise SignatureError(f"{self.name} padding {params['padding']} must be less than the window "
                                 f"{[eh, ew]} on each side (a window of padding only has no value)")
        oh = conv_out(x[2], t, b, eh, st[0], params["ceil_mode"])
        ow = conv_out(x[3], l, r, ew, st[1], params["ceil_mode"])
        if oh < 1 or ow < 1:
            raise SignatureError(f"{self.name} output would be empty for x{list(x)} and window {list(k)}")
        for what, size, begin, n, kk, ss, dd in (("row", x[2], t, oh, k[0], st[0], dh),
                                                 ("column", x[3], l, ow, k[1], st[1], dw)):
            empty = [o for o in range(n) if not any(0 <= o * ss - begin + i * dd < size for i in range(kk))]
            if empty:  # a dilated window can step over the whole tensor
                raise SignatureError(f"{self.name}: the window of output {what} {empty[0]} reads padding only "
                                     f"(x{list(x)}, window {list(k)}, dilation {params['dilation']}, padding "
                                     f"{params['padding']})")
        return oh, ow, t, l, b, r

    @staticmethod
    def extent(params) -> tuple[int, int]:
        """The dilated window's rows and columns, ``dilation·(k - 1) + 1``."""
        (kh, kw), (dh, dw) = params["window"], pair(params["dilation"], "dilation", 1)
        return dh * (kh - 1) + 1, dw * (kw - 1) + 1

    def base_signature(self, ins, params):
        x = ins["x"].shape
        k, st = params["window"], params["stride"]
        oh, ow, t, l, _, _ = self.geometry(x, params)
        rows = (unit_row(4, 0), unit_row(4, 1), tuple(st[0] * int(c == 2) for c in range(4)),
                tuple(st[1] * int(c == 3) for c in range(4)))
        out = (x[0], x[1], oh, ow)
        return Signature(("n", "c", "oh", "ow"), out, {"x": Projection(rows, (0, 0, -t, -l), (1, 1) + self.extent(params))},
                         identity_projection(4), TensorSpec(out, ins["x"].dtype), float(k[0] * k[1]))

    def windows(self, x, params):
        """One strided view of ``x`` per window tap (row-major), each of the output's shape."""
        (kh, kw), (sh, sw) = params["window"], params["stride"]
        (dh, dw), (eh, ew) = pair(params["dilation"], "dilation", 1), self.extent(params)
        oh = (x.shape[2] - eh) // sh + 1
        ow = (x.shape[3] - ew) // sw + 1
        for i in range(kh):
            for j in range(kw):
                yield x[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]

    @staticmethod
    def plain(params) -> bool:
        """No padding and no ceil mode: every window lies inside the tensor."""
        return not params["ceil_mode"] and pads4(params["padding"], "padding") == (0, 0, 0, 0)

    def inside(self, xp, box: ZRange, sig: Signature, pads=(0, 0, 0, 0)):
        """Boolean (rows, cols) of the shard's input block inside the tensor grown by ``pads``."""
        b = sig.inputs["x"].apply(box)
        H, W = sig.in_specs["x"].shape[2:]
        r = xp.arange(b.start[2], b.end[2])
        c = xp.arange(b.start[3], b.end[3])
        t, l, bo, ri = pads
        return (r >= -t) & (r < H + bo), (c >= -l) & (c < W + ri)

    def compute(self, xp, blocks, params):
        if not self.plain(params):
            raise SignatureError(f"{self.name} with padding or ceil_mode runs through run() (it needs the shard's box)")
        return self.reduce(xp, blocks["x"], params, None)

    def run(self, xp, blocks, params, box, sig):
        if self.plain(params):
            return self.reduce(xp, blocks["x"], params, None)
        return self.reduce(xp, blocks["x"], params, self.inside(xp, box, sig),
                           self.inside(xp, box, sig, pads4(params["padding"], "padding")))


class MaxPool2d(Pool2d):
    name = "maxpool2d"

    def reduce(self, xp, x, params, inside, padded=None):
        if inside is not None:
            keep = inside[0][:, None] & inside[1][None, :]
            x = xp.where(keep, x, xp.asarray(-xp.inf, dtype=x.dtype))
        y = None
        for win in self.windows(x, params):
            y = win if y is None else xp.maximum(y, win)
        return y


class AvgPool2d(Pool2d):
    name = "avgpool2d"
    params_defaults = {**Pool2d.params_defaults, "count_include_pad": True}

    def reduce(self, xp, x, params, inside, padded=None):
        y = None
        for win in self.windows(x, params):
            y = win if y is None else y + win
        kh, kw = params["window"]
        if inside is None:
            return y * (1.0 / (kh * kw))
        rows, cols = padded if params["count_include_pad"] else inside  # cells the divisor counts
        ones = (rows[:, None] & cols[None, :]).astype(x.dtype)[None, None]
        count = None
        for win in self.windows(ones, params):
            count = win if count is None else count + win
        return y / count


class Pool2dGrad(Kernel):
    """Shared shape rules of the pooling gradients: ``dx`` of shape ``size`` = ``[N, C, H, W]``
    (the forward input's), ``dy`` the forward output's shape for that window, stride, padding."""

    kernel_class = "elementwise"
    params_defaults = {"window": [2, 2], "stride": [2, 2], "padding": 0, "ceil_mode": False, "dilation": 1,
                       "size": None}
    forward: type[Pool2d]

    def base_signature(self, ins, params):
        size = params["size"]
        dy = ins["dy"].shape
        if not (isinstance(size, (list, tuple)) and len(size) == 4 and all(isinstance(v, int) and v >= 1 for v in size)):
            raise SignatureError(f"{self.name} needs size [N, C, H, W] (the forward input's shape), got {size!r}")
        fwd = self.forward().base_signature({"x": TensorSpec(tuple(size), ins["dy"].dtype)},
                                            {**self.forward.params_defaults, **{k: v for k, v in params.items()
                                                                                 if k != "size"}})
        if tuple(dy) != fwd.extents:
            raise SignatureError(f"{self.name}: dy{list(dy)} is not the {self.forward.name} output {list(fwd.extents)} "
                                 f"of x{list(size)} with window {params['window']}, stride {params['stride']}, "
                                 f"padding {params['padding']}")
        if "x" in self.inputs and tuple(ins["x"].shape) != tuple(size):
            raise SignatureError(f"{self.name}: x{list(ins['x'].shape)} must have the shape size={list(size)}")
        plane = {"dy": Projection((unit_row(4, 0), unit_row(4, 1), zero_row(4), zero_row(4)), (0, 0, 0, 0),
                                  (1, 1, dy[2], dy[3]))}
        if "x" in self.inputs:
            plane["x"] = Projection((unit_row(4, 0), unit_row(4, 1), zero_row(4), zero_row(4)), (0, 0, 0, 0),
                                    (1, 1, size[2], size[3]))
        kh, kw = params["window"]
        out = tuple(size)
        return Signature(("n", "c", "h", "w"), out, plane, identity_projection(4), TensorSpec(out, ins["dy"].dtype),
                         float(kh * kw * dy[2] * dy[3]) / (size[2] * size[3]))

    @staticmethod
    def frame(params, dy) -> tuple[int, int, int, int]:
        """``(top, left, rows, cols)``: the windows' frame, origin ``(-top, -left)``."""
        sh, sw = params["stride"]
        eh, ew = Pool2d.extent(params)
        t, l, _, _ = pads4(params["padding"], "padding")
        return t, l, sh * (dy.shape[2] - 1) + eh, sw * (dy.shape[3] - 1) + ew

    def scatter(self, xp, dy, weights, params, plane):
        """``dx`` of whole planes: each window's ``dy`` times its weight (one array per window
        offset, as ``Pool2d.windows`` yields them) added back where the window read."""
        (kh, kw), (sh, sw) = params["window"], params["stride"]
        dh, dw = pair(params["dilation"], "dilation", 1)
        t, l, rows, cols = self.frame(params, dy)
        n, c, H, W = dy.shape[0], dy.shape[1], plane[0], plane[1]
        oh, ow = dy.shape[2], dy.shape[3]
        dx = xp.zeros((n, c, max(rows, t + H), max(cols, l + W)), dtype=dy.dtype)
        for (i, j), wgt in zip(((i, j) for i in range(kh) for j in range(kw)), weights):
            dx[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw] += dy * wgt
        return dx[:, :, t: t + H, l: l + W]

    def compute(self, xp, blocks, params):
        return self.whole(xp, blocks, params)

    def run(self, xp, blocks, params, box, sig):
        dx = self.whole(xp, blocks, params)
        return dx[:, :, box.start[2]: box.end[2], box.start[3]: box.end[3]]


class MaxPool2dGrad(Pool2dGrad):
    name = "maxpool2d_grad"
    inputs = ("x", "dy")
    forward = MaxPool2d

    def whole(self, xp, blocks, params):
        x, dy = blocks["x"], blocks["dy"]
        t, l, rows, cols = self.frame(params, dy)
        x = _framed(xp, x, t, l, rows, cols, -xp.inf)  # padding and ceil-mode overhang never win
        fwd = MaxPool2d()
        y = fwd.reduce(xp, x, params, None)
        taken = xp.zeros(y.shape, dtype=bool)
        weights = []
        for win in fwd.windows(x, params):  # the first maximum of each window takes the gradient
            first = (win == y) & ~taken
            taken |= first
            weights.append(first.astype(dy.dtype))
        return self.scatter(xp, dy, weights, params, (blocks["x"].shape[2], blocks["x"].shape[3]))


class AvgPool2dGrad(Pool2dGrad):
    name = "avgpool2d_grad"
    inputs = ("dy",)
    forward = AvgPool2d
    params_defaults = {**Pool2dGrad.params_defaults, "count_include_pad": True}

    def whole(self, xp, blocks, params):
        dy = blocks["dy"]
        kh, kw = params["window"]
        H, W = params["size"][2], params["size"][3]
        t, l, b, r = pads4(params["padding"], "padding")
        if Pool2d.plain(params):
            return self.scatter(xp, dy, [1.0 / (kh * kw)] * (kh * kw), params, (H, W))
        # the divisor counts the cells the forward counts: the tensor, or the tensor and its padding
        top, left, rows, cols = self.frame(params, dy)
        grow = (t, l, b, r) if params["count_include_pad"] else (0, 0, 0, 0)
        region = xp.ones((1, 1, H + grow[0] + grow[2], W + grow[1] + grow[3]), dtype=dy.dtype)
        ones = _framed(xp, region, top - grow[0], left - grow[1], rows, cols, 0.0)
        count = None
        for win in AvgPool2d().windows(ones, params):
            count = win if count is None else count + win
        return self.scatter(xp, dy, [1.0 / count] * (kh * kw), params, (H, W))


KERNELS = (MaxPool2d, AvgPool2d, MaxPool2dGrad, AvgPool2dGrad)
