"""2-D convolution (NCHW, weights [Co, Ci, KH, KW], stride, zero padding).

Index dims ``(n, co, oh, ow)``. The input projection for ``oh`` is ``[oh·stride - pad,
oh·stride - pad + KH)``: neighbouring shards overlap by the halo, and boxes that reach past
the tensor's edge read zeros (the executor pads). Input channels are a splittable sum.
"""

from __future__ import annotations

from ir.kernels.base import Kernel, Reduction, Signature, SignatureError, TensorSpec, unit_row, zero_row
from ir.zspace import Projection, identity_projection


class Conv2d(Kernel):
    name = "conv2d"
    inputs = ("x", "w")
    kernel_class = "conv"
    params_defaults = {"stride": 1, "padding": 0}

    def base_signature(self, ins, params):
        x, w = ins["x"].shape, ins["w"].shape
        st, pad = params["stride"], params["padding"]
        if len(x) != 4 or len(w) != 4 or x[1] != w[1]:
            raise SignatureError(f"conv2d needs x[N, Ci, H, W] and w[Co, Ci, KH, KW]; got x{list(x)}, w{list(w)}")
        if not (isinstance(st, int) and st >= 1 and isinstance(pad, int) and pad >= 0):
            raise SignatureError(f"conv2d needs stride >= 1 and padding >= 0, got stride={st}, padding={pad}")
        if st > w[2] or st > w[3]:
            raise SignatureError(f"conv2d stride {st} larger than the kernel {w[2:]} would skip input cells")
        oh = (x[2] + 2 * pad - w[2]) // st + 1
        ow = (x[3] + 2 * pad - w[3]) // st + 1
        if oh < 1 or ow < 1:
            raise SignatureError(f"conv2d output would be empty for x{list(x)}, w{list(w)}, padding {pad}")
        rows_x = (unit_row(4, 0), zero_row(4), tuple(st * int(c == 2) for c in range(4)),
                  tuple(st * int(c == 3) for c in range(4)))
        px = Projection(rows_x, (0, 0, -pad, -pad), (1, x[1], w[2], w[3]))
        pw = Projection((unit_row(4, 1), zero_row(4), zero_row(4), zero_row(4)), (0, 0, 0, 0), (1, w[1], w[2], w[3]))
        out = (x[0], w[0], oh, ow)
        return Signature(("n", "co", "oh", "ow"), out, {"x": px, "w": pw}, identity_projection(4),
                         TensorSpec(out, ins["x"].dtype), 2.0 * w[1] * w[2] * w[3],
                         (Reduction("ci", x[1], "sum", (("x", 1), ("w", 1))),))

    def compute(self, xp, blocks, params):
        x, w = blocks["x"], blocks["w"]
        st = params["stride"]
        kh, kw = w.shape[2], w.shape[3]
        oh = (x.shape[2] - kh) // st + 1
        ow = (x.shape[3] - kw) // st + 1
        y = None
        for i in range(kh):  # one small contraction per tap: same code on NumPy and CuPy
            for j in range(kw):
                win = x[:, :, i : i + st * (oh - 1) + 1 : st, j : j + st * (ow - 1) + 1 : st]
                # optimize: NumPy's einsum through BLAS (a naive loop otherwise; ~2x at 32 channels)
                t = xp.einsum("nchw,oc->nohw", win, w[:, :, i, j],
                              **({"optimize": True} if getattr(xp, "__name__", "") == "numpy" else {}))
                y = t if y is None else y + t
        return y


