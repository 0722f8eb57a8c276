"""2-D convolution (NCHW, weights [Co, Ci, KH, KW]) with strides, dilations and zero padding per axis.

Index dims ``(n, co, oh, ow)``. The input projection for ``oh`` is ``[oh·sh - top, oh·sh - top +
dh·(KH-1) + 1)``: neighbouring shards overlap by the halo, and boxes that reach past the
tensor's edge read zeros (the executor pads), so asymmetric padding costs nothing but the output
size. A dilated window reads every ``dh``-th row of that box; a stride above the window's extent
(ResNet's 1x1 stride-2 downsample) leaves rows between windows unread. Input channels are a
splittable sum.

The input gradient (``conv2d_input_grad``, a transposed convolution) indexes blocks of
``stride`` rows of ``dx`` so that its reads of ``dy`` stay boxes (``phase_rows``); the weight
gradient (``conv2d_weight_grad``) indexes taps and sums over the batch. ONNX ``ConvTranspose``
imports as ``conv2d_input_grad`` (its weight ``[C, M, kH, kW]`` is the kernel's ``w``), and its
own VJP is a ``conv2d`` and a ``conv2d_weight_grad`` (``ir.autodiff.rules``).

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


def phase_rows(k: int, stride: int, dilation: int, begin: int) -> tuple[int, int]:
    """``(offset, span)``: in the backward of a conv along one axis, the input rows
    ``[q·s, q·s + s)`` (block ``q``) take their gradient from output rows ``[q + offset, q + offset
    + span)``.

    Input row ``h`` takes tap ``i`` of output row ``(h + begin - i·d) / s`` when that divides, so
    block ``q`` reads output rows ``ceil((q·s + begin - d·(k-1)) / s)`` to ``floor((q·s + s - 1 +
    begin) / s)``: ``q`` plus constants, an affine box (with ``s = 1`` the stride-1 halo ``[h +
    begin - d·(k-1), h + begin]``)."""
    extent = dilation * (k - 1) + 1
    offset = -((extent - 1 - begin) // stride)
    return offset, (stride - 1 + begin) // stride - offset + 1


class Conv2dInputGrad(Kernel):
    """``dx[n,ci,h,w] = Σ dy[n,co,oh,ow] · w[co,ci,i,j]`` over ``oh·sh - top + i·dh = h`` (and the
    same for columns): the transposed convolution.

    Index dims ``(n, ci, hb, wb)``: each index point writes a block of ``sh x sw`` cells of ``dx``
    (output projection ``[sh·hb, sh·hb + sh)``; the identity for stride 1). The input rows of one
    block take their gradient from ``dy`` rows ``hb + offset ... hb + offset + span`` (see
    ``phase_rows``), a box affine in ``hb``, read with zeros outside ``dy``; within the block, row
    ``sh·hb + p`` takes only the taps ``i`` with ``i·dh - top ≡ p (mod sh)``. A per-row index would
    read every ``sh``-th row of ``dy``, which is no box: blocking the rows is what makes a strided
    backward exact. Output channels are a splittable sum.

    With stride 1, ``dx`` is ``[N, Ci, H, W]`` with ``H`` fixed by ``dy`` and the padding. With a
    stride, ``size = [H, W]`` (the forward input's plane) is required, since several ``H`` give
    one ``dy``; ``dx`` is then ``[N, Ci, ceil(H/sh)·sh, ceil(W/sw)·sw]`` (whole blocks), and the
    VJP crops the rows and columns past ``H, W`` with ``slice``. ``padding`` and ``dilation``
    take the forward's forms.
    """

    name = "conv2d_input_grad"
    inputs = ("dy", "w")
    kernel_class = "conv"
    params_defaults = {"stride": 1, "padding": 0, "dilation": 1, "size": None}

    def base_signature(self, ins, params):
        dy, w = ins["dy"].shape, ins["w"].shape
        if len(dy) != 4 or len(w) != 4 or dy[1] != w[0]:
            raise SignatureError(f"conv2d_input_grad needs dy[N, Co, OH, OW], w[Co, Ci, KH, KW], padding >= 0; "
                                 f"got dy{list(dy)}, w{list(w)}")
        (sh, sw), (dh, dw) = pair(params["stride"], "conv2d_input_grad stride", 1), \
            pair(params["dilation"], "conv2d_input_grad dilation", 1)
        t, l, b, r = pads4(params["padding"], "conv2d_input_grad padding")
        kh, kw = w[2], w[3]
        eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
        size = params["size"]
        if size is None and (sh, sw) != (1, 1):
            raise SignatureError(f"conv2d_input_grad with stride {params['stride']} needs size [H, W], the forward "
                                 f"input's plane (several input sizes give dy{list(dy)})")
        if size is None:
            H, W = dy[2] + eh - 1 - t - b, dy[3] + ew - 1 - l - r
        else:
            H, W = pair(size, "conv2d_input_grad size", 1)
            if conv_out(H, t, b, eh, sh) != dy[2] or conv_out(W, l, r, ew, sw) != dy[3]:
                raise SignatureError(f"conv2d_input_grad: dy{list(dy)} is not the conv2d output of an input plane "
                                     f"{[H, W]} with window {[kh, kw]}, stride {params['stride']}, padding "
                                     f"{params['padding']}, dilation {params['dilation']}")
        if H < 1 or W < 1:
            raise SignatureError(f"conv2d_input_grad: no input of positive size gives dy{list(dy)}")
        (oh0, spanh), (ow0, spanw) = phase_rows(kh, sh, dh, t), phase_rows(kw, sw, dw, l)
        pdy = Projection((unit_row(4, 0), zero_row(4), unit_row(4, 2), unit_row(4, 3)),
                         (0, 0, oh0, ow0), (1, dy[1], spanh, spanw))
        pw = Projection((zero_row(4), unit_row(4, 1), zero_row(4), zero_row(4)), (0, 0, 0, 0), (w[0], 1, kh, kw))
        hb, wb = -(-H // sh), -(-W // sw)
        out = (dy[0], w[1], hb * sh, wb * sw)
        py = Projection((unit_row(4, 0), unit_row(4, 1), tuple(sh * int(c == 2) for c in range(4)),
                         tuple(sw * int(c == 3) for c in range(4))), (0, 0, 0, 0), (1, 1, sh, sw))
        return Signature(("n", "ci", "hb", "wb"), (dy[0], w[1], hb, wb), {"dy": pdy, "w": pw}, py,
                         TensorSpec(out, ins["dy"].dtype), 2.0 * w[0] * kh * kw,
                         (Reduction("co", w[0], "sum", (("dy", 1), ("w", 0))),))

    def compute(self, xp, blocks, params):
        dy, w = blocks["dy"], blocks["w"]
        (sh, sw), (dh, dw) = pair(params["stride"], "stride", 1), pair(params["dilation"], "dilation", 1)
        t, l, _, _ = pads4(params["padding"], "padding")
        kh, kw = w.shape[2], w.shape[3]
        (oh0, spanh), (ow0, spanw) = phase_rows(kh, sh, dh, t), phase_rows(kw, sw, dw, l)
        nh, nw = dy.shape[2] - spanh + 1, dy.shape[3] - spanw + 1  # blocks of this shard
        dx = xp.zeros((dy.shape[0], w.shape[1], nh * sh, nw * sw), dtype=dy.dtype)
        for i in range(kh):
            ph = (i * dh - t) % sh  # the block row this tap reaches, and the dy row it reads
            a = (ph + t - i * dh) // sh - oh0
            for j in range(kw):
                pc = (j * dw - l) % sw
                c = (pc + l - j * dw) // sw - ow0
                dx[:, :, ph::sh, pc::sw] += xp.einsum("nohw,oc->nchw", dy[:, :, a: a + nh, c: c + nw], w[:, :, i, j])
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
