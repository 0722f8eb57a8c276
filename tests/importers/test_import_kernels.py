"""The kernels imported programs use (ir/kernels/{mathfn,select,shape,pooling,batchnorm}.py)
against independent NumPy references, whole and sharded along every dim."""

from __future__ import annotations

import math

import numpy as np
import pytest

from executor import verify
from executor.run import execute, random_inputs
from ir.builder import GraphBuilder
from ir.kernels import SignatureError
from ir.kernels.shape import reshape_layout
from ir.rewrites import place, split

_erf = np.vectorize(math.erf)


def _pool_ref(x, k, st, pad, fn, fill=0.0):
    """Loops over output cells; padding cells hold ``fill`` (NaN: left out, as nanmean does)."""
    x = np.pad(x, [(0, 0), (0, 0), (pad, pad), (pad, pad)], constant_values=fill)
    oh = (x.shape[2] - k) // st + 1
    ow = (x.shape[3] - k) // st + 1
    out = np.empty(x.shape[:2] + (oh, ow), x.dtype)
    for i in range(oh):
        for j in range(ow):
            out[:, :, i, j] = fn(x[:, :, i * st:i * st + k, j * st:j * st + k], axis=(2, 3))
    return out


CASES = {
    "sigmoid": ({"x": (4, 6)}, {}, lambda x: 1 / (1 + np.exp(-x))),
    "sqrt": ({"x": (4, 6)}, {}, None),
    "reciprocal": ({"x": (4, 6)}, {}, lambda x: 1 / x),
    "erf": ({"x": (4, 6)}, {}, lambda x: _erf(x)),
    "gelu_erf": ({"x": (4, 6)}, {}, lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
    "pow": ({"x": (4, 6)}, {"exponent": 3.0}, lambda x: x ** 3),
    "where": ({"c": (1, 6), "a": (4, 6), "b": (4, 1)}, {}, lambda c, a, b: np.where(c != 0, a, b)),
    "concat": ({"a": (4, 2, 6), "b": (4, 3, 6)}, {"axis": 1}, lambda a, b: np.concatenate([a, b], 1)),
    "slice": ({"x": (4, 10)}, {"axis": 1, "start": 1, "stop": 9, "step": 3}, lambda x: x[:, 1:9:3]),
    "pad": ({"x": (4, 6)}, {"axis": 0, "before": 2, "after": 1}, lambda x: np.pad(x, [(2, 1), (0, 0)])),
    "maxpool2d": ({"x": (2, 3, 8, 8)}, {"window": [2, 2], "stride": [2, 2]},
                  lambda x: _pool_ref(x, 2, 2, 0, np.max)),
    "avgpool2d": ({"x": (2, 3, 8, 8)}, {"window": [3, 3], "stride": [1, 1], "padding": 1},
                  lambda x: _pool_ref(x, 3, 1, 1, np.mean)),
    "maxpool2d_pad": ({"x": (2, 3, 7, 7)}, {"window": [3, 3], "stride": [2, 2], "padding": 1},
                      lambda x: _pool_ref(x - 5.0, 3, 2, 1, np.max, -np.inf) + 5.0),
    "avgpool2d_exclude_pad": ({"x": (1, 2, 6, 6)}, {"window": [3, 3], "stride": [2, 2], "padding": 1,
                                                   "count_include_pad": False},
                              lambda x: _pool_ref(x, 3, 2, 1, np.nanmean, np.nan)),
    "batchnorm2d": ({"x": (2, 4, 3, 3), "scale": (4,), "bias": (4,), "mean": (4,), "var": (4,)}, {"eps": 1e-5},
                    lambda x, s, b, m, v: (x - m[:, None, None]) / np.sqrt(v[:, None, None] + 1e-5)
                    * s[:, None, None] + b[:, None, None]),
}


KERNEL_OF = {"maxpool2d_pad": "maxpool2d", "avgpool2d_exclude_pad": "avgpool2d"}  # case id -> kernel


def _graph(kernel, shapes, params):
    kernel = KERNEL_OF.get(kernel, kernel)
    b = GraphBuilder()
    ins = {p: b.input(f"in_{p}", s) for p, s in shapes.items()}
    b.op(kernel, "op", ins, **params)
    return b.build()


@pytest.mark.parametrize("kernel", list(CASES))
def test_kernel_matches_reference_and_shards(kernel):
    shapes, params, ref = CASES[kernel]
    g = _graph(kernel, shapes, params)
    ins = random_inputs(g, 0)
    if kernel in ("sqrt",):
        ins = {k: np.abs(v) + 0.1 for k, v in ins.items()}
    if kernel == "where":
        ins["in_c"] = (ins["in_c"] > 0).astype(np.float32)
    if kernel == "maxpool2d_pad":  # all negative: zero padding would win every border max
        ins["in_x"] = ins["in_x"] - 5.0
    out = execute(g, ins)["op.out"]
    args = [ins[f"in_{p}"] for p in shapes]
    want = np.sqrt(args[0]) if ref is None else ref(*args)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)
    sig = g.signature("op")
    for d, ext in enumerate(sig.extents):
        if ext >= 2 and kernel != "sqrt":
            h = place(split(g, "op", d, 2), "op", [0, 1])
            assert verify(h).ok, (kernel, sig.dims[d])


@pytest.mark.parametrize("src,dst,index", [
    ((2, 3, 8), (2, 3, 2, 4), (2, 3, 2)),   # split the last dim: heads are an index dim
    ((2, 3, 2, 4), (2, 3, 8), (2, 3, 2)),   # merge
    ((4, 6), (2, 12), (2,)),                # nested cuts
    ((6, 4), (4, 6), ()),                   # no common refinement: one hidden block
    ((2, 5, 1, 1), (2, 5), (2, 5)),         # Flatten/Squeeze of size-1 dims
    ((2, 5), (2, 1, 5), (2, 5)),            # Unsqueeze
    ((24,), (2, 3, 4), (2,)),
])
def test_reshape_layout_and_sharded_execution(src, dst, index):
    assert tuple(reshape_layout(src, dst)[0]) == index
    b = GraphBuilder()
    x = b.input("x", src)
    b.reshape(x, name="r", shape=list(dst), **{"from": list(src)})
    g = b.build()
    ins = random_inputs(g, 0)
    np.testing.assert_array_equal(execute(g, ins)["r.out"], ins["x"].reshape(dst))
    for d, ext in enumerate(g.signature("r").extents):
        if ext >= 2:
            assert verify(place(split(g, "r", d, 2), "r", [0, 1])).ok


def test_bad_params_refused():
    b = GraphBuilder()
    x = b.input("x", (4, 6))
    with pytest.raises(SignatureError, match="cells"):
        b.reshape(x, name="r", shape=[5, 5])
    with pytest.raises(SignatureError, match="start < stop"):
        b.slice(x, name="s", axis=1, start=4, stop=2)
    with pytest.raises(SignatureError, match="less than the window"):  # a window of padding only
        b.maxpool2d(b.input("im", (1, 1, 4, 4)), name="m", window=[2, 2], stride=[2, 2], padding=[0, 0, 2, 0])
    with pytest.raises(SignatureError, match="padding >= 0"):
        b.maxpool2d(b.input("im2", (1, 1, 4, 4)), name="m2", window=[2, 2], stride=[2, 2], padding=[1, -1])
