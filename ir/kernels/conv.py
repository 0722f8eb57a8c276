"""2-D convolution (NCHW, weights [Co, Ci, KH, KW]) with strides, dilations and zero padding per axis.

Index dims ``(n, co, oh, ow)``. The input projection for ``oh`` is ``[oh·sh - top, oh·sh - top +
dh·(KH-1) + 1)``: neighbouring shards overlap by the halo, and boxes that reach past the
tensor's edge read zeros (the executor pads), so asymmetric padding costs nothing but the output
size. A dilated window reads every ``dh``-th row of that box. Input channels are a splittable sum.

Parameters (ONNX's ``Conv`` attributes): ``stride`` and ``dilation`` are an int or ``[h, w]``;
``padding`` an int, ``[h, w]`` (each on both sides) or ``[top, left, bottom, right]`` (ONNX's
``pads`` order). Output size per axis: ``(size + begin + end - dilation·(K-1) - 1) // stride + 1``
(ONNX operator spec, ``Conv``).
"""

from __future__ import annotations

from typing import Any

from ir.kernels.base import Kernel, Reduction, Signature, SignatureError, TensorSpec, unit_row, zero_row
from ir.zspace import Projection, identity_projection


def pair(v: Any, what: str, low: int) -> tuple[int, int]:
    """An int or ``[h, w]`` as ``(h, w)``, each an int >= ``low``."""
    vals = [v, v] if isinstance(v, int) and not isinstance(v, bool) else v
    if not (isinstance(vals, (list, tuple)) and len(vals) == 2
            and all(isinstance(a, int) and not isinstance(a, bool) and a >= low for a in vals)):
        raise SignatureError(f"{what} >= {low} needed: an int or a list [h, w] of ints >= {low}, got {v!r}")
    return int(vals[0]), int(vals[1])


def pads4(v: Any, what: str) -> tuple[int, int, int, int]:
    """Padding as ``(top, left, bottom, right)`` from an int, ``[h, w]`` or ``[t, l, b, r]``."""
    if isinstance(v, (list, tuple)) and len(v) == 4:
        if all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in v):
            return int(v[0]), int(v[1]), int(v[2]), int(v[3])
        raise SignatureError(f"{what} >= 0 needed: [top, left, bottom, right] of ints >= 0, got {v!r}")
    h, w = pair(v, what, 0)
    return h, w, h, w


