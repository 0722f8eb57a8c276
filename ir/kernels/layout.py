"""Layout kernels: permute (transpose) of dimensions."""

from __future__ import annotations

from ir.kernels.base import Kernel, Signature, SignatureError, TensorSpec, unit_row
from ir.zspace import Projection, identity_projection


class Permute(Kernel):
    """``y = x.transpose(perm)``: output dim i is input dim ``perm[i]``."""

    name = "permute"
    inputs = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"perm": None}

    def base_signature(self, ins, params):
        shape = ins["x"].shape
        perm = params["perm"]
        if perm is None:
            perm = list(range(len(shape)))[::-1]
        if sorted(perm) != list(range(len(shape))):
            raise SignatureError(f"permute perm {perm} is not a permutation of 0..{len(shape) - 1}")
        n = len(shape)
        out = tuple(shape[p] for p in perm)
        rows = [None] * n
        for i, p in enumerate(perm):
            rows[p] = unit_row(n, i)
        return Signature(tuple(f"d{i}" for i in range(n)), out,
                         {"x": Projection(tuple(rows), (0,) * n, (1,) * n)},
                         identity_projection(n), TensorSpec(out, ins["x"].dtype), 0.0)

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        perm = params["perm"] if params["perm"] is not None else list(range(x.ndim))[::-1]
        return xp.transpose(x, perm)


class Transpose(Permute):
    name = "transpose"


KERNELS = (Permute, Transpose)
