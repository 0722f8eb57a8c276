"""ONNX semantics the importer got wrong (found by a randomized audit against ``onnx.reference``):
a one-element constant of higher rank raising the output's rank, a negative ``Flatten`` axis, an
empty ``axes`` list (every axis), and one value returned under two output names."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from executor.run import execute  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402

N = helper.make_node


def _model(nodes, outs, inits=(), shape=(2, 3)):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, list(shape))],
                          [helper.make_tensor_value_info(o, T.FLOAT, None) for o in outs], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _check(m, shape=(2, 3)):
    x = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 2.5) / 3
    want = ReferenceEvaluator(m).run(None, {"x": x})
    g, vals = import_onnx(m, {})
    got = execute(g, {"x": x, **vals})
    for vi, w in zip(m.graph.output, want):
        assert got[vi.name].shape == w.shape, vi.name
        np.testing.assert_allclose(got[vi.name], w.astype(np.float32), rtol=1e-5, atol=1e-6)


def _c(name, value):
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


@pytest.mark.parametrize("node,inits", [
    (N("Mul", ["x", "c"], ["y"]), [_c("c", np.full((1, 1, 1), 2.0))]),
    (N("Div", ["x", "c"], ["y"]), [_c("c", np.full((1, 1, 1), 4.0))]),
    (N("Div", ["c", "x"], ["y"]), [_c("c", np.ones((1, 1, 1)))]),
    (N("Pow", ["x", "c"], ["y"]), [_c("c", np.full((1, 1, 1), 2.0))]),
    (N("Greater", ["x", "c"], ["b"]), [_c("c", np.zeros((1, 1, 1)))]),
    (N("Where", ["m", "x", "c"], ["y"]), [_c("c", np.full((1, 1, 1), -7.0))]),
])
def test_a_one_element_constant_of_higher_rank_broadcasts_the_output(node, inits):
    """``x[2, 3] * c[1, 1, 1]`` is ``[1, 2, 3]`` in ONNX; the importer made ``c`` an op parameter
    and kept ``[2, 3]``, so a following ReduceSum over axis 0 summed x's rows."""
    nodes = [node]
    if node.op_type == "Greater":
        nodes.append(N("Cast", ["b"], ["y"], to=T.FLOAT))
    if node.op_type == "Where":
        nodes.insert(0, N("Greater", ["x", "z"], ["m"]))
        inits = inits + [_c("z", np.zeros((1,)))]
    ax = numpy_helper.from_array(np.array([0], np.int64), "ax")
    nodes.append(N("ReduceSum", ["y", "ax"], ["out"], keepdims=0))
    _check(_model(nodes, ["out"], inits + [ax]))


@pytest.mark.parametrize("axis", [-1, -2, -3, 0, 1, 3])
def test_flatten_counts_a_negative_axis_from_the_end(axis):
    _check(_model([N("Flatten", ["x"], ["y"], axis=axis)], ["y"], shape=(2, 3, 4)), shape=(2, 3, 4))


def test_an_empty_axes_list_reduces_every_axis():
    ax = numpy_helper.from_array(np.array([], np.int64), "ax")
    nodes = [N("Relu", ["x"], ["r"]), N("ReduceSum", ["r", "ax"], ["s"], keepdims=1), N("Mul", ["x", "s"], ["y"])]
    _check(_model(nodes, ["y"], [ax]))


def _two_names(outs):
    return import_onnx(_model([N("Relu", ["x"], ["h"]), N("Identity", ["h"], ["y1"]), N("Identity", ["h"], ["y2"]),
                               N("Identity", ["h"], ["y"])], outs))


def _hangs(outs) -> bool:
    p = mp.get_context("spawn").Process(target=_two_names, args=(outs,))
    p.start()
    p.join(60)
    alive = p.is_alive()
    if alive:
        p.kill()
    return alive


@pytest.mark.parametrize("outs", [["y1", "y2"], ["h", "y"], ["y", "h"]])
def test_one_value_returned_under_two_names(outs):
    """Exporters return a tensor twice through Identity: the import hung (an alias of the first
    output to itself), dropped an output, or refused the model."""
    if outs == ["y1", "y2"]:
        assert not _hangs(outs)
    g, _ = _two_names(outs)
    assert sorted(n for n, t in g.tensors.items() if t.role == "output") == sorted(outs)
    _check(_model([N("Relu", ["x"], ["h"]), N("Identity", ["h"], ["y1"]), N("Identity", ["h"], ["y2"]),
                   N("Identity", ["h"], ["y"])], outs))
