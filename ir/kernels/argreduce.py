"""``argmax`` / ``argmin``: the position of the largest (smallest) value along one axis, as
integer indices (ONNX ``ArgMax``/``ArgMin``, ``torch.argmax``).

``y = argmax(x, axis)`` with ``keepdims`` (the axis stays as a dim of extent 1, ONNX's default)
and ``select_last_index`` (the last of equal extremes, else the first; ONNX opset 12). The
output's dtype is the IR's index dtype (``INDEX_DTYPE``, int32: ONNX says int64, and every index
the IR holds fits int32 as token ids do). Every output cell depends on its whole row, so the axis
is read whole (hidden in the input projection, as in ``cumsum``) and the index dims are the other
dims, which shard with no halo. Inference only: indices are piecewise constant in ``x``, so the
kernels have no VJP rule and ``ir.autodiff`` refuses a loss that depends on a parameter through
one (naming the op).
"""

from __future__ import annotations

from ir.kernels.base import INDEX_DTYPE, Kernel, Signature, SignatureError, TensorSpec
from ir.kernels.select import axis_of, whole_along
from ir.zspace import identity_projection


class ArgReduce(Kernel):
    inputs = ("x",)
    kernel_class = "reduction"
    params_defaults = {"axis": 0, "keepdims": True, "select_last_index": False}

    def base_signature(self, ins, params):
        shape = ins["x"].shape
        ax = axis_of(params, len(shape), self.name)
        for flag in ("keepdims", "select_last_index"):
            if not isinstance(params[flag], bool):
                raise SignatureError(f"{self.name} {flag} must be true or false, got {params[flag]!r}")
        if len(shape) < 2:
            raise SignatureError(f"{self.name} needs rank >= 2 (the index dims are the dims other than the axis), "
                                 f"got shape {list(shape)}")
        dims = tuple(f"d{k}" for k in range(len(shape)) if k != ax)
        rest = shape[:ax] + shape[ax + 1:]
        if params["keepdims"]:
            out = shape[:ax] + (1,) + shape[ax + 1:]
            proj = whole_along(out, ax)  # the kept axis: extent 1, read whole
        else:
            out, proj = rest, identity_projection(len(rest))
        return Signature(dims, rest, {"x": whole_along(shape, ax)}, proj, TensorSpec(out, INDEX_DTYPE),
                         float(shape[ax]))

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        ax = params["axis"] % x.ndim
        fn = xp.argmax if self.name == "argmax" else xp.argmin
        if params["select_last_index"]:  # the first extreme of the reversed axis is the last one
            i = x.shape[ax] - 1 - fn(xp.flip(x, axis=ax), axis=ax)
        else:
            i = fn(x, axis=ax)
        i = i.astype(INDEX_DTYPE)
        return xp.expand_dims(i, ax) if params["keepdims"] else i


class ArgMax(ArgReduce):
    name = "argmax"


class ArgMin(ArgReduce):
    name = "argmin"


KERNELS = (ArgMax, ArgMin)