class Conv2dInputGrad(Kernel):
    """``dx[n,ci,h,w] = Σ_{co,i,j} dy[n,co,h+pad-i,w+pad-j] · w[co,ci,i,j]`` (stride 1).

    Index dims ``(n, ci, h, w)``; ``dy`` is read through a halo ``[h+pad-KH+1, h+pad]`` (zeros
    outside), output channels are a splittable sum. Strided convolutions have a backward whose
    reads are not an affine box of ``dx``'s index (every stride-th row), so they are refused.
    """

    name = "conv2d_input_grad"
    inputs = ("dy", "w")
    kernel_class = "conv"
    params_defaults = {"stride": 1, "padding": 0}

    def base_signature(self, ins, params):
        dy, w = ins["dy"].shape, ins["w"].shape
        pad = params["padding"]
        if params["stride"] != 1:
            raise SignatureError("conv2d_input_grad supports stride 1 only (a strided backward reads every "
                                 "stride-th row, which is no box)")
        if len(dy) != 4 or len(w) != 4 or dy[1] != w[0] or not isinstance(pad, int) or pad < 0:
            raise SignatureError(f"conv2d_input_grad needs dy[N, Co, OH, OW], w[Co, Ci, KH, KW], padding >= 0; "
                                 f"got dy{list(dy)}, w{list(w)}")
        kh, kw = w[2], w[3]
        H, W = dy[2] + kh - 1 - 2 * pad, dy[3] + kw - 1 - 2 * pad
        if H < 1 or W < 1:
            raise SignatureError(f"conv2d_input_grad: no input of positive size gives dy{list(dy)}")
        pdy = Projection((unit_row(4, 0), zero_row(4), unit_row(4, 2), unit_row(4, 3)),
                         (0, 0, pad - kh + 1, pad - kw + 1), (1, dy[1], kh, kw))
        pw = Projection((zero_row(4), unit_row(4, 1), zero_row(4), zero_row(4)), (0, 0, 0, 0), (w[0], 1, kh, kw))
        out = (dy[0], w[1], H, W)
        return Signature(("n", "ci", "h", "w"), out, {"dy": pdy, "w": pw}, identity_projection(4),
                         TensorSpec(out, ins["dy"].dtype), 2.0 * w[0] * kh * kw,
                         (Reduction("co", w[0], "sum", (("dy", 1), ("w", 0))),))

    def compute(self, xp, blocks, params):
        dy, w = blocks["dy"], blocks["w"]
        kh, kw = w.shape[2], w.shape[3]
        hb, wb = dy.shape[2] - kh + 1, dy.shape[3] - kw + 1
        dx = None
        for i in range(kh):
            for j in range(kw):
                win = dy[:, :, kh - 1 - i : kh - 1 - i + hb, kw - 1 - j : kw - 1 - j + wb]
                t = xp.einsum("nohw,oc->nchw", win, w[:, :, i, j])
                dx = t if dx is None else dx + t
        return dx


class Conv2dWeightGrad(Kernel):
    """``dw[co,ci,i,j] = Σ_{n,oh,ow} dy[n,co,oh,ow] · x[n,ci,oh·st-pad+i, ow·st-pad+j]``.

    Index dims ``(co, ci, i, j)``; each shard reads the batch whole; the batch is a splittable sum
    (data-parallel gradient synchronisation).
    """

    name = "conv2d_weight_grad"
    inputs = ("x", "dy")
    kernel_class = "conv"
    params_defaults = {"stride": 1, "padding": 0, "window": None}

    def base_signature(self, ins, params):
        x, dy = ins["x"].shape, ins["dy"].shape
        st, pad, k = params["stride"], params["padding"], params["window"]
        if not (isinstance(k, (list, tuple)) and len(k) == 2 and all(isinstance(v, int) and v >= 1 for v in k)):
            raise SignatureError(f"conv2d_weight_grad needs window [KH, KW], got {k!r}")
        if len(x) != 4 or len(dy) != 4 or x[0] != dy[0]:
            raise SignatureError(f"conv2d_weight_grad needs x[N, Ci, H, W] and dy[N, Co, OH, OW]; "
                                 f"got x{list(x)}, dy{list(dy)}")
        kh, kw = k
        if (x[2] + 2 * pad - kh) // st + 1 != dy[2] or (x[3] + 2 * pad - kw) // st + 1 != dy[3]:
            raise SignatureError(f"conv2d_weight_grad: dy{list(dy)} is not the output of x{list(x)} with window "
                                 f"{list(k)}, stride {st}, padding {pad}")
        px = Projection((zero_row(4), unit_row(4, 1), unit_row(4, 2), unit_row(4, 3)), (0, 0, -pad, -pad),
                        (x[0], 1, st * (dy[2] - 1) + 1, st * (dy[3] - 1) + 1))
        pdy = Projection((zero_row(4), unit_row(4, 0), zero_row(4), zero_row(4)), (0, 0, 0, 0),
                         (dy[0], 1, dy[2], dy[3]))
        out = (dy[1], x[1], kh, kw)
        return Signature(("co", "ci", "i", "j"), out, {"x": px, "dy": pdy}, identity_projection(4),
                         TensorSpec(out, ins["x"].dtype), 2.0 * x[0] * dy[2] * dy[3],
                         (Reduction("n", x[0], "sum", (("x", 0), ("dy", 0))),))

    def compute(self, xp, blocks, params):
        x, dy = blocks["x"], blocks["dy"]
        st = params["stride"]
        oh, ow = dy.shape[2], dy.shape[3]
        ib = x.shape[2] - st * (oh - 1)
        jb = x.shape[3] - st * (ow - 1)
        rows = []
        for i in range(ib):
            cols = []
            for j in range(jb):
                win = x[:, :, i : i + st * (oh - 1) + 1 : st, j : j + st * (ow - 1) + 1 : st]
                cols.append(xp.einsum("nohw,nchw->oc", dy, win))
            rows.append(xp.stack(cols, axis=-1))
        return xp.stack(rows, axis=-2)


KERNELS = (Conv2d, Conv2dInputGrad, Conv2dWeightGrad)
