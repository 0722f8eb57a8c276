"""``batchnorm2d``: inference batch normalisation over NCHW (Ioffe & Szegedy 2015, Alg. 2).

``y = (x - mean[c]) / sqrt(var[c] + eps) · scale[c] + bias[c]``. Elementwise over ``x`` (index
space = x's shape); the four per-channel vectors are read at the index point's channel.

Gradients (the inference function's, running statistics included, so a program imported with
them as parameters trains like any other; ``inv = 1/sqrt(var + eps)``):

- ``batchnorm2d_input_grad`` (``dy``, ``scale``, ``var``): ``dx = dy · scale · inv``, elementwise;
- ``batchnorm2d_param_grad`` (``dy``, ``x``, ``scale``, ``mean``, ``var``, ``wrt``): per channel,
  ``Σ dy · (x - mean) · inv`` for ``scale``, ``-scale · inv · Σ dy`` for ``mean`` and
  ``-scale · inv³ / 2 · Σ dy · (x - mean)`` for ``var``; sums over the batch (a splittable
  reduction: data parallelism's gradient all-reduce) and the spatial dims (read whole). The
  bias's gradient is ``Σ dy``: ``reduce_to`` in the rule.
"""

from __future__ import annotations

import numpy as np

from ir.kernels.base import ELEMENTWISE, Kernel, Reduction, Signature, SignatureError, TensorSpec, unit_row, zero_row
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


def _check_vectors(name: str, x: tuple[int, ...], ins, ports) -> None:
    if len(x) < 2:
        raise SignatureError(f"{name} needs dy[N, C, ...], got {list(x)}")
    for port in ports:
        if ins[port].shape != (x[1],):
            raise SignatureError(f"{name} {port} must have shape ({x[1]},), got {list(ins[port].shape)}")


class BatchNorm2dInputGrad(Kernel):
    name = "batchnorm2d_input_grad"
    inputs = ("dy", "scale", "var")
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    params_defaults = {"eps": 1e-5}

    def base_signature(self, ins, params):
        x = ins["dy"].shape
        _check_vectors(self.name, x, ins, ("scale", "var"))
        n = len(x)
        vec = Projection((unit_row(n, 1),), (0,), (1,))
        return Signature(elementwise_dims(n), x, {"dy": identity_projection(n), "scale": vec, "var": vec},
                         identity_projection(n), TensorSpec(x, ins["dy"].dtype), 2.0)

    def value_range(self, port, ins, params):
        return (0.1, 2.0) if port == "var" else None

    def compute(self, xp, blocks, params):
        dy = blocks["dy"]
        shape = (1, -1) + (1,) * (dy.ndim - 2)
        inv = xp.reshape(blocks["scale"], shape) / xp.sqrt(xp.reshape(blocks["var"], shape) + params["eps"])
        return dy * inv


class BatchNorm2dParamGrad(Kernel):
    name = "batchnorm2d_param_grad"
    inputs = ("dy", "x", "scale", "mean", "var")
    kernel_class = "reduction"
    params_defaults = {"eps": 1e-5, "wrt": "scale"}

    def base_signature(self, ins, params):
        x = ins["x"].shape
        if ins["dy"].shape != x:
            raise SignatureError(f"{self.name}: dy{list(ins['dy'].shape)} and x{list(x)} must have one shape")
        _check_vectors(self.name, x, ins, ("scale", "mean", "var"))
        if params["wrt"] not in ("scale", "mean", "var"):
            raise SignatureError(f"{self.name} wrt must be scale, mean or var, got {params['wrt']!r}")
        n = len(x)
        slab = Projection((zero_row(1),) + ((1,),) + (zero_row(1),) * (n - 2), (0,) * n,
                          (x[0], 1) + tuple(x[2:]))
        vec = Projection(((1,),), (0,), (1,))
        return Signature(("c",), (x[1],), {"dy": slab, "x": slab, "scale": vec, "mean": vec, "var": vec},
                         identity_projection(1), TensorSpec((x[1],), ins["x"].dtype),
                         3.0 * x[0] * int(np.prod(x[2:])), (Reduction("n", x[0], "sum", (("dy", 0), ("x", 0))),))

    def value_range(self, port, ins, params):
        return (0.1, 2.0) if port == "var" else None

    def compute(self, xp, blocks, params):
        dy, x = blocks["dy"], blocks["x"]
        axes = (0,) + tuple(range(2, x.ndim))
        shape = (1, -1) + (1,) * (x.ndim - 2)
        scale, mean, var = blocks["scale"], blocks["mean"], blocks["var"]
        inv = 1.0 / xp.sqrt(var + params["eps"])
        wrt = params["wrt"]
        if wrt == "mean":
            return -scale * inv * xp.sum(dy, axis=axes)
        centred = xp.sum(dy * (x - xp.reshape(mean, shape)), axis=axes)
        return centred * inv if wrt == "scale" else -0.5 * scale * inv ** 3 * centred


KERNELS = (BatchNorm2d, BatchNorm2dInputGrad, BatchNorm2dParamGrad)
