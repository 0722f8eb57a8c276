"""MatMul with broadcast batch dims, ConvTranspose, Slice with negative steps and ArgMax/ArgMin import.

ONNX models built with ``onnx.helper`` equal ``onnx.reference`` (grouped ConvTranspose, which the
reference evaluator gets wrong, equals a loop reference written here) across shapes and
attributes, and random sharded plans of them verify; training steps through each differentiable
op have weight gradients equal to central differences, and a sharded training step verifies.
PyTorch modules (``torch.matmul`` with broadcast, ``nn.ConvTranspose2d``/``1d``, ``torch.flip``)
equal the module forward and train like ``torch.autograd``; ``torch.argmax`` imports and a
training step through it is refused. What cannot be mapped is refused naming the node.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import onnx_models  # noqa: E402
from torch_checks import check_against_torch, kernels_of, needs_torch, torch  # noqa: E402
from executor import verify  # noqa: E402
from executor.run import execute  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.autodiff.errors import AutodiffError  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.rewrites import random_walk  # noqa: E402

N = helper.make_node


def _model(nodes, shape, inits=(), opset=17, out_type=T.FLOAT):
    """Input ``x`` (float32, ``shape``), output ``y``."""
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", out_type, None)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _run(g, vals, x):
    return np.asarray(execute(g, {"x": x, **vals})["y"])


def _check(m, shape, kernels=(), ref=None, walks=2, x=None):
    """``onnx_models.check_reference`` on input ``x`` (random of ``shape``, or the array ``x``),
    against ``ref(x)`` where given."""
    return onnx_models.check_reference(m, {"x": shape if x is None else x}, kernels, walks,
                                       None if ref is None else lambda feed: ref(feed["x"]))


_refused = onnx_models.check_refused


# -- MatMul with broadcast batch dims ---------------------------------------------------------------

MATMULS = {
    # id: (x shape, W shape, the einsum's equation, operands squeezed first by a reshape view)
    "weight_under_heads": ((2, 3, 4, 5), (5, 6), "abmk,kn->abmn", 0),
    "fewer_weight_batch_dims": ((2, 3, 4, 5), (3, 5, 6), "abmk,bkn->abmn", 0),
    "fewer_input_batch_dims": ((3, 4, 5), (2, 3, 5, 6), "bmk,abkn->abmn", 0),
    "ones_both_sides": ((2, 1, 4, 5), (1, 3, 5, 6), "amk,bkn->abmn", 2),
    "one_against_batch": ((2, 1, 4, 5), (2, 3, 5, 6), "amk,abkn->abmn", 1),
    "unit_batch_the_weight_lacks": ((1, 3, 4, 5), (3, 5, 2), "abmk,bkn->abmn", 0),
    "vector_weight": ((2, 3, 4, 5), (5,), "abmk,k->abm", 0),
}


@pytest.mark.parametrize("case", list(MATMULS))
def test_matmul_with_broadcast_batch_dims_equals_the_reference(case):
    xs, ws, eq, squeezed = MATMULS[case]
    m = _model([N("MatMul", ["x", "W"], ["y"], name="mm")], xs, [onnx_models.weight("W", ws, seed=1)])
    g, vals = _check(m, xs, {"einsum"})
    (op,) = [o for o in g.ops.values() if o.kernel == "einsum"]
    assert op.params["equation"] == eq
    # the weight keeps its name and shape and is read by every shard, never copied along the batch
    assert vals["W"].shape == ws and "expand" not in kernels_of(g)
    assert kernels_of(g).count("reshape") == squeezed


def test_broadcast_batch_dims_that_do_not_match_are_refused_naming_the_node():
    m = _model([N("MatMul", ["x", "W"], ["y"], name="bad_mm")], (2, 3, 4, 5), [onnx_models.weight("W", (2, 5, 6))])
    _refused(m, "MatMul (MatMul of shapes [2, 3, 4, 5] and [2, 5, 6]: batch dims [2, 3] and [2] do not broadcast)",
             ": bad_mm")
    m = _model([N("MatMul", ["x", "W"], ["y"], name="dot")], (5,), [onnx_models.weight("W", (5,))])
    _refused(m, "a dot product of two vectors (a scalar)", ": dot")


# -- ConvTranspose ------------------------------------------------------------------------------------

def _conv_transpose_ref(x, w, b, strides, pads, dil, out_pad, group=1):
    """Loops over the ONNX ``ConvTranspose`` definition: ``y[o·s - begin + i·d] += x[o]·w[i]`` per
    group, the output ``s·(in - 1) + output_padding + d·(k - 1) + 1 - begin - end`` long."""
    nd = x.ndim - 2
    ci, co_g = w.shape[0], w.shape[1]
    size = [s * (n - 1) + op + d * (k - 1) + 1 - pb - pe for n, s, d, k, op, pb, pe
            in zip(x.shape[2:], strides, dil, w.shape[2:], out_pad, pads[:nd], pads[nd:])]
    y = np.zeros((x.shape[0], co_g * group, *size))
    gi = ci // group
    for n, c, *o in np.ndindex(*x.shape):
        g = c // gi
        for taps in np.ndindex(*w.shape[2:]):
            pos = [oo * s - pb + t * d for oo, s, pb, t, d in zip(o, strides, pads[:nd], taps, dil)]
            if all(0 <= p < e for p, e in zip(pos, size)):
                y[(n, slice(g * co_g, (g + 1) * co_g), *pos)] += x[(n, c, *o)] * w[(c, slice(None), *taps)]
    return y + b.reshape((1, -1) + (1,) * nd)


CONV_TRANSPOSES = {
    # id: (x shape, w shape, attributes)
    "stride2_pad1_output_padding1": ((2, 3, 5, 4), (3, 2, 3, 3),
                                     {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}),
    "stride2_kernel2": ((1, 2, 4, 4), (2, 3, 2, 2), {"strides": [2, 2]}),
    "strides_dilations_asymmetric_pads": ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [3, 2], "pads": [0, 1, 2, 0],
                                                                       "dilations": [2, 1], "output_padding": [2, 1]}),
    "stride1": ((1, 2, 3, 3), (2, 2, 3, 3), {}),
    "pads_wider_than_the_kernel_reach": ((1, 2, 3, 3), (2, 2, 3, 3), {"pads": [2, 2, 2, 2]}),
    "valid": ((1, 2, 3, 3), (2, 2, 2, 3), {"auto_pad": "VALID", "strides": [2, 3]}),
    "one_d": ((2, 4, 5), (4, 3, 3), {"strides": [2], "pads": [1, 0], "output_padding": [1]}),
}


def _ct_model(xs, ws, attrs, group=1, name="ct"):
    co = ws[1] * group
    inits = [onnx_models.weight("W", ws, seed=1), onnx_models.weight("B", (co,), seed=2)]
    return _model([N("ConvTranspose", ["x", "W", "B"], ["y"], name=name, group=group, **attrs)], xs, inits)


@pytest.mark.parametrize("case", list(CONV_TRANSPOSES))
def test_conv_transpose_equals_the_reference(case):
    xs, ws, attrs = CONV_TRANSPOSES[case]
    g, vals = _check(_ct_model(xs, ws, attrs), xs, {"conv2d_input_grad"})
    assert vals["W"].shape == ws  # the ONNX weight [C, M, kH, kW] is the kernel's own w


@pytest.mark.parametrize("group,xs,ws,attrs", [
    (2, (1, 4, 3, 3), (4, 2, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]}),
    (3, (2, 3, 4), (3, 1, 2), {"strides": [2]}),
], ids=["groups2", "depthwise_1d"])
def test_grouped_conv_transpose_equals_a_loop_reference(group, xs, ws, attrs):
    """(``onnx.reference``'s ConvTranspose mixes up the groups' channels, so a loop is the reference.)"""
    m = _ct_model(xs, ws, attrs, group)
    w, b = (numpy_helper.to_array(t) for t in m.graph.initializer)
    nd = len(xs) - 2
    def ref(x):
        return _conv_transpose_ref(x, w, b, attrs.get("strides", [1] * nd), attrs.get("pads", [0] * 2 * nd),
                                   [1] * nd, attrs.get("output_padding", [0] * nd), group)

    g, _ = _check(m, xs, {"conv2d_input_grad", "concat"}, ref=ref)
    assert kernels_of(g).count("conv2d_input_grad") == group


def test_the_loop_reference_equals_onnx_reference_without_groups():
    """The loop reference above is the spec's formula: it agrees with ``onnx.reference`` where that is right."""
    for xs, ws, attrs in CONV_TRANSPOSES.values():
        if "auto_pad" in attrs:
            continue
        m = _ct_model(xs, ws, attrs)
        w, b = (numpy_helper.to_array(t) for t in m.graph.initializer)
        nd = len(xs) - 2
        x = np.random.default_rng(0).standard_normal(xs).astype(np.float32)
        want = ReferenceEvaluator(m).run(None, {"x": x})[0]
        got = _conv_transpose_ref(x, w, b, attrs.get("strides", [1] * nd), attrs.get("pads", [0] * 2 * nd),
                                  attrs.get("dilations", [1] * nd), attrs.get("output_padding", [0] * nd))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_unsupported_conv_transposes_are_refused_naming_the_node():
    xs, ws = (1, 2, 3, 3), (2, 2, 3, 3)
    _refused(_ct_model(xs, ws, {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, name="same"),
             "ConvTranspose auto_pad='SAME_UPPER' (NOTSET and VALID only; give pads)", ": same")
    _refused(_ct_model(xs, ws, {"output_shape": [6, 6], "strides": [2, 2]}, name="by_shape"),
             "ConvTranspose output_shape (give pads and output_padding instead)", ": by_shape")
    _refused(_ct_model(xs, ws, {"strides": [2, 2], "output_padding": [2, 0], "dilations": [3, 1]}, name="op_big"),
             "output_padding [2, 0] with strides [2, 2] (each must lie in [0, stride))", ": op_big")
    _refused(_ct_model((1, 2, 3, 3, 3), (2, 2, 2, 2, 2), {}, name="ct3d"),
             "only 1-D and 2-D transposed convolutions (NCL, NCHW); input has rank 5", ": ct3d")


# -- Slice with negative steps ------------------------------------------------------------------------

INT64_MIN = -(2 ** 63)
SLICES = {
    # id: (starts, ends, axes, steps, shape)
    "flip": ([-1], [INT64_MIN], [1], [-1], (3, 5, 4)),
    "flip_two_axes": ([-1, -1], [INT64_MIN, INT64_MIN], [0, 2], [-1, -1], (3, 5, 4)),
    "step_minus2_clamped_start": ([9], [0], [1], [-2], (3, 5, 4)),
    "step_minus3_to_the_start": ([-2], [-100], [-1], [-3], (2, 3, 8)),
    "reversed_middle": ([3], [0], [1], [-1], (2, 5, 3)),
    "mixed_with_positive_step": ([1, 6], [4, 1], [0, 2], [2, -2], (5, 2, 7)),
}


def _slice_model(starts, ends, axes, steps, shape, name="sl"):
    inits = [_ints("s", starts), _ints("e", ends), _ints("a", axes), _ints("p", steps)]
    return _model([N("Slice", ["x", "s", "e", "a", "p"], ["y"], name=name)], shape, inits)


@pytest.mark.parametrize("case", list(SLICES))
def test_slices_with_negative_steps_equal_the_reference(case):
    *spec, shape = SLICES[case]
    g, _ = _check(_slice_model(*spec, shape), shape, {"slice"})
    assert any(o.params["step"] < 0 for o in g.ops.values() if o.kernel == "slice")


def test_an_empty_reversed_slice_and_a_zero_step_are_refused_naming_the_node():
    _refused(_slice_model([1], [3], [1], [-1], (2, 5), name="empty"), "Slice (an empty slice): empty")
    _refused(_slice_model([1], [3], [1], [0], (2, 5), name="zero"), "Slice (a slice step of 0): zero")


# -- ArgMax and ArgMin ------------------------------------------------------------------------------------

ARGS = {
    # id: (op, attributes, shape)
    "argmax_default": ("ArgMax", {}, (4, 3, 5)),
    "argmax_last_axis_no_keepdims": ("ArgMax", {"axis": -1, "keepdims": 0}, (2, 3, 6)),
    "argmin_axis1": ("ArgMin", {"axis": 1}, (3, 4, 2, 3)),
    "argmax_select_last_index": ("ArgMax", {"axis": 1, "select_last_index": 1}, (3, 6, 4)),
    "argmin_select_last_index": ("ArgMin", {"axis": 2, "keepdims": 0, "select_last_index": 1}, (2, 3, 7)),
}


@pytest.mark.parametrize("case", list(ARGS))
def test_argmax_and_argmin_equal_the_reference(case):
    """On small integers (ties on purpose: ``select_last_index`` decides) the indices are equal."""
    op, attrs, shape = ARGS[case]
    m = _model([N(op, ["x"], ["y"], name="arg", **attrs)], shape, opset=13, out_type=T.INT64)
    x = np.random.default_rng(0).integers(-2, 3, shape).astype(np.float32)
    g, _ = _check(m, shape, {op.lower()}, x=x)
    assert g.tensors["y"].dtype == "int32"
    first = {**attrs, "select_last_index": 0}
    m0 = _model([N(op, ["x"], ["y"], name="arg", **first)], shape, opset=13, out_type=T.INT64)
    if attrs.get("select_last_index"):  # the ties make the attribute matter
        assert not np.array_equal(ReferenceEvaluator(m).run(None, {"x": x})[0],
                                  ReferenceEvaluator(m0).run(None, {"x": x})[0])


def test_a_training_step_through_argmax_is_refused_naming_the_op():
    w = onnx_models.weight("W", (6, 6), seed=1)
    through = _model([N("MatMul", ["x", "W"], ["h"], name="mm"), N("ArgMax", ["h"], ["i"], name="am", axis=2),
                      N("Cast", ["i"], ["f"], name="cast", to=T.FLOAT), N("Mul", ["f", "h"], ["y"], name="mul")],
                     (2, 3, 6), [w])
    g, _ = import_onnx(through, {})
    with pytest.raises(AutodiffError, match=r"op 'am': kernel 'argmax' has no gradient .*\(via op 'cast'\)"):
        training_step(g, loss="mse")
    out = _model([N("MatMul", ["x", "W"], ["h"], name="mm"), N("ArgMin", ["h"], ["y"], name="amin", axis=1)],
                 (2, 3, 6), [w], out_type=T.INT64)
    g, _ = import_onnx(out, {})
    with pytest.raises(AutodiffError, match="op 'amin': kernel 'argmin' has no gradient; output 'y' holds integer"):
        training_step(g, loss="mse")


def test_an_argmax_beside_the_trained_output_does_not_stop_training():
    """The indices are a second output the loss does not read: the step trains the float one."""
    w = onnx_models.weight("W", (6, 6), seed=1)
    g = helper.make_graph([N("MatMul", ["x", "W"], ["y"], name="mm"), N("ArgMax", ["y"], ["i"], name="am", axis=2)],
                          "g", [helper.make_tensor_value_info("x", T.FLOAT, [2, 3, 6])],
                          [helper.make_tensor_value_info("y", T.FLOAT, None),
                           helper.make_tensor_value_info("i", T.INT64, None)], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    prog, vals = import_onnx(m, {})
    step = training_step(prog, loss="mse", output="y")
    assert "W.grad" in step.tensors


# -- gradients ----------------------------------------------------------------------------------------

def _after_weight(nodes, shape, inits=()):
    """``h = x · W`` over the channels (an einsum on a [C, C] weight), then ``nodes`` (ending in ``y``)."""
    w = onnx_models.weight("W", (shape[1], shape[1]), seed=5)
    eq = "nc" + "hw"[: len(shape) - 2] + ",cd->nd" + "hw"[: len(shape) - 2]
    return _model([N("Einsum", ["x", "W"], ["h"], name="mix", equation=eq), *nodes], shape, [w, *inits])


GRADS = {
    "matmul_ones_both_sides": ([N("Unsqueeze", ["h", "ax"], ["h4"], name="u"),
                                N("MatMul", ["h4", "V"], ["y"], name="mm")], (2, 3, 4),
                               [_ints("ax", [1]), onnx_models.weight("V", (1, 2, 4, 3), seed=2)], ("W", "V")),
    "matmul_weight_fewer_dims": ([N("MatMul", ["h", "V"], ["y"], name="mm")], (2, 3, 2, 4),
                                 [onnx_models.weight("V", (3, 4, 2), seed=2)], ("W", "V")),
    "conv_transpose": ([N("ConvTranspose", ["h", "K", "B"], ["y"], name="ct", strides=[2, 2], pads=[1, 0, 0, 1],
                          output_padding=[1, 1])], (1, 2, 3, 3),
                       [onnx_models.weight("K", (2, 2, 3, 2), seed=2), onnx_models.weight("B", (2,), seed=3)],
                       ("W", "K", "B")),
    "conv_transpose_dilated_groups": ([N("ConvTranspose", ["h", "K"], ["y"], name="ct", strides=[1, 3], group=2,
                                         dilations=[2, 1], pads=[1, 1, 0, 2])], (1, 4, 3, 2),
                                      [onnx_models.weight("K", (4, 1, 2, 3), seed=2)], ("W", "K")),
    "conv_transpose_1d": ([N("ConvTranspose", ["h", "K"], ["y"], name="ct", strides=[3], pads=[1, 1])], (2, 2, 3),
                          [onnx_models.weight("K", (2, 3, 4), seed=2)], ("W", "K")),
    "flip": ([N("Slice", ["h", "s", "e", "a", "p"], ["y"], name="flip")], (2, 3, 4),
             [_ints("s", [-1]), _ints("e", [INT64_MIN]), _ints("a", [2]), _ints("p", [-1])], ("W",)),
    "slice_step_minus2": ([N("Slice", ["h", "s", "e", "a", "p"], ["y"], name="sl")], (2, 3, 6),
                          [_ints("s", [4]), _ints("e", [0]), _ints("a", [2]), _ints("p", [-2])], ("W",)),
}


@pytest.mark.parametrize("case", list(GRADS))
def test_training_through_each_op_equals_central_differences(case):
    nodes, shape, inits, wrt = GRADS[case]
    g, vals = import_onnx(_after_weight(nodes, shape, inits), {})
    onnx_models.check_central_differences(g, vals, shape, wrt)


def test_a_sharded_training_step_through_broadcast_matmul_conv_transpose_and_flip_verifies():
    nodes = [N("ConvTranspose", ["h", "K", "B"], ["c"], name="ct", strides=[2, 2], pads=[1, 1, 1, 1],
               output_padding=[1, 1]),
             N("Slice", ["c", "s", "e", "a", "p"], ["f"], name="flip"),
             N("MatMul", ["f", "V"], ["y"], name="mm")]
    inits = [onnx_models.weight("K", (3, 2, 3, 3), 1), onnx_models.weight("B", (2,), 2),
             _ints("s", [-1]), _ints("e", [INT64_MIN]), _ints("a", [2]), _ints("p", [-1]),
             onnx_models.weight("V", (1, 6, 5), 3)]
    g, vals = import_onnx(_after_weight(nodes, (2, 3, 3, 3), inits), {})
    step = training_step(g, loss="mse", optimizer="sgd")
    assert {"conv2d_input_grad", "conv2d", "conv2d_weight_grad", "slice", "einsum"} <= set(kernels_of(step))
    rng = np.random.default_rng(0)
    for _ in range(3):
        rep = verify(random_walk(step, rng, 4, 30), values=vals)
        assert rep.ok, rep


# -- PyTorch modules ------------------------------------------------------------------------------------

def _sandwich(op, c_in=3, c=4, c_out=None):
    """``conv1x1 -> op -> conv1x1`` (2-D, or 1-D when ``op`` is 1-D): trained weights on both sides."""
    one_d = isinstance(op, torch.nn.ConvTranspose1d)
    conv = torch.nn.Conv1d if one_d else torch.nn.Conv2d

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.op, self.b = conv(c_in, c, 1), op, conv(c_out or c, 2, 1)

        def forward(self, x):
            return self.b(self.op(self.a(x)))

    return Net()


class _Fn(torch.nn.Module if torch is not None else object):
    def __init__(self, fn, **params) -> None:
        super().__init__()
        self.fn = fn
        for k, shape in params.items():
            setattr(self, k, torch.nn.Parameter(torch.randn(*shape) * 0.5))

    def forward(self, x):
        return self.fn(self, x)


TORCH_MODULES = {
    # name: (module factory, input shape, kernel)
    "conv_transpose2d": (lambda: _sandwich(torch.nn.ConvTranspose2d(4, 5, 3, stride=2, padding=1, output_padding=1),
                                           c_out=5), (2, 3, 4, 5), "conv2d_input_grad"),
    "conv_transpose2d_groups_dilation": (lambda: _sandwich(torch.nn.ConvTranspose2d(4, 6, (2, 3), stride=(1, 2),
                                                                                    padding=(0, 1), dilation=(2, 1),
                                                                                    groups=2), c_out=6),
                                         (1, 3, 3, 4), "conv2d_input_grad"),
    "conv_transpose1d": (lambda: _sandwich(torch.nn.ConvTranspose1d(4, 3, 4, stride=2, padding=1), c_out=3),
                         (2, 3, 6), "conv2d_input_grad"),
    "flip": (lambda: _sandwich(_Fn(lambda m, x: torch.flip(x, dims=[2, 3]))), (2, 3, 4, 5), "slice"),
    "matmul_broadcast": (lambda: _Fn(lambda m, x: torch.matmul(x.unsqueeze(1), m.w), w=(1, 3, 6, 4)), (2, 5, 6),
                         "einsum"),
    "matmul_weight_under_batch": (lambda: _Fn(lambda m, x: torch.matmul(torch.tanh(x), m.w), w=(6, 4)), (2, 3, 5, 6),
                                  "einsum"),
}


@needs_torch
@pytest.mark.parametrize("name", list(TORCH_MODULES))
def test_torch_modules_import_and_train_like_torch(name):
    make, shape, kernel = TORCH_MODULES[name]
    torch.manual_seed(0)
    check_against_torch(make(), torch.randn(*shape), {kernel})


@needs_torch
def test_torch_argmax_imports_and_a_training_step_through_it_is_refused():
    from ir.importers.torch_export import import_torch

    torch.manual_seed(0)
    m = _Fn(lambda m, x: torch.argmax(x @ m.w, dim=-1), w=(6, 4))
    x = torch.randn(3, 5, 6)
    g, vals = import_torch(m, {"x": x})
    assert "argmax" in kernels_of(g)
    with torch.no_grad():
        np.testing.assert_array_equal(execute(g, {**vals, "x": x.numpy()})["output"], m(x).numpy())
    with pytest.raises(AutodiffError, match="kernel 'argmax' has no gradient"):
        training_step(g, loss="mse")
