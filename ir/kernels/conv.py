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
                t = xp.einsum("nchw,oc->nohw", win, w[:, :, i, j])
                y = t if y is None else y + t
        return y


KERNELS = (Conv2d,)
