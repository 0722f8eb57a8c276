"""Ops real exports use that the first importer refused: Softmax over a non-last axis (opset 13
and the older flattening form), Expand of computed tensors (attention-mask broadcasts), 1-D
convolutions (audio, wav2vec), asymmetric pads, grouped and depthwise convolutions (MobileNet,
ResNeXt). Each imported program equals ``onnx.reference.ReferenceEvaluator`` on random inputs,
and a random sharded plan of it verifies."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from executor.run import execute, random_inputs  # noqa: E402
from ir.importers import ImportFailure  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from onnx_models import check_import, weight as _w  # noqa: E402


def _model(nodes, x_shape, out_shape, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _check(m, params, kernels=(), walk=True):
    return check_import(m, params, kernels, walks=1 if walk else 0)[0]


def test_softmax_over_a_middle_axis():
    m = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=1)],
               ["b", 5, 3], ["b", 5, 3])
    g = _check(m, {"b": 4}, {"softmax", "permute"})
    assert g.tensors["y"].shape == (4, 5, 3)


def test_softmax_opset11_flattens_from_axis():
    """Before opset 13 Softmax(axis=1) normalises over the dims from 1 on taken together (the
    operator spec, onnxruntime; onnx.reference 1.2x applies the opset-13 rule to every opset, so
    the reference here is NumPy on the flattened rows)."""
    m = _model([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [2, 3, 4], [2, 3, 4], opset=11)
    g, _ = import_onnx(m, {})
    x = random_inputs(g, 0)["x"]
    rows = np.exp(x.reshape(2, 12) - x.reshape(2, 12).max(1, keepdims=True))
    ref = (rows / rows.sum(1, keepdims=True)).reshape(2, 3, 4)
    np.testing.assert_allclose(np.asarray(execute(g, {"x": x})["y"]), ref, rtol=1e-5, atol=1e-6)
    assert {"softmax", "reshape"} <= {o.kernel for o in g.ops.values()}


def test_expand_of_a_computed_mask():
    """HF-style mask broadcast: [b, 1, 1, s] -> [b, 1, t, s], then a new leading dim."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["m"]),
             helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(
                 np.array([2, 3, 1, 4, 5], dtype=np.int64), "shape_v")),
             helper.make_node("Expand", ["m", "shape"], ["y"])]
    m = _model(nodes, ["b", 1, 1, 5], [2, "b", 1, 4, 5])
    _check(m, {"b": 3}, {"expand"})


def test_expand_to_the_same_shape_and_of_a_scalar_like_tensor():
    for shape_in, target in (([3, 4], [3, 4]), ([1, 1], [2, 3])):
        nodes = [helper.make_node("Relu", ["x"], ["r"]),
                 helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(
                     np.array(target, dtype=np.int64), "shape_v")),
                 helper.make_node("Expand", ["r", "shape"], ["y"])]
        _check(_model(nodes, shape_in, target), {}, walk=False)


def test_conv1d_with_asymmetric_pads_and_bias():
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 2], kernel_shape=[3])]
    m = _model(nodes, ["n", 4, 10], ["n", 6, 11], [_w("w", (6, 4, 3)), _w("b", (6,), 1)])
    g = _check(m, {"n": 2}, {"conv2d", "reshape"})
    assert {"w", "b"} <= set(g.tensors)  # initializers keep their names
    conv = next(o for o in g.ops.values() if o.kernel == "conv2d")
    assert conv.params["padding"] == [0, 1, 0, 2]  # asymmetric pads are the kernel's, the unit height unpadded


def test_conv2d_asymmetric_pads_and_stride():
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[0, 1, 1, 0], strides=[2, 2])]
    g = _check(_model(nodes, [2, 3, 7, 7], [2, 4, 4, 3], [_w("w", (4, 3, 3, 3))]), {}, {"conv2d"})
    assert [o.kernel for o in g.ops.values()] == ["conv2d"]


