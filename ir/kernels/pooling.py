"""2-D pooling over NCHW: ``maxpool2d`` and ``avgpool2d`` (window, stride, padding).

Index dims ``(n, c, oh, ow)``; the input projection for ``oh`` is ``[oh·stride - pad,
oh·stride - pad + kh)`` as in ``ir.kernels.conv``: shards of neighbouring rows overlap by the
halo. The executor reads padding cells as zeros; ``run`` knows the shard's box, hence which rows
and columns of its block lie outside the tensor, and treats them as ONNX does: ``-inf`` for a
max, and for an average either zeros counted in the divisor (``count_include_pad``, the default)
or cells left out of it. Global average pooling is ``avgpool2d`` with the whole plane as window.
"""

from __future__ import annotations

from ir.kernels.base import Kernel, Signature, SignatureError, TensorSpec, unit_row
from ir.zspace import Projection, ZRange, identity_projection


class Pool2d(Kernel):
    inputs = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"window": [2, 2], "stride": [2, 2], "padding": 0}

    def base_signature(self, ins, params):
        x = ins["x"].shape
        k, st, pad = params["window"], params["stride"], params["padding"]
        ok = (isinstance(k, (list, tuple)) and len(k) == 2 and isinstance(st, (list, tuple)) and len(st) == 2
              and all(isinstance(v, int) and v >= 1 for v in (*k, *st)) and isinstance(pad, int) and pad >= 0)
        if len(x) != 4 or not ok:
            raise SignatureError(f"{self.name} needs x[N, C, H, W], window [kh, kw] and stride [sh, sw] >= 1 and "
                                 f"padding >= 0; got x{list(x)}, window={k!r}, stride={st!r}, padding={pad!r}")
        if pad and 2 * pad >= min(k):
            raise SignatureError(f"{self.name} padding {pad} must be less than half the window {list(k)} (a window "
                                 f"of padding only has no value)")
        oh = (x[2] + 2 * pad - k[0]) // st[0] + 1
        ow = (x[3] + 2 * pad - k[1]) // st[1] + 1
        if oh < 1 or ow < 1:
            raise SignatureError(f"{self.name} output would be empty for x{list(x)} and window {list(k)}")
        rows = (unit_row(4, 0), unit_row(4, 1), tuple(st[0] * int(c == 2) for c in range(4)),
                tuple(st[1] * int(c == 3) for c in range(4)))
        out = (x[0], x[1], oh, ow)
        return Signature(("n", "c", "oh", "ow"), out, {"x": Projection(rows, (0, 0, -pad, -pad), (1, 1, k[0], k[1]))},
                         identity_projection(4), TensorSpec(out, ins["x"].dtype), float(k[0] * k[1]))

    def windows(self, x, params):
        (kh, kw), (sh, sw) = params["window"], params["stride"]
        oh = (x.shape[2] - kh) // sh + 1
        ow = (x.shape[3] - kw) // sw + 1
        for i in range(kh):
            for j in range(kw):
                yield x[:, :, i: i + sh * (oh - 1) + 1: sh, j: j + sw * (ow - 1) + 1: sw]

    def inside(self, xp, box: ZRange, sig: Signature):
        """Boolean (rows, cols) of the shard's input block that lie inside the tensor."""
        b = sig.inputs["x"].apply(box)
        H, W = sig.in_specs["x"].shape[2:]
        r = xp.arange(b.start[2], b.end[2])
        c = xp.arange(b.start[3], b.end[3])
        return (r >= 0) & (r < H), (c >= 0) & (c < W)

    def compute(self, xp, blocks, params):
        if params["padding"]:
            raise SignatureError(f"{self.name} with padding runs through run() (it needs the shard's box)")
        return self.reduce(xp, blocks["x"], params, None)

    def run(self, xp, blocks, params, box, sig):
        if not params["padding"]:
            return self.reduce(xp, blocks["x"], params, None)
        return self.reduce(xp, blocks["x"], params, self.inside(xp, box, sig))


class MaxPool2d(Pool2d):
    name = "maxpool2d"

    def reduce(self, xp, x, params, inside):
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

    def reduce(self, xp, x, params, inside):
        y = None
        for win in self.windows(x, params):
            y = win if y is None else y + win
        kh, kw = params["window"]
        if inside is None or params["count_include_pad"]:
            return y * (1.0 / (kh * kw))
        ones = (inside[0][:, None] & inside[1][None, :]).astype(x.dtype)[None, None]
        count = None
        for win in self.windows(ones, params):
            count = win if count is None else count + win
        return y / count


KERNELS = (MaxPool2d, AvgPool2d)
