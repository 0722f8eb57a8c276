"""ONNX handlers for comparisons and boolean ops: the masks of newer Hugging Face exports
(registered in ``HANDLERS``).

Exports build attention masks as booleans: ``attention_mask == 0``, ``arange(s)[:, None] >=
arange(s)``, ``causal & padding``, ``~mask``, then ``Where(mask, scores, -inf)`` or a ``Cast`` to
float. The IR has no boolean dtype, so a computed boolean is a float tensor of 0 and 1
(``ir.kernels.masks``), recorded in ``Context.bool_valued`` and ``int_valued``: a later ``Cast``
of it to a float or to bool is the same tensor, and ``where`` reads it as ``c != 0``.

- A node whose inputs are all constants (or shapes) is folded before it gets here (the causal
  ``arange`` comparisons of exports become one constant mask).
- ``Equal``/``Less``/``Greater``/``LessOrEqual``/``GreaterOrEqual`` are ``compare``, or
  ``compare_scalar`` when one side is a one-element constant (flipped when it is on the left).
- ``Not`` is ``compare_scalar(x, eq, 0)``; ``And``/``Or``/``Xor`` are ``logical``.
- Integer operands (``attention_mask`` and its views) are compared through their
  ``index_to_float`` copies: integers up to 2^24 are exact in float32, and masks hold 0 and 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ir.importers.onnx_ops import Context, float_operand, handles

_COMPARE = {"Equal": "eq", "Less": "lt", "Greater": "gt", "LessOrEqual": "le", "GreaterOrEqual": "ge"}
_FLIPPED = {"eq": "eq", "lt": "gt", "gt": "lt", "le": "ge", "ge": "le"}  # c op x  ==  x flipped(op) c
_LOGIC = {"And": "and", "Or": "or", "Xor": "xor"}


def _one_value(ctx: Context, name: str) -> float | None:
    """A one-element constant's value as a float (``True`` is 1), else None."""
    if ctx.is_const(name) and ctx.const[name].size == 1:
        return float(np.asarray(ctx.const[name]).reshape(-1)[0])
    return None


def _mask(ctx: Context, kernel: str, inputs: dict[str, str], params: dict[str, Any], out: str, label: str) -> None:
    t = ctx.emit(kernel, inputs, params, out=out, name=label)
    ctx.int_valued.add(t)
    ctx.bool_valued.add(t)


@handles(*_COMPARE)
def _compare(ctx: Context, node: Any, label: str) -> None:
    a, b = node.input[0], node.input[1]
    op = _COMPARE[node.op_type]
    va, vb = _one_value(ctx, a), _one_value(ctx, b)
    if vb is not None:
        _mask(ctx, "compare_scalar", {"x": float_operand(ctx, a)}, {"op": op, "value": vb}, node.output[0], label)
    elif va is not None:
        _mask(ctx, "compare_scalar", {"x": float_operand(ctx, b)}, {"op": _FLIPPED[op], "value": va}, node.output[0],
              label)
    else:
        _mask(ctx, "compare", {"a": float_operand(ctx, a), "b": float_operand(ctx, b)}, {"op": op}, node.output[0],
              label)


@handles("Not")
def _not(ctx: Context, node: Any, label: str) -> None:
    _mask(ctx, "compare_scalar", {"x": float_operand(ctx, node.input[0])}, {"op": "eq", "value": 0.0},
          node.output[0], label)


@handles(*_LOGIC)
def _logical(ctx: Context, node: Any, label: str) -> None:
    _mask(ctx, "logical", {"a": float_operand(ctx, node.input[0]), "b": float_operand(ctx, node.input[1])},
          {"op": _LOGIC[node.op_type]}, node.output[0], label)


@handles("IsNaN")
def _isnan(ctx: Context, node: Any, label: str) -> None:
    """``x != x``: 1 exactly where ``x`` is NaN (torch's exported attention zeroes the NaN rows of a
    fully masked softmax with ``Where(IsNaN(p), 0, p)``)."""
    x = float_operand(ctx, node.input[0])
    _mask(ctx, "compare", {"a": x, "b": x}, {"op": "ne"}, node.output[0], label)
