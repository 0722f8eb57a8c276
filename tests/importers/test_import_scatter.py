"""``ScatterND`` of a box (slice assignment) imports as ``slice`` and ``concat``.

ONNX models built with ``onnx.helper`` equal ``onnx.reference`` (a box on one axis, on two, index
tuples shorter than the data's rank, a whole overwrite; random sharded plans verify); two scatters
filling a ``new_empty``-like constant become one ``concat`` of their updates and the constant is
pruned; a PyTorch module that fills a tensor by slice assignment (DeepSeek's MLA keys) computes
and trains as ``torch.autograd`` says. Indices that are not a box in row-major order, computed
indices and a reduction are refused naming the reason.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

import onnx_models  # noqa: E402
from torch_checks import check_against_torch, needs_torch, torch  # noqa: E402

N = helper.make_node


def _box_indices(shape, box) -> np.ndarray:
    """Every index tuple of ``box`` (``[(lo, hi)]`` over the leading axes), row-major, as
    ``[..box extents.., q]``: what PyTorch exports for ``data[lo:hi, ...] = updates``."""
    grids = np.meshgrid(*[np.arange(lo, hi) for lo, hi in box], indexing="ij")
    return np.stack(grids, -1).astype(np.int64)


def _scatter_model(shape, box, *, indices=None, reduction=None, name="sc"):
    """``y = tanh(ScatterND(x, indices, 2·u))``; inputs ``x`` of ``shape`` and ``u`` of the box's shape."""
    idx = _box_indices(shape, box) if indices is None else indices
    upd_shape = list(idx.shape[:-1]) + list(shape[idx.shape[-1]:])
    kw = {} if reduction is None else {"reduction": reduction}
    nodes = [N("Mul", ["u", "two"], ["u2"], name="double"),
             N("ScatterND", ["x", "idx", "u2"], ["s"], name=name, **kw), N("Tanh", ["s"], ["y"], name="th")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, list(shape)),
                                       helper.make_tensor_value_info("u", T.FLOAT, upd_shape)],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)],
                          [numpy_helper.from_array(idx, "idx"),
                           numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m, upd_shape


@pytest.mark.parametrize("shape,box", [((2, 3, 6), [(0, 2), (0, 3), (1, 4)]),  # x[..., 1:4] = u
                                       ((4, 3, 5), [(1, 3), (0, 3), (2, 5)]),  # x[1:3, :, 2:] = u
                                       ((4, 3, 5), [(1, 2)]),  # x[1:2] = u (index tuples of length 1)
                                       ((3, 2, 4), [(0, 3), (0, 1)]),  # x[:, :1] = u
                                       ((2, 3), [(0, 2), (0, 3)])],  # the whole of x
                         ids=["last_axis", "two_axes", "leading_rows", "partial_tuples", "whole"])
def test_scatter_of_a_box_equals_the_reference(shape, box):
    m, upd_shape = _scatter_model(shape, box)
    g, _ = onnx_models.check_reference(m, {"x": shape, "u": upd_shape})
    cuts = sum(1 for a, (lo, hi) in enumerate(box) if (lo, hi) != (0, shape[a]))
    assert len([o for o in g.ops.values() if o.kernel == "concat"]) >= cuts


def test_two_scatters_filling_a_constant_are_one_concat():
    """MLA's keys: ``k = x.new_empty(..., 7); k[..., :4] = a; k[..., 4:] = b``: ``concat(a, b)``,
    the empty tensor's garbage pruned (not a parameter of the program)."""
    shape = (2, 3, 7)
    garbage = np.full(shape, np.nan, dtype=np.float32)
    nodes = [N("Tanh", ["a"], ["ta"], name="ta"), N("Sigmoid", ["b"], ["sb"], name="sb"),
             N("ScatterND", ["empty", "i1", "ta"], ["k1"], name="first"),
             N("ScatterND", ["k1", "i2", "sb"], ["y"], name="second")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", T.FLOAT, [2, 3, 4]),
                                       helper.make_tensor_value_info("b", T.FLOAT, [2, 3, 3])],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)],
                          [numpy_helper.from_array(garbage, "empty"),
                           numpy_helper.from_array(_box_indices(shape, [(0, 2), (0, 3), (0, 4)]), "i1"),
                           numpy_helper.from_array(_box_indices(shape, [(0, 2), (0, 3), (4, 7)]), "i2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    graph, vals = onnx_models.check_reference(m, {"a": (2, 3, 4), "b": (2, 3, 3)}, walks=1)
    assert sorted(o.kernel for o in graph.ops.values()) == ["concat", "sigmoid", "tanh"]
    assert not vals and not [t for t in graph.tensors.values() if t.role == "parameter"]


@pytest.mark.parametrize("indices,reduction,says", [
    (_box_indices((2, 6), [(0, 2), (1, 4)])[:, ::-1].copy(), None, "not a box of cells in row-major order"),
    (np.array([[0, 1], [1, 0]], dtype=np.int64), None, "not a box"),  # a gather-like scatter
    (_box_indices((2, 6), [(0, 2), (1, 4)]), "add", "reduction 'add'")], ids=["reversed", "diagonal", "add"])
def test_scatters_that_are_no_slice_assignment_are_refused(indices, reduction, says):
    m, _ = _scatter_model((2, 6), None, indices=indices, reduction=reduction, name="odd_scatter")
    onnx_models.check_refused(m, "ScatterND", says, "odd_scatter")


@needs_torch
def test_torch_slice_assignment_computes_and_trains():
    """DeepSeek's MLA fills its keys by ``copy_`` into slices of ``new_empty``; gradients reach both
    projections as ``torch.autograd`` says."""
    class Keys(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nope, self.rope = torch.nn.Linear(6, 5, bias=False), torch.nn.Linear(6, 3, bias=False)

        def forward(self, x):
            k = x.new_empty(*x.shape[:-1], 8)
            k[..., :5].copy_(self.nope(x))
            k[..., 5:].copy_(torch.tanh(self.rope(x)))
            return k * 1.5

    torch.manual_seed(0)
    g, _ = check_against_torch(Keys(), torch.randn(2, 4, 6), {"concat", "tanh"})
    assert "slice" not in {o.kernel for o in g.ops.values()}
