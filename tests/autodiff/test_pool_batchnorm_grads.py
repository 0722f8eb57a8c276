"""Gradients of pooling (max, average, global average) and inference batch normalisation against
float64 central finite differences (``fd_check`` of test_vjp_finite_differences), sharded
gradient kernels against unsharded ones, and the imported conv net (conv, batch norm, ReLU, a
ResNet-stem max pool, global average pooling) training."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from executor import verify
from executor.run import execute, random_inputs
from ir.autodiff import training_step
from ir.builder import GraphBuilder
from ir.kernels import SignatureError, TensorSpec, get_kernel
from ir.rewrites import place, random_walk, split
from test_vjp_finite_differences import fd_check, one_op

POOLS = {
    # ResNet stem: 3x3, stride 2, padding 1 (overlapping windows, padding never the max)
    "maxpool_stem": lambda: one_op("maxpool2d", {"x": (2, 2, 5, 5)}, window=[3, 3], stride=[2, 2], padding=1),
    "maxpool_2x2": lambda: one_op("maxpool2d", {"x": (1, 2, 4, 6)}, window=[2, 2], stride=[2, 2]),
    "maxpool_stride1": lambda: one_op("maxpool2d", {"x": (1, 1, 4, 4)}, window=[2, 3], stride=[1, 1]),
    "avgpool_pad_excluded": lambda: one_op("avgpool2d", {"x": (1, 2, 5, 5)}, window=[3, 3], stride=[2, 2],
                                           padding=1, count_include_pad=False),
    "avgpool_pad_included": lambda: one_op("avgpool2d", {"x": (2, 1, 4, 5)}, window=[3, 3], stride=[1, 2],
                                           padding=1),
    "global_avgpool": lambda: one_op("avgpool2d", {"x": (2, 3, 3, 4)}, window=[3, 4], stride=[1, 1]),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_pool_gradients_match_finite_differences(name):
    assert fd_check(POOLS[name]()) > 0


def test_batchnorm_gradients_match_finite_differences():
    """All five inputs are parameters: x, scale and bias, and the running mean and variance (an
    imported model's initializers, trained like its weights)."""
    g = one_op("batchnorm2d", {"x": (2, 3, 2, 2), "scale": (3,), "bias": (3,), "mean": (3,), "var": (3,)}, eps=1e-3)
    assert fd_check(g, positive=("p_var",)) == 24 + 4 * 3


def test_batchnorm_then_maxpool_chain():
    b = GraphBuilder()
    x = b.parameter("x", (1, 2, 4, 4))
    y = b.op("batchnorm2d", "bn", {"x": x, "scale": b.parameter("s", (2,)), "bias": b.parameter("b", (2,)),
                                   "mean": b.input("m", (2,)), "var": b.input("v", (2,))})
    b.op("maxpool2d", "pool", {"x": b.op("relu", "act", {"x": y})}, window=[2, 2], stride=[2, 2])
    g = b.build()
    assert fd_check(g, values={"v": np.array([0.5, 1.5])}) == 32 + 4


def test_sharded_gradient_kernels_equal_unsharded():
    """Splits along h and w read whole planes and keep their own rows; the batch-norm parameter
    gradients split their batch sum (the data-parallel all-reduce)."""
    b = GraphBuilder()
    x, dy = b.input("x", (2, 3, 7, 7)), b.input("dy", (2, 3, 4, 4))
    b.op("maxpool2d_grad", "mg", {"x": x, "dy": dy}, window=[3, 3], stride=[2, 2], padding=1, size=[2, 3, 7, 7])
    b.op("avgpool2d_grad", "ag", {"dy": dy}, window=[3, 3], stride=[2, 2], padding=1, size=[2, 3, 7, 7],
         count_include_pad=False)
    dz, z = b.input("dz", (4, 3, 2, 2)), b.input("z", (4, 3, 2, 2))
    vecs = {p: b.input(p, (3,)) for p in ("scale", "mean", "var")}
    b.op("batchnorm2d_param_grad", "bg", {"dy": dz, "x": z, **vecs}, wrt="var")
    g = b.build()
    sharded = place(split(place(split(g, "mg", 2, 3), "mg", [0, 1, 2]), "ag", 3, 2), "ag", [1, 3])
    sharded = place(split(sharded, "mg", 3, 2), "mg", [0, 1, 2, 3, 0, 1])
    assert verify(sharded).ok
    rep = verify(random_walk(g, np.random.default_rng(2), 4, 30))
    assert rep.ok, rep


def test_pool_grad_refuses_a_dy_of_the_wrong_shape():
    k = get_kernel("maxpool2d_grad")
    with pytest.raises(SignatureError, match="is not the maxpool2d output"):
        k.signature({"x": TensorSpec((1, 1, 5, 5), "float32"), "dy": TensorSpec((1, 1, 3, 2), "float32")},
                    {"window": [3, 3], "stride": [2, 2], "padding": 1, "size": [1, 1, 5, 5]})
    with pytest.raises(SignatureError, match="wrt must be"):
        get_kernel("batchnorm2d_param_grad").signature(
            {p: TensorSpec((2, 3, 2, 2) if p in ("dy", "x") else (3,), "float32")
             for p in ("dy", "x", "scale", "mean", "var")}, {"wrt": "bias"})


def test_imported_convnet_trains():
    """The imported conv net (Conv, BatchNormalization, Relu, MaxPool 3x3/2 pad 1, Conv,
    GlobalAveragePool, Gemm): one SGD step lowers the loss; data-parallel and random plans of the
    step verify against the unsharded step."""
    pytest.importorskip("onnx")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "importers"))
    import onnx_models

    from ir.importers.onnx import import_onnx

    g, values = import_onnx(onnx_models.convnet(), {"N": 4})
    step = training_step(g, loss="mse", optimizer="sgd", optimizer_params={"lr": 0.05})
    assert {"maxpool2d_grad", "avgpool2d_grad", "batchnorm2d_input_grad", "batchnorm2d_param_grad"} <= \
        {o.kernel for o in step.ops.values()}
    ins = random_inputs(step, 0)
    ins.update(values)
    env = execute(step, ins)
    ins2 = dict(ins)
    ins2.update({p: np.asarray(env[nxt]) for p, nxt in step.carried.items()})
    assert float(np.asarray(execute(step, ins2)["loss"]).sum()) < float(np.asarray(env["loss"]).sum())
    dp = step
    for op in dp.topo_order:
        sig = dp.signature(op)
        if sig.dims and sig.extents[0] == 4:
            dp = place(split(dp, op, 0, 4), op, [0, 1, 2, 3])
    assert len(dp.devices) == 4
    assert verify(dp, values=values).ok
    rep = verify(random_walk(step, np.random.default_rng(7), 4, 30), values=values)
    assert rep.ok, rep
