"""Conv with dilations, strides and pads that differ per axis (DeepLab's atrous convolutions,
ResNet's 1x1 stride-2 downsample, 1-D audio convs), and pooling with per-side pads and
``ceil_mode``: each import equals ``onnx.reference.ReferenceEvaluator`` on random inputs, and a
random sharded plan of it verifies (halos of dilated and strided windows included)."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from executor import verify  # noqa: E402
from executor.run import execute  # noqa: E402
from ir.importers import ImportFailure  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from onnx_models import check_import, weight as _w  # noqa: E402
from ir.rewrites import place, split  # noqa: E402


def _model(node, x_shape, inits=()):
    """One node on input ``x``; the output shape is left to ONNX shape inference."""
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    onnx.checker.check_model(m)
    return m


def _check(m, kernels):
    return check_import(m, {}, kernels, exact=True, walks=2, walk_seed=3)


CONVS = {
    # atrous 3x3, dilation 2, "same" padding
    "dilated": (dict(dilations=[2, 2], pads=[2, 2, 2, 2]), [2, 3, 9, 9], (4, 3, 3, 3), {"conv2d"}),
    # dilation and stride differ per axis, asymmetric pads
    "per_axis": (dict(dilations=[2, 1], strides=[2, 1], pads=[1, 2, 0, 1]), [1, 2, 10, 7], (3, 2, 3, 2),
                 {"conv2d"}),
    "unequal_strides": (dict(strides=[1, 3], pads=[0, 1, 1, 1]), [2, 2, 6, 11], (2, 2, 2, 3), {"conv2d"}),
    # ResNet downsample: 1x1 conv, stride 2 (past its one-cell window: rows between windows unread)
    "downsample_1x1": (dict(strides=[2, 2]), [2, 4, 7, 8], (6, 4, 1, 1), {"conv2d"}),
    "padded_1x1_stride2": (dict(strides=[2, 1], pads=[1, 0, 1, 0]), [1, 2, 5, 4], (3, 2, 1, 1), {"conv2d"}),
    "stride_past_window": (dict(strides=[4, 3], pads=[1, 0, 0, 1]), [1, 2, 9, 10], (2, 2, 3, 2), {"conv2d"}),
    # auto_pad: SAME keeps ceil(in / stride), the odd padding cell at the end (UPPER) or start (LOWER)
    "same_upper_strided": (dict(auto_pad="SAME_UPPER", strides=[2, 2]), [1, 2, 7, 8], (3, 2, 4, 3), {"conv2d"}),
    "same_lower_strided": (dict(auto_pad="SAME_LOWER", strides=[2, 3]), [2, 2, 7, 8], (3, 2, 4, 3), {"conv2d"}),
    "same_upper_stride1": (dict(auto_pad="SAME_UPPER"), [1, 3, 6, 5], (2, 3, 2, 3), {"conv2d"}),
    "valid": (dict(auto_pad="VALID", strides=[2, 1]), [1, 2, 8, 6], (3, 2, 3, 2), {"conv2d"}),
    "grouped_dilated": (dict(dilations=[2, 2], pads=[2, 2, 2, 2], group=2), [1, 4, 7, 7], (4, 2, 3, 3),
                        {"slice", "conv2d", "concat"}),
}


@pytest.mark.parametrize("name", list(CONVS))
def test_conv_geometry_equals_onnx_reference(name):
    attrs, x_shape, w_shape, kernels = CONVS[name]
    m = _model(helper.make_node("Conv", ["x", "w"], ["y"], name=name, **attrs), x_shape, [_w("w", w_shape)])
    g, _ = _check(m, kernels)
    conv = next(o for o in g.ops.values() if o.kernel == "conv2d")
    if "dilations" in attrs:
        assert conv.params["dilation"] in (2, [2, 1])


def test_conv1d_strided_dilated_with_bias():
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=[2], dilations=[3], pads=[2, 1], name="c1d")
    m = _model(node, [2, 3, 17], [_w("w", (5, 3, 3)), _w("b", (5,), 1)])
    _check(m, {"reshape", "conv2d", "add"})


POOLS = {
    # ResNet-style 3x3/2 max pool in ceil mode: the last window overhangs the input
    "max_ceil": ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), [2, 2, 8, 8]),
    "max_ceil_pads": ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
                      [1, 2, 6, 9]),
    "max_asym_pads": ("MaxPool", dict(kernel_shape=[3, 2], strides=[1, 2], pads=[1, 0, 0, 1]), [1, 3, 5, 6]),
    "avg_ceil_exclude_pad": ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
                             [1, 2, 6, 6]),
    "avg_ceil_include_pad": ("AveragePool", dict(kernel_shape=[2, 3], strides=[2, 2], pads=[0, 1, 0, 1], ceil_mode=1,
                                                 count_include_pad=1), [2, 1, 5, 8]),
    "avg_ceil_nopad": ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1), [1, 2, 5, 7]),
    "max_dilated": ("MaxPool", dict(kernel_shape=[3, 2], strides=[1, 2], dilations=[2, 3], pads=[2, 1, 1, 2]),
                    [1, 2, 8, 9]),
    "avg_dilated_exclude_pad": ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2], dilations=[2, 2],
                                                    pads=[1, 1, 1, 1]), [2, 1, 7, 8]),
    "avg_dilated_include_pad": ("AveragePool", dict(kernel_shape=[2, 3], strides=[1, 1], dilations=[3, 2],
                                                    pads=[1, 2, 2, 1], count_include_pad=1), [1, 2, 6, 7]),
    "max_same_upper": ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"), [1, 2, 8, 7]),
    "max_same_lower": ("MaxPool", dict(kernel_shape=[2, 3], auto_pad="SAME_LOWER"), [2, 1, 7, 6]),
    "avg_same_upper": ("AveragePool", dict(kernel_shape=[3, 2], strides=[1, 2], auto_pad="SAME_UPPER"), [1, 2, 5, 7]),
    "avg_valid": ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="VALID"), [1, 2, 8, 7]),
    "avg_asym_include_pad": ("AveragePool", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[0, 1, 1, 0],
                                                 count_include_pad=1), [1, 2, 4, 5]),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_pool_geometry_equals_onnx_reference(name):
    op, attrs, x_shape = POOLS[name]
    m = _model(helper.make_node(op, ["x"], ["y"], name=name, **attrs), x_shape)
    g, values = _check(m, {"maxpool2d" if op == "MaxPool" else "avgpool2d"})
    # split the output rows in two: the second shard's windows are the ones that overhang
    pool = next(iter(g.ops))
    if g.signature(pool).extents[2] >= 2:
        plan = place(split(g, pool, 2, 2), pool, [0, 1])
        assert verify(plan, values=values).ok


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_same_lower_strided_pool_follows_the_spec(op):
    """SAME_LOWER with a stride: ``ceil(7 / 2) = 4`` rows (ONNX's spec and shape inference; the
    reference's strided MaxPool takes ``floor`` and pads as SAME_UPPER), the odd padding cell at
    the start: equal to the reference on the explicit pads ``[1, 1, 0, 1]``."""
    attrs = dict(kernel_shape=[2, 3], strides=[2, 1])
    m = _model(helper.make_node(op, ["x"], ["y"], auto_pad="SAME_LOWER", **attrs), [2, 1, 7, 6])
    explicit = _model(helper.make_node(op, ["x"], ["y"], pads=[1, 1, 0, 1], **attrs), [2, 1, 7, 6])
    inferred = [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim]
    g, _ = import_onnx(m, {})
    assert list(g.tensors["y"].shape) == inferred == [2, 1, 4, 6]
    x = np.random.default_rng(0).standard_normal((2, 1, 7, 6)).astype(np.float32)
    (ref,) = ReferenceEvaluator(explicit).run(None, {"x": x})
    np.testing.assert_allclose(execute(g, {"x": x})["y"], ref, rtol=1e-6, atol=1e-6)


def test_dilated_same_conv_equals_pytorch():
    """SAME with a dilation pads the dilated extent (onnxruntime, PyTorch's ``padding="same"``;
    ``onnx.reference`` pads the undilated kernel): equal to ``torch.nn.functional.conv2d``."""
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(1).standard_normal((3, 2, 3, 2)).astype(np.float32)
    m = _model(helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", dilations=[2, 3]), [1, 2, 7, 8],
               [numpy_helper.from_array(w, "w")])
    g, values = import_onnx(m, {})
    x = np.random.default_rng(2).standard_normal((1, 2, 7, 8)).astype(np.float32)
    ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding="same", dilation=(2, 3))
    np.testing.assert_allclose(execute(g, {"x": x, **values})["y"], ref.numpy(), rtol=1e-5, atol=1e-5)


def test_auto_pad_refusals_name_the_node():
    nodes = [helper.make_node("MaxPool", ["x"], ["a"], kernel_shape=[2, 2], auto_pad="SAME_UPPER", ceil_mode=1,
                              name="ceil_same"),
             helper.make_node("MaxPool", ["x"], ["b", "idx"], kernel_shape=[2, 2], name="with_indices"),
             helper.make_node("Add", ["a", "b"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    with pytest.raises(ImportFailure) as e:
        import_onnx(m, {})
    msg = str(e.value)
    assert "MaxPool (ceil_mode with auto_pad=SAME_UPPER (ONNX's reference refuses the pair)): ceil_same" in msg
    assert "MaxPool (the indices output (argmax positions; no kernel produces integers)): with_indices" in msg


def test_ceil_mode_changes_the_shape():
    """The same pool with and without ceil_mode: 3 rows vs 4 (ONNX's output-shape formula)."""
    shapes = []
    for ceil in (0, 1):
        m = _model(helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=ceil),
                   [1, 1, 8, 8])
        g, _ = import_onnx(m, {})
        shapes.append(g.tensors["y"].shape)
    assert shapes == [(1, 1, 3, 3), (1, 1, 4, 4)]


def test_ceil_mode_pools_equal_pytorch():
    """Strides of 3, where a ceil-mode window can overhang by two cells: PyTorch's definition (the
    overhang neither maxed nor counted; ``onnx.reference`` shifts such windows, onnxruntime does
    not), with shapes whose ceil and floor outputs differ."""
    torch = pytest.importorskip("torch")
    from ir.importers.torch_export import import_torch  # noqa: PLC0415

    mods = [torch.nn.MaxPool2d(3, stride=3, ceil_mode=True),
            torch.nn.MaxPool2d((3, 2), stride=(3, 2), padding=(1, 1), ceil_mode=True),
            torch.nn.AvgPool2d(3, stride=3, padding=1, ceil_mode=True, count_include_pad=True),
            torch.nn.AvgPool2d(3, stride=3, padding=1, ceil_mode=True, count_include_pad=False)]
    torch.manual_seed(0)
    for mod in mods:
        x = torch.randn(2, 3, 9, 8)
        g, values = import_torch(mod, {"x": x})
        ref = mod(x).numpy()
        floor = type(mod)(**{**{k: getattr(mod, k) for k in ("kernel_size", "stride", "padding")},
                             "ceil_mode": False})(x)
        assert ref.shape != tuple(floor.shape)  # ceil mode matters here
        np.testing.assert_allclose(execute(g, {"x": x.numpy(), **values})["output"], ref, rtol=1e-6, atol=1e-6)