@pytest.mark.parametrize("groups,c_in,c_out", [(2, 4, 6), (4, 4, 4)], ids=["grouped", "depthwise"])
def test_grouped_and_depthwise_conv(groups, c_in, c_out):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], group=groups)]
    m = _model(nodes, [2, c_in, 6, 6], [2, c_out, 6, 6], [_w("w", (c_out, c_in // groups, 3, 3)), _w("b", (c_out,))])
    g = _check(m, {}, {"conv2d", "slice", "concat"})
    assert sum(o.kernel == "conv2d" for o in g.ops.values()) == groups


def test_conv_stride_larger_than_its_window():
    """A 3x3 window every 4 rows skips input rows: one ``conv2d`` that never reads them."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], strides=[4, 4], name="sparse")]
    m = _model(nodes, [1, 2, 9, 9], [1, 2, 2, 2], [_w("w", (2, 2, 3, 3))])
    g = _check(m, {}, {"conv2d"})
    assert [o.kernel for o in g.ops.values()] == ["conv2d"]


def test_unknown_op_types_and_refused_attributes_in_one_error():
    """One error names every problem: unknown op types and supported ops whose attributes cannot
    be mapped (each with its node names), not only the first."""
    nodes = [helper.make_node("Hardmax", ["x"], ["a"], name="hm"),
             helper.make_node("Conv", ["x", "w"], ["c"], auto_pad="SAME", name="sparse"),
             helper.make_node("MaxPool", ["x"], ["p", "pi"], kernel_shape=[2, 2], name="dil_pool"),
             helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64, name="to_int"),
             helper.make_node("Add", ["c", "c"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 9, 9])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2])], [_w("w", (2, 2, 3, 3))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ImportFailure) as e:
        import_onnx(m, {})
    msg = str(e.value).split("Supported op types")[0]
    for part in ("Hardmax: hm", "auto_pad='SAME' (NOTSET, SAME_UPPER, SAME_LOWER and VALID only)): sparse",
                 "the indices output (argmax positions; no kernel produces integers)): dil_pool", "): to_int"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize("xs, ws, ys", [([4], [4, 5], [5]), ([3, 4], [4], [3]), ([2, 3, 4], [4], [2, 3]),
                                        ([4], [2, 4, 5], [2, 5])])
def test_matmul_with_a_vector_operand(xs, ws, ys):
    """NumPy's rule: a 1-D operand gains a unit dim that the result drops (``x @ W`` of a single
    feature vector; a projection onto one direction). Refused before as "broadcast batch dims"."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = _model(nodes, xs, ys, [_w("w", ws)])
    g = _check(m, {}, {"einsum"}, walk=len(ys) > 1)
    assert g.tensors["y"].shape == tuple(ys)


def test_matmul_refusals_say_which_shapes_and_why():
    for xs, ws, ys, why in (([4], [4], [], "a dot product of two vectors"),
                            ([2, 3, 4], [3, 4, 5], [2, 3, 5], r"batch dims \[2\] and \[3\] do not broadcast")):
        m = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], xs, ys, [_w("w", ws)])
        with pytest.raises(ImportFailure, match=why):
            import_onnx(m, {})


def _ids_model(view_nodes, ids_shape, out_shape):
    table = _w("E", (10, 4))
    nodes = [*view_nodes, helper.make_node("Gather", ["E", "i"], ["y"], name="lookup")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.INT64, ids_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                          [table, numpy_helper.from_array(np.array([-1], dtype=np.int64), "flat"),
                           numpy_helper.from_array(np.array([1], dtype=np.int64), "ax1")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("view_nodes, out_shape", [
    ([helper.make_node("Reshape", ["x", "flat"], ["i"])], [6, 4]),
    ([helper.make_node("Reshape", ["x", "flat"], ["f"]), helper.make_node("Unsqueeze", ["f", "ax1"], ["i"])],
     [6, 1, 4]),
    ([helper.make_node("Flatten", ["x"], ["i"], axis=0)], [1, 6, 4]),
])
def test_embedding_of_reshaped_ids(view_nodes, out_shape):
    """``emb(ids.view(-1))`` (flattened token ids, as GPT-2's ONNX export of ``input_ids.view(-1,
    seq)``): the lookup of the original ids, reshaped; refused before as "ids must be integers"."""
    m = _ids_model(view_nodes, [2, 3], out_shape)
    g, values = import_onnx(m, {})
    ids = np.random.default_rng(0).integers(0, 10, (2, 3))
    got = execute(g, {"x": ids.astype(np.int32), **values})["y"]
    (ref,) = ReferenceEvaluator(m).run(None, {"x": ids})
    np.testing.assert_array_equal(got, ref)
    assert sorted(o.kernel for o in g.ops.values()) == ["embedding", "reshape"]


def test_embedding_of_transposed_ids_is_a_lookup_of_computed_ids():
    """Ids rearranged by a Transpose (refused before): held as floats, made ids by
    ``float_to_index``, looked up; equal to the reference."""
    m = _ids_model([helper.make_node("Transpose", ["x"], ["i"])], [2, 3], [3, 2, 4])
    g, values = import_onnx(m, {})
    ids = np.random.default_rng(1).integers(0, 10, (2, 3))
    got = execute(g, {"x": ids.astype(np.int32), **values})["y"]
    np.testing.assert_array_equal(got, ReferenceEvaluator(m).run(None, {"x": ids})[0])
    assert {"float_to_index", "embedding", "permute"} <= {o.kernel for o in g.ops.values()}