def conv_out(size: int, begin: int, end: int, extent: int, stride: int, ceil: bool = False) -> int:
    """Output length along one axis for a window of ``extent`` cells (ONNX ``Conv``/``MaxPool``
    shape rules; with ``ceil`` the last window must start inside the input or its begin padding)."""
    span = size + begin + end - extent
    if span < 0:
        return 0
    if not ceil:
        return span // stride + 1
    n = -(-span // stride) + 1
    return n - 1 if (n - 1) * stride >= size + begin else n


class Conv2d(Kernel):
    name = "conv2d"
    inputs = ("x", "w")
    kernel_class = "conv"
    params_defaults = {"stride": 1, "padding": 0, "dilation": 1}

    def base_signature(self, ins, params):
        x, w = ins["x"].shape, ins["w"].shape
        if len(x) != 4 or len(w) != 4 or x[1] != w[1]:
            raise SignatureError(f"conv2d needs x[N, Ci, H, W] and w[Co, Ci, KH, KW]; got x{list(x)}, w{list(w)}")
        (sh, sw), (dh, dw) = pair(params["stride"], "conv2d stride", 1), pair(params["dilation"], "conv2d dilation", 1)
        t, l, b, r = pads4(params["padding"], "conv2d padding")
        eh, ew = dh * (w[2] - 1) + 1, dw * (w[3] - 1) + 1
        if sh > eh or sw > ew:
            raise SignatureError(f"conv2d stride {[sh, sw]} larger than the kernel {list(w[2:])} (dilated extent "
                                 f"{[eh, ew]}) would skip input cells")
        oh, ow = conv_out(x[2], t, b, eh, sh), conv_out(x[3], l, r, ew, sw)
        if oh < 1 or ow < 1:
            raise SignatureError(f"conv2d output would be empty for x{list(x)}, w{list(w)}, padding "
                                 f"{params['padding']}, dilation {params['dilation']}")
        rows_x = (unit_row(4, 0), zero_row(4), tuple(sh * int(c == 2) for c in range(4)),
                  tuple(sw * int(c == 3) for c in range(4)))
        px = Projection(rows_x, (0, 0, -t, -l), (1, x[1], eh, ew))
        pw = Projection((unit_row(4, 1), zero_row(4), zero_row(4), zero_row(4)), (0, 0, 0, 0), (1, w[1], w[2], w[3]))
        out = (x[0], w[0], oh, ow)
        return Signature(("n", "co", "oh", "ow"), out, {"x": px, "w": pw}, identity_projection(4),
                         TensorSpec(out, ins["x"].dtype), 2.0 * w[1] * w[2] * w[3],
                         (Reduction("ci", x[1], "sum", (("x", 1), ("w", 1))),))

    def compute(self, xp, blocks, params):
        x, w = blocks["x"], blocks["w"]
        (sh, sw), (dh, dw) = pair(params["stride"], "stride", 1), pair(params["dilation"], "dilation", 1)
        kh, kw = w.shape[2], w.shape[3]
        oh = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
        ow = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
        y = None
        for i in range(kh):  # one small contraction per tap: same code on NumPy and CuPy
            for j in range(kw):
                win = x[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
                # optimize: NumPy's einsum through BLAS (a naive loop otherwise; ~2x at 32 channels)
                t = xp.einsum("nchw,oc->nohw", win, w[:, :, i, j],
                              **({"optimize": True} if getattr(xp, "__name__", "") == "numpy" else {}))
                y = t if y is None else y + t
        return y


class Conv2dInputGrad(Kernel):
    """``dx[n,ci,h,w] = Σ_{co,i,j} dy[n,co,h+top-i·dh,w+left-j·dw] · w[co,ci,i,j]`` (stride 1).

    Index dims ``(n, ci, h, w)``; ``dy`` is read through a halo ``[h+top-dh·(KH-1), h+top]``
    (zeros outside), output channels are a splittable sum. ``padding`` and ``dilation`` take the
    forward's forms. Strided convolutions have a backward whose reads are not an affine box of
    ``dx``'s index (every stride-th row), so they are refused.
    """

    name = "conv2d_input_grad"
    inputs = ("dy", "w")
    kernel_class = "conv"
    params_defaults = {"stride": 1, "padding": 0, "dilation": 1}

    def base_signature(self, ins, params):
        dy, w = ins["dy"].shape, ins["w"].shape
        if pair(params["stride"], "conv2d_input_grad stride", 1) != (1, 1):
            raise SignatureError("conv2d_input_grad supports stride 1 only (a strided backward reads every "
                                 "stride-th row, which is no box)")
        if len(dy) != 4 or len(w) != 4 or dy[1] != w[0]:
            raise SignatureError(f"conv2d_input_grad needs dy[N, Co, OH, OW], w[Co, Ci, KH, KW], padding >= 0; "
                                 f"got dy{list(dy)}, w{list(w)}")
        t, l, b, r = pads4(params["padding"], "conv2d_input_grad padding")
        dh, dw = pair(params["dilation"], "conv2d_input_grad dilation", 1)
        kh, kw = w[2], w[3]
        eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
        H, W = dy[2] + eh - 1 - t - b, dy[3] + ew - 1 - l - r
        if H < 1 or W < 1:
            raise SignatureError(f"conv2d_input_grad: no input of positive size gives dy{list(dy)}")
        pdy = Projection((unit_row(4, 0), zero_row(4), unit_row(4, 2), unit_row(4, 3)),
                         (0, 0, t - eh + 1, l - ew + 1), (1, dy[1], eh, ew))
        pw = Projection((zero_row(4), unit_row(4, 1), zero_row(4), zero_row(4)), (0, 0, 0, 0), (w[0], 1, kh, kw))
        out = (dy[0], w[1], H, W)
        return Signature(("n", "ci", "h", "w"), out, {"dy": pdy, "w": pw}, identity_projection(4),
                         TensorSpec(out, ins["dy"].dtype), 2.0 * w[0] * kh * kw,
                         (Reduction("co", w[0], "sum", (("dy", 1), ("w", 0))),))

    def compute(self, xp, blocks, params):
        dy, w = blocks["dy"], blocks["w"]
        dh, dw = pair(params["dilation"], "dilation", 1)
        kh, kw = w.shape[2], w.shape[3]
        hb, wb = dy.shape[2] - dh * (kh - 1), dy.shape[3] - dw * (kw - 1)
        dx = None
        for i in range(kh):
            for j in range(kw):
                a, c = dh * (kh - 1 - i), dw * (kw - 1 - j)
                t = xp.einsum("nohw,oc->nchw", dy[:, :, a: a + hb, c: c + wb], w[:, :, i, j])
                dx = t if dx is None else dx + t
        return dx


class Conv2dWeightGrad(Kernel):
    """``dw[co,ci,i,j] = Σ_{n,oh,ow} dy[n,co,oh,ow] · x[n,ci,oh·sh-top+i·dh, ow·sw-left+j·dw]``.

    Index dims ``(co, ci, i, j)``; the ``x`` projection is ``dh·i`` (a dilated tap reads rows
    ``dh`` apart); each shard reads the batch whole; the batch is a splittable sum
    (data-parallel gradient synchronisation).
    """

    name = "conv2d_weight_grad"
    inputs = ("x", "dy")
    kernel_class = "conv"
    params_defaults = {"stride": 1, "padding": 0, "dilation": 1, "window": None}

    def base_signature(self, ins, params):
        x, dy = ins["x"].shape, ins["dy"].shape
        k = params["window"]
        if not (isinstance(k, (list, tuple)) and len(k) == 2 and all(isinstance(v, int) and v >= 1 for v in k)):
            raise SignatureError(f"conv2d_weight_grad needs window [KH, KW], got {k!r}")
        if len(x) != 4 or len(dy) != 4 or x[0] != dy[0]:
            raise SignatureError(f"conv2d_weight_grad needs x[N, Ci, H, W] and dy[N, Co, OH, OW]; "
                                 f"got x{list(x)}, dy{list(dy)}")
        (sh, sw), (dh, dw) = pair(params["stride"], "stride", 1), pair(params["dilation"], "dilation", 1)
        t, l, b, r = pads4(params["padding"], "conv2d_weight_grad padding")
        kh, kw = k
        if conv_out(x[2], t, b, dh * (kh - 1) + 1, sh) != dy[2] or conv_out(x[3], l, r, dw * (kw - 1) + 1, sw) != dy[3]:
            raise SignatureError(f"conv2d_weight_grad: dy{list(dy)} is not the output of x{list(x)} with window "
                                 f"{list(k)}, stride {params['stride']}, padding {params['padding']}, dilation "
                                 f"{params['dilation']}")
        rows = (zero_row(4), unit_row(4, 1), tuple(dh * int(c == 2) for c in range(4)),
                tuple(dw * int(c == 3) for c in range(4)))
        px = Projection(rows, (0, 0, -t, -l), (x[0], 1, sh * (dy[2] - 1) + 1, sw * (dy[3] - 1) + 1))
        pdy = Projection((zero_row(4), unit_row(4, 0), zero_row(4), zero_row(4)), (0, 0, 0, 0),
                         (dy[0], 1, dy[2], dy[3]))
        out = (dy[1], x[1], kh, kw)
        return Signature(("co", "ci", "i", "j"), out, {"x": px, "dy": pdy}, identity_projection(4),
                         TensorSpec(out, ins["x"].dtype), 2.0 * x[0] * dy[2] * dy[3],
                         (Reduction("n", x[0], "sum", (("x", 0), ("dy", 0))),))

    def compute(self, xp, blocks, params):
        x, dy = blocks["x"], blocks["dy"]
        (sh, sw), (dh, dw) = pair(params["stride"], "stride", 1), pair(params["dilation"], "dilation", 1)
        oh, ow = dy.shape[2], dy.shape[3]
        ib = (x.shape[2] - sh * (oh - 1) - 1) // dh + 1  # taps in this block: rows (ib-1)·dh + sh·(oh-1) + 1
        jb = (x.shape[3] - sw * (ow - 1) - 1) // dw + 1
        rows = []
        for i in range(ib):
            cols = []
            for j in range(jb):
                win = x[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
                cols.append(xp.einsum("nohw,nchw->oc", dy, win))
            rows.append(xp.stack(cols, axis=-1))
        return xp.stack(rows, axis=-2)


KERNELS = (Conv2d, Conv2dInputGrad, Conv2dWeightGrad)
