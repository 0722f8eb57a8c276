"""``batchnorm2d``: inference batch normalisation over NCHW (Ioffe & Szegedy 2015, Alg. 2).

``y = (x - mean[c]) / sqrt(var[c] + eps) · scale[c] + bias[c]``. Elementwise over ``x`` (index
space = x's shape); the four per-channel vectors are read at the index point's channel.
"""

from __future__ import annotations

from ir.kernels.base import ELEMENTWISE, Kernel, Signature, SignatureError, TensorSpec, unit_row
from ir.kernels.elementwise import elementwise_dims
from ir.zspace import Projection, identity_projection


class BatchNorm2d(Kernel):
    name = "batchnorm2d"
    inputs = ("x", "scale", "bias", "mean", "var")
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    params_defaults = {"eps": 1e-5}

    def base_signature(self, ins, params):
        x = ins["x"].shape
        if len(x) < 2:
            raise SignatureError(f"batchnorm2d needs x[N, C, ...], got {list(x)}")
        for port in self.inputs[1:]:
            if ins[port].shape != (x[1],):
                raise SignatureError(f"batchnorm2d {port} must have shape ({x[1]},), got {list(ins[port].shape)}")
        n = len(x)
        vec = Projection((unit_row(n, 1),), (0,), (1,))
        return Signature(elementwise_dims(n), x, {"x": identity_projection(n), **{p: vec for p in self.inputs[1:]}},
                         identity_projection(n), TensorSpec(x, ins["x"].dtype), 4.0)

    def value_range(self, port, ins, params):
        # A variance is >= 0; random inputs draw it from a finite, well-conditioned range.
        return (0.1, 2.0) if port == "var" else None

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        shape = (1, -1) + (1,) * (x.ndim - 2)

        def per_channel(port):
            return xp.reshape(blocks[port], shape)

        inv = per_channel("scale") / xp.sqrt(per_channel("var") + params["eps"])
        return (x - per_channel("mean")) * inv + per_channel("bias")


KERNELS = (BatchNorm2d,)
