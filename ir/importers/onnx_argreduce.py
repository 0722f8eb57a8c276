"""ONNX ``ArgMax`` and ``ArgMin`` -> ``argmax``/``argmin`` (registered in ``HANDLERS``; the
kernels are ``ir.kernels.argreduce``).

The attributes map one to one (ONNX ``ArgMax``-13: ``axis`` default 0, negative from the end;
``keepdims`` default 1; ``select_last_index`` default 0, opset 12 on). The indices are the IR's
int32 index tensors (ONNX's int64): a ``Cast`` to float reads them by ``index_to_float``, and a
graph output holds them as they are. Inference only: a training step whose loss depends on the
indices is refused by ``ir.autodiff`` naming the node.
"""

from __future__ import annotations

from ir.importers.onnx_ops import Unsupported, attr, handles


@handles("ArgMax", "ArgMin")
def _arg_reduce(ctx, node, label):
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    if ctx.prog.spec(x).dtype == "int32":
        raise Unsupported(f"{node.op_type} of integers (float inputs only)")
    axis = int(attr(node, "axis", 0))
    if not -len(shape) <= axis < len(shape):
        raise Unsupported(f"axis {axis} for an input of rank {len(shape)}")
    keep = bool(attr(node, "keepdims", 1))
    if len(shape) < 2:
        raise Unsupported(f"{node.op_type} of a 1-D input (rank >= 2; a 1-D input's indices are a scalar or one "
                          f"cell)")
    kernel = "argmax" if node.op_type == "ArgMax" else "argmin"
    ctx.emit(kernel, {"x": x}, {"axis": axis % len(shape), "keepdims": keep,
                                "select_last_index": bool(attr(node, "select_last_index", 0))},
             out=node.output[0], name=label)
