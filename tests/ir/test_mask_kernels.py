"""The comparison and boolean kernels (``ir/kernels/masks.py``) on integer-valued inputs, where
every outcome occurs, against NumPy's operators; bad ops are refused by name."""

from __future__ import annotations

import operator

import numpy as np
import pytest

from ir.kernels import SignatureError, TensorSpec, get_kernel

A = np.array([[0.0, 1.0, 2.0], [2.0, 0.0, 1.0]])
B = np.array([[1.0, 1.0, 0.0]])
COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
           "ge": operator.ge}
LOGIC = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def _run(kernel: str, ins: dict[str, np.ndarray], **params) -> np.ndarray:
    k = get_kernel(kernel)
    p = k.check_params(params)
    sig = k.signature({n: TensorSpec(v.shape, "float32") for n, v in ins.items()}, p)
    y = k.compute(np, ins, p)
    assert y.shape == sig.out_spec.shape and y.dtype == A.dtype
    return y


@pytest.mark.parametrize("op", list(COMPARE))
def test_compare_and_compare_scalar(op):
    np.testing.assert_array_equal(_run("compare", {"a": A, "b": B}, op=op), COMPARE[op](A, B).astype(float))
    np.testing.assert_array_equal(_run("compare_scalar", {"x": A}, op=op, value=1),
                                  COMPARE[op](A, 1.0).astype(float))


@pytest.mark.parametrize("op", list(LOGIC))
def test_logical_reads_nonzero_as_true(op):
    np.testing.assert_array_equal(_run("logical", {"a": A, "b": B}, op=op), LOGIC[op](A != 0, B != 0).astype(float))


def test_bad_ops_refused():
    spec = {"a": TensorSpec((2,), "float32"), "b": TensorSpec((2,), "float32")}
    with pytest.raises(SignatureError, match="compare op 'less' must be one of"):
        get_kernel("compare").signature(spec, {"op": "less"})
    with pytest.raises(SignatureError, match="logical op 'not' must be one of"):
        get_kernel("logical").signature(spec, {"op": "not"})
    with pytest.raises(SignatureError, match="value must be a number"):
        get_kernel("compare_scalar").signature({"x": spec["a"]}, {"op": "eq", "value": "0"})
