"""Gradients of convolutions with dilations and per-axis strides and pads (input gradients of
strided convs included), and of pooling with per-side pads and ``ceil_mode``, against float64
central finite differences (``fd_check``), and their gradient kernels sharded (halos of dilated
taps, blocks of stride rows, planes of ceil-mode windows) against unsharded ones."""

from __future__ import annotations

import numpy as np
import pytest

from executor import verify
from executor.run import execute
from ir.autodiff import training_step
from ir.builder import GraphBuilder
from ir.kernels import get_kernel, TensorSpec
from ir.rewrites import place, random_walk, split
from test_vjp_finite_differences import fd_check, one_op

CASES = {
    "conv_dilated_same": lambda: one_op("conv2d", {"x": (1, 2, 6, 6), "w": (2, 2, 3, 3)}, dilation=2, padding=2),
    "conv_dilation_per_axis_asym_pads": lambda: one_op("conv2d", {"x": (2, 2, 5, 6), "w": (3, 2, 2, 3)},
                                                       dilation=[2, 1], padding=[1, 0, 0, 2]),
    # strided: the input gradient is a transposed conv over blocks of stride rows, cropped to x
    "conv_strides_per_axis": lambda: one_op("conv2d", {"x": (2, 2, 7, 8), "w": (2, 2, 3, 2)},
                                            stride=[2, 1], dilation=[1, 2], padding=[0, 1, 1, 0]),
    "conv_resnet_stage_entry": lambda: one_op("conv2d", {"x": (2, 2, 7, 7), "w": (3, 2, 3, 3)}, stride=2, padding=1),
    "conv_stem_7x7_s2": lambda: one_op("conv2d", {"x": (1, 1, 9, 10), "w": (2, 1, 7, 7)}, stride=2, padding=3),
    # stride past the window: rows between windows get no gradient
    "conv_1x1_downsample": lambda: one_op("conv2d", {"x": (1, 3, 7, 8), "w": (2, 3, 1, 1)}, stride=2),
    "conv_stride3_dilated_asym": lambda: one_op("conv2d", {"x": (1, 2, 10, 9), "w": (2, 2, 2, 3)},
                                                stride=[3, 2], dilation=[2, 1], padding=[1, 0, 2, 1]),
    "maxpool_ceil": lambda: one_op("maxpool2d", {"x": (1, 2, 6, 6)}, window=[3, 3], stride=[2, 2], ceil_mode=True),
    "maxpool_asym_pads_ceil": lambda: one_op("maxpool2d", {"x": (1, 1, 5, 7)}, window=[3, 2], stride=[2, 3],
                                             padding=[1, 0, 0, 1], ceil_mode=True),
    "maxpool_dilated_asym_pads": lambda: one_op("maxpool2d", {"x": (1, 2, 7, 8)}, window=[2, 3], stride=[2, 1],
                                                dilation=2, padding=[1, 2, 1, 0]),
    "avgpool_dilated_ceil_exclude_pad": lambda: one_op("avgpool2d", {"x": (1, 1, 8, 7)}, window=[2, 2], stride=[2, 2],
                                                       dilation=[3, 2], padding=1, ceil_mode=True,
                                                       count_include_pad=False),
    "avgpool_ceil_include_pad": lambda: one_op("avgpool2d", {"x": (2, 1, 5, 6)}, window=[3, 3], stride=[2, 2],
                                               padding=1, ceil_mode=True, count_include_pad=True),
    "avgpool_ceil_exclude_pad": lambda: one_op("avgpool2d", {"x": (1, 2, 6, 5)}, window=[2, 3], stride=[2, 2],
                                               padding=[0, 1, 1, 1], ceil_mode=True, count_include_pad=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_geometry_gradients_match_finite_differences(name):
    assert fd_check(CASES[name]()) > 0


def test_conv_kernel_against_a_naive_loop():
    """Dilated, strided, asymmetrically padded conv2d against loops over the ONNX definition."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3, 9, 8)), rng.standard_normal((4, 3, 3, 2))
    (sh, sw), (dh, dw), (t, l, b, r) = (2, 1), (2, 3), (1, 0, 2, 3)
    xp = np.pad(x, [(0, 0), (0, 0), (t, b), (l, r)])
    oh, ow = (xp.shape[2] - dh * 2 - 1) // sh + 1, (xp.shape[3] - dw * 1 - 1) // sw + 1
    ref = np.zeros((2, 4, oh, ow))
    for i, j in np.ndindex(oh, ow):
        for u, v in np.ndindex(3, 2):
            ref[:, :, i, j] += np.einsum("nc,oc->no", xp[:, :, i * sh + u * dh, j * sw + v * dw], w[:, :, u, v])
    k = get_kernel("conv2d")
    params = {"stride": [sh, sw], "dilation": [dh, dw], "padding": [t, l, b, r]}
    sig = k.signature({"x": TensorSpec(x.shape, "float32"), "w": TensorSpec(w.shape, "float32")}, params)
    assert sig.extents == (2, 4, oh, ow)
    b = GraphBuilder()
    b.op("conv2d", "c", {"x": b.input("x", x.shape), "w": b.input("w", w.shape)}, **params)
    g = b.build()
    out = execute(g, {"x": x, "w": w}, precision="float64")[g.ops["c"].output]
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    # row shards (overlapping dilated halos, the last one reading the bottom padding) agree too
    sharded = place(split(place(split(g, "c", 2, 3), "c", [0, 1, 2]), "c", 3, 2), "c", [0, 1, 2, 3, 0, 1])
    assert verify(sharded, values={"x": x.astype(np.float32), "w": w.astype(np.float32)}).ok


def test_sharded_training_step_with_dilated_conv_and_ceil_pool():
    """A dilated conv, a ceil-mode max pool and an asymmetric average pool trained one step: the
    gradient kernels split along rows and channels verify against the unsharded step."""
    b = GraphBuilder()
    x = b.input("x", (2, 2, 9, 9))
    h = b.op("conv2d", "conv", {"x": x, "w": b.parameter("w", (3, 2, 3, 3))}, dilation=2, padding=[2, 1, 2, 1])
    h = b.op("maxpool2d", "pool", {"x": b.op("relu", "act", {"x": h})}, window=[3, 3], stride=[2, 2],
             ceil_mode=True)
    b.op("avgpool2d", "avg", {"x": h}, window=[2, 2], stride=[1, 2], padding=[0, 1, 1, 0], ceil_mode=True,
         count_include_pad=False)
    step = training_step(b.build(), loss="mse", optimizer="sgd")
    grads = {o.kernel: n for n, o in step.ops.items() if o.kernel.endswith("_grad")}
    assert {"conv2d_weight_grad", "maxpool2d_grad", "avgpool2d_grad"} <= set(grads)
    g = step
    for kernel, dim in (("maxpool2d_grad", 2), ("avgpool2d_grad", 3), ("conv2d_weight_grad", 2)):
        op = grads[kernel]
        if g.signature(op).extents[dim] >= 2:
            g = place(split(g, op, dim, 2), op, [0, 1])
    fwd = next(n for n, o in g.ops.items() if o.kernel == "conv2d")
    g = place(split(g, fwd, 2, 2), fwd, [2, 3])
    rep = verify(g)
    assert rep.ok, rep
    rep = verify(random_walk(step, np.random.default_rng(6), 4, 30))
    assert rep.ok, rep


def test_sharded_strided_conv_input_gradient():
    """A ResNet stage entry (3x3 / 2, padding 1, on an odd plane, so dx is cropped) and a 1x1 / 2
    downsample trained one step: their input gradients split along row blocks, column blocks
    and a split output-channel sum, placed on four devices, verify against the unsharded step."""
    b = GraphBuilder()
    x = b.parameter("x", (2, 3, 9, 9))
    h = b.op("conv2d", "entry", {"x": x, "w": b.parameter("w1", (4, 3, 3, 3))}, stride=2, padding=1)
    b.op("conv2d", "down", {"x": b.op("relu", "act", {"x": h}), "w": b.parameter("w2", (4, 4, 1, 1))}, stride=2)
    step = training_step(b.build(), loss="mse", optimizer="sgd")
    grads = [n for n, o in step.ops.items() if o.kernel == "conv2d_input_grad"]
    assert len(grads) == 2 and any(o.kernel == "slice" for o in step.ops.values())  # 5 rows of 2-blocks: cropped
    g = step
    for op in grads:
        sig = g.signature(op)
        assert sig.dims == ("n", "ci", "hb", "wb")
        g = place(split(g, op, 2, 2), op, [0, 1])
        g = place(split(g, op, 3, 2), op, [2, 3, 0, 1])
    rep = verify(g)
    assert rep.ok, rep
    rep = verify(random_walk(step, np.random.default_rng(11), 4, 40))
    assert rep.ok, rep
