"""Comparison and boolean kernels: masks held as floats of 0 and 1 (the IR has no boolean dtype).

- ``compare(a, b; op)``: ``1`` where ``a op b``, else ``0``; ``op`` is one of ``eq``, ``ne``,
  ``lt``, ``le``, ``gt``, ``ge``; numpy broadcasting, as ``add``.
- ``compare_scalar(x; op, value)``: ``1`` where ``x op value`` (ONNX's ``Not`` is ``eq 0``, a
  ``Cast`` to bool is ``ne 0``), without a one-cell parameter tensor.
- ``logical(a, b; op)``: ``and``, ``or``, ``xor`` of ``a != 0`` and ``b != 0``.
- ``masked_fill(x, c; value, fill_where)``: ``value`` (``None``: ``-inf``, as ``causal_mask``)
  where ``c`` is nonzero (``fill_where="nonzero"``, PyTorch's ``masked_fill``) or zero
  (``"zero"``: ONNX's ``Where(c, x, value)``), ``x`` elsewhere. A scalar fill is a parameter of
  the op, not a one-cell tensor: nothing for the search to move, and nothing for a training step
  to update (an SGD step of a ``-inf`` tensor is NaN).

These are the masks of Hugging Face exports (``attention_mask == 0``, ``causal & padding``) on
their way to ``where`` (which reads ``c != 0``) or a ``Cast`` to float. All are elementwise
(index space = output shape, identity output projection), so they shard and fuse like ``add``.
The first three are piecewise constant: their gradient is zero, and their VJP rules emit nothing;
``masked_fill`` passes ``dy`` to ``x`` where it kept ``x`` (``where_grad``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from ir.kernels.base import ELEMENTWISE, Kernel, Signature, SignatureError, TensorSpec, broadcast_shape
from ir.kernels.elementwise import Binary, Unary, broadcast_projection, elementwise_dims
from ir.zspace import identity_projection

COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
CONNECTIVES = ("and", "or", "xor")


def _compare(xp: Any, a: Any, b: Any, op: str) -> Any:
    fn = {"eq": xp.equal, "ne": xp.not_equal, "lt": xp.less, "le": xp.less_equal, "gt": xp.greater,
          "ge": xp.greater_equal}[op]
    return fn(a, b)


class _WithOp:
    """Mixin: the ``op`` parameter must be one of ``ops`` (checked before the elementwise base's
    signature)."""

    name: ClassVar[str]
    ops: ClassVar[tuple[str, ...]]

    def base_signature(self, ins: Mapping[str, TensorSpec], params: Mapping[str, Any]) -> Signature:
        if params["op"] not in self.ops:
            raise SignatureError(f"{self.name} op {params['op']!r} must be one of {list(self.ops)}")
        return super().base_signature(ins, params)  # type: ignore[misc]


class Compare(_WithOp, Binary):
    name = "compare"
    ops = COMPARISONS
    params_defaults = {"op": "eq"}

    def compute(self, xp, blocks, params):
        return _compare(xp, blocks["a"], blocks["b"], params["op"]).astype(blocks["a"].dtype)


class CompareScalar(_WithOp, Unary):
    name = "compare_scalar"
    ops = COMPARISONS
    params_defaults = {"op": "eq", "value": 0.0}

    def base_signature(self, ins, params):
        if not isinstance(params["value"], (int, float)) or isinstance(params["value"], bool):
            raise SignatureError(f"compare_scalar value must be a number, got {params['value']!r}")
        return super().base_signature(ins, params)

    def compute(self, xp, blocks, params):
        return _compare(xp, blocks["x"], params["value"], params["op"]).astype(blocks["x"].dtype)


class Logical(_WithOp, Binary):
    name = "logical"
    ops = CONNECTIVES
    params_defaults = {"op": "and"}

    def compute(self, xp, blocks, params):
        fn = {"and": xp.logical_and, "or": xp.logical_or, "xor": xp.logical_xor}[params["op"]]
        return fn(blocks["a"] != 0, blocks["b"] != 0).astype(blocks["a"].dtype)


class MaskedFill(Kernel):
    name = "masked_fill"
    inputs = ("x", "c")
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    params_defaults = {"value": None, "fill_where": "nonzero"}

    def base_signature(self, ins, params):
        v = params["value"]
        if not (v is None or isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise SignatureError(f"masked_fill value must be a number or null (-inf), got {v!r}")
        if params["fill_where"] not in ("nonzero", "zero"):
            raise SignatureError(f"masked_fill fill_where {params['fill_where']!r} must be 'nonzero' or 'zero'")
        out = broadcast_shape([ins["x"].shape, ins["c"].shape])
        return Signature(elementwise_dims(len(out)), out,
                         {p: broadcast_projection(ins[p].shape, out) for p in self.inputs},
                         identity_projection(len(out)), TensorSpec(out, ins["x"].dtype), 1.0)

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        fill = (blocks["c"] != 0) if params["fill_where"] == "nonzero" else (blocks["c"] == 0)
        value = -xp.inf if params["value"] is None else params["value"]
        return xp.where(fill, xp.asarray(value, dtype=x.dtype), x)


KERNELS = (Compare, CompareScalar, Logical, MaskedFill)
