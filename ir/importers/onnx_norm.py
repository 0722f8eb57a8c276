"""ONNX ``GroupNormalization`` and ``InstanceNormalization`` -> ``group_norm`` (registered in
``HANDLERS``; the kernel is ``ir.kernels.groupnorm``).

- ``InstanceNormalization(x, scale[C], B[C])`` is ``group_norm`` with one group per channel.
- ``GroupNormalization(x, scale, bias, num_groups)``: opset 18 defines ``scale`` and ``bias`` per
  group (shape ``[G]``, each group's value for all its channels), opset 21 per channel (``[C]``);
  the kernel's ``affine`` says which, so the initializers keep their ONNX names and shapes.
  ``stash_type`` (opset 21) only sets the precision of the statistics; the kernel computes them in
  the program's dtype (float64 under ``verify``'s float64 runs).

``torch.nn.GroupNorm`` (TorchScript exporter, opsets 17-23) exports as ``Reshape`` to ``[N, G,
-1]``, ``InstanceNormalization`` with constant ones and zeros, ``Reshape`` back, then ``Mul``/``Add``
by the weight and bias: ``group_norm`` over ``G`` channels of the view plus the affine ops, exact and
trainable (``ir.importers.torch_export`` names the reshaped weight after its ``state_dict`` entry).
"""

from __future__ import annotations

from ir.importers.onnx_ops import Unsupported, attr, handles


def _no_extra_outputs(node) -> None:
    if any(o for o in node.output[1:]):
        raise Unsupported("outputs beyond the normalised tensor (mean, inverse std-dev)")


@handles("InstanceNormalization")
def _instance_norm(ctx, node, label):
    _no_extra_outputs(node)
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    if len(shape) < 3:
        raise Unsupported(f"input of rank {len(shape)}; ONNX InstanceNormalization takes x[N, C, D1, ...]")
    ctx.emit("group_norm", {"x": x, "scale": ctx.use(node.input[1]), "bias": ctx.use(node.input[2])},
             {"groups": shape[1], "eps": float(attr(node, "epsilon", 1e-5)), "affine": "channel"},
             out=node.output[0], name=label)


@handles("GroupNormalization")
def _group_norm(ctx, node, label):
    _no_extra_outputs(node)
    groups = attr(node, "num_groups", None)
    if groups is None:
        raise Unsupported("no num_groups attribute")
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    if len(shape) < 3 or shape[1] % int(groups):
        raise Unsupported(f"num_groups={groups} for an input of shape {list(shape)} (x[N, C, D1, ...] with C a "
                          f"multiple of num_groups)")
    ctx.emit("group_norm", {"x": x, "scale": ctx.use(node.input[1]), "bias": ctx.use(node.input[2])},
             {"groups": int(groups), "eps": float(attr(node, "epsilon", 1e-5)),
              "affine": "channel" if ctx.opset >= 21 else "group"},
             out=node.output[0], name=label)
