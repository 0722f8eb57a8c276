"""GroupNormalization, InstanceNormalization, Pad, Tile, CumSum and nearest Resize/Upsample import.

ONNX models built with ``onnx.helper`` equal ``onnx.reference`` (several shapes and attributes;
random sharded plans verify); negative pads (crops) equal NumPy slicing (the reference's
``np.pad`` refuses them); training steps through each op have weight gradients equal to central
differences, and a sharded plan of a training step verifies. PyTorch modules (``nn.GroupNorm``,
``nn.InstanceNorm2d``, the padding modules and ``F.pad``, ``nn.Upsample``/``F.interpolate``,
``torch.cumsum``, ``Tensor.repeat``) equal the module forward and train like ``torch.autograd``.
What cannot be mapped is refused naming the node and the reason.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

import onnx_models  # noqa: E402
from torch_checks import check_against_torch, kernels_of, needs_torch, torch  # noqa: E402
from executor import verify  # noqa: E402
from executor.run import execute  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.importers.onnx_pad_tile import nearest_source  # noqa: E402
from ir.rewrites import random_walk  # noqa: E402

N = helper.make_node


def _model(nodes, shape, inits=(), opset=17, extra_inputs=()):
    """Input ``x`` (float32, ``shape``), output ``y``."""
    ins = [helper.make_tensor_value_info("x", T.FLOAT, list(shape)), *extra_inputs]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", T.FLOAT, None)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10 if opset >= 21 else 8
    return m


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _floats(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.float32), name)


def _check(m, shape, kernels=(), walks=2):
    """``onnx_models.check_reference`` on a random input ``x`` of ``shape``."""
    return onnx_models.check_reference(m, {"x": shape}, kernels, walks)


def _ops(g, kernel):
    return [o for o in g.ops.values() if o.kernel == kernel]


# -- GroupNormalization and InstanceNormalization ---------------------------------------------------

@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("shape,groups", [((2, 6, 3, 3), 2), ((2, 6, 3, 3), 1), ((2, 6, 3, 3), 6), ((3, 4, 5), 2)],
                         ids=["groups2", "groups1", "groups_eq_channels", "rank3"])
def test_group_normalization_equals_the_reference(opset, shape, groups):
    """Opset 18's scale and bias are per group, opset 21's per channel: both keep their shapes."""
    width = groups if opset == 18 else shape[1]
    inits = [onnx_models.weight("s", (width,), seed=1), onnx_models.weight("b", (width,), seed=2)]
    m = _model([N("GroupNormalization", ["x", "s", "b"], ["y"], name="gn", num_groups=groups, epsilon=1e-3)],
               shape, inits, opset=opset)
    g, vals = _check(m, shape, {"group_norm"})
    (op,) = _ops(g, "group_norm")
    assert op.params == {"groups": groups, "eps": pytest.approx(1e-3), "affine": "group" if opset == 18 else "channel"}
    assert vals["s"].shape == (width,)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 4, 7), (1, 2, 2, 2, 3)])
def test_instance_normalization_equals_the_reference(shape):
    inits = [onnx_models.weight("s", (shape[1],), seed=1), onnx_models.weight("b", (shape[1],), seed=2)]
    m = _model([N("InstanceNormalization", ["x", "s", "b"], ["y"], name="inorm")], shape, inits)
    g, _ = _check(m, shape, {"group_norm"})
    assert _ops(g, "group_norm")[0].params["groups"] == shape[1]


# -- Pad ---------------------------------------------------------------------------------------------

PADS = {
    # id: (mode, pads, value, axes, shape)
    "constant_two_axes": ("constant", [0, 0, 1, 2, 0, 0, 3, 1], 0.0, None, (2, 3, 4, 5)),
    "constant_value": ("constant", [1, 0, 0, 2], -0.75, None, (3, 4)),
    "constant_every_axis": ("constant", [1, 1, 1, 1, 2, 2], 0.5, None, (2, 3, 4)),
    "edge": ("edge", [0, 0, 2, 1, 0, 0, 1, 3], None, None, (2, 3, 4, 5)),
    "reflect": ("reflect", [0, 0, 1, 3, 0, 0, 2, 1], None, None, (2, 3, 4, 5)),
    "reflect_one_axis": ("reflect", [0, 2, 0, 1], None, None, (3, 4)),
    "axes_input": ("constant", [2, 1, 0, 3], 1.0, [-1, 1], (2, 3, 4)),
    "axes_edge": ("edge", [1, 2], None, [2], (2, 3, 4)),
    "wrap": ("wrap", [0, 0, 2, 3, 0, 0, 1, 4], None, None, (1, 2, 3, 4)),
}


def _pad_model(mode, pads, value, axes, shape, opset):
    inits = [_ints("pads", pads)]
    ins = ["x", "pads"]
    if value is not None:
        inits.append(_floats("value", value))
        ins.append("value")
    if axes is not None:
        inits.append(_ints("axes", axes))
        ins += [""] * (3 - len(ins)) + ["axes"]
    return _model([N("Pad", ins, ["y"], name="my_pad", mode=mode)], shape, inits, opset=opset)


@pytest.mark.parametrize("case", list(PADS))
def test_pad_equals_the_reference(case):
    mode, pads, value, axes, shape = PADS[case]
    opset = 19 if mode == "wrap" else 18
    g, _ = _check(_pad_model(mode, pads, value, axes, shape, opset), shape,
                  {"pad" if mode == "constant" else "pad_copy"})
    n_axes = len(pads) // 2
    assert len(g.ops) == sum(1 for k in range(n_axes) if pads[k] or pads[n_axes + k])  # one op per padded axis


def test_pad_with_attributes_before_opset_11_equals_the_reference():
    m = _model([N("Pad", ["x"], ["y"], name="p2", mode="constant", pads=[0, 1, 2, 0], value=2.5)], (3, 4), opset=9)
    g, _ = _check(m, (3, 4), {"pad"})
    assert {o.params["value"] for o in g.ops.values()} == {2.5}


def test_pad_of_nothing_is_its_input():
    m = _model([N("Pad", ["x", "pads"], ["p"], name="p0"), N("Relu", ["p"], ["y"], name="r")], (3, 4),
               [_ints("pads", [0, 0, 0, 0])])
    g, _ = _check(m, (3, 4), walks=0)
    assert kernels_of(g) == ["relu"]


@pytest.mark.parametrize("pads,value", [([0, -1, 1, 2, 1, -2], 0.0), ([-1, 2, 0, -1], 3.0)], ids=["mixed", "crop_fill"])
def test_negative_pads_crop(pads, value):
    """The reference's ``np.pad`` refuses negative widths; ONNX crops: compare with slicing."""
    shape = (3, 5, 4)[: len(pads) // 2]
    m = _pad_model("constant", pads, value, None, shape, 18)
    g, vals = import_onnx(m, {})
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    r = len(shape)
    want = x
    for a in range(r):
        b, e = pads[a], pads[r + a]
        n = want.shape[a]
        want = np.take(want, np.arange(max(0, -b), n - max(0, -e)), axis=a)
        want = np.pad(want, [(max(0, b), max(0, e)) if k == a else (0, 0) for k in range(r)], constant_values=value)
    got = np.asarray(execute(g, {"x": x})["y"])
    np.testing.assert_array_equal(got, want)
    rng = np.random.default_rng(2)
    for _ in range(2):
        assert verify(random_walk(g, rng, 4, 20), values=vals).ok


# -- Tile, CumSum ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,reps", [((2, 3), [2, 3]), ((2, 3, 4), [1, 2, 1]), ((2, 3, 4), [3, 1, 2]),
                                        ((3, 4), [1, 1])])
def test_tile_equals_the_reference(shape, reps):
    m = _model([N("Tile", ["x", "reps"], ["t"], name="tile"), N("Tanh", ["t"], ["y"], name="th")], shape,
               [_ints("reps", reps)])
    g, _ = _check(m, shape, {"tanh"})
    assert len(_ops(g, "expand")) == sum(r > 1 for r in reps)


@pytest.mark.parametrize("axis", [1, -1, 0])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_equals_the_reference(axis, exclusive, reverse):
    m = _model([N("CumSum", ["x", "axis"], ["y"], name="cs", exclusive=exclusive, reverse=reverse)], (3, 4, 5),
               [_ints("axis", axis)])
    g, _ = _check(m, (3, 4, 5), {"cumsum"})
    (op,) = g.ops.values()
    assert op.params == {"axis": axis % 3, "exclusive": bool(exclusive), "reverse": bool(reverse)}


# -- Resize and Upsample ----------------------------------------------------------------------------

RESIZES = {
    # id: (attributes, scales or None, sizes or None, shape, opset)
    "torch_upsample": ({"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
                       [1, 1, 2, 2], None, (2, 3, 4, 5), 17),
    "scales_2_3": ({"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
                   [1, 1, 2, 3], None, (1, 2, 3, 4), 17),
    "half_pixel_default": ({}, [1, 1, 3, 2], None, (1, 2, 3, 4), 17),
    "pytorch_half_pixel": ({"coordinate_transformation_mode": "pytorch_half_pixel",
                            "nearest_mode": "round_prefer_ceil"}, [1, 1, 4, 1], None, (2, 2, 3, 3), 13),
    "align_corners_scale_2": ({"coordinate_transformation_mode": "align_corners"}, [1, 1, 2, 2], None, (1, 2, 3, 5),
                              17),
    "sizes": ({"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
              None, [2, 3, 8, 15], (2, 3, 4, 5), 17),
    "asymmetric_round_scale_2": ({"coordinate_transformation_mode": "asymmetric"}, [1, 1, 2, 2], None, (1, 2, 3, 3),
                                 17),
    "axes_attribute": ({"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor", "axes": [3, 2]},
                       [3, 2], None, (1, 2, 3, 4), 18),
}


def _resize_model(attrs, scales, sizes, shape, opset, name="up"):
    inits, ins = [], ["x", ""]
    if scales is not None:
        inits.append(_floats("scales", scales))
        ins.append("scales")
    else:
        inits.append(_ints("sizes", sizes))
        ins += ["", "sizes"]
    return _model([N("Resize", ins, ["y"], name=name, mode=attrs.pop("mode", "nearest"), **attrs)], shape, inits,
                  opset=opset)


@pytest.mark.parametrize("case", list(RESIZES))
def test_nearest_resize_with_integer_scales_equals_the_reference(case):
    attrs, scales, sizes, shape, opset = RESIZES[case]
    g, _ = _check(_resize_model(dict(attrs), scales, sizes, shape, opset), shape, {"expand", "reshape"})
    assert set(kernels_of(g)) == {"expand", "reshape"}


def test_resize_opset10_and_upsample_equal_the_reference():
    """(``onnx.reference`` cannot run Resize-10: compared with ``np.repeat``, as its Upsample is.)"""
    m10 = _model([N("Resize", ["x", "scales"], ["y"], name="r10", mode="nearest")], (1, 2, 3, 3),
                 [_floats("scales", [1, 1, 2, 2])], opset=10)
    g, _ = import_onnx(m10, {})
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)
    np.testing.assert_array_equal(execute(g, {"x": x})["y"], np.repeat(np.repeat(x, 2, axis=2), 2, axis=3))
    m9 = _model([N("Upsample", ["x", "scales"], ["y"], name="u9", mode="nearest")], (1, 2, 3, 3),
                [_floats("scales", [1, 1, 3, 2])], opset=9)
    _check(m9, (1, 2, 3, 3), {"expand"})


def test_the_nearest_source_map_follows_the_spec_formulas():
    assert nearest_source(3, 3, "asymmetric", "round_prefer_floor").tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert nearest_source(3, 3, "half_pixel", "round_prefer_ceil").tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert nearest_source(2, 2, "align_corners", "round_prefer_floor").tolist() == [0, 0, 1, 1]
    assert nearest_source(2, 2, "tf_half_pixel_for_nn", "round_prefer_floor").tolist() == [0, 1, 1, 1]
    assert nearest_source(2, 2, "tf_half_pixel_for_nn", "floor").tolist() == [0, 0, 1, 1]
    assert nearest_source(3, 4, "pytorch_half_pixel", "ceil").tolist()[:4] == [0, 0, 1, 1]  # not i // 4


# -- refusals ---------------------------------------------------------------------------------------

_refused = onnx_models.check_refused


def test_unsupported_resizes_are_refused_naming_the_node_and_the_reason():
    floor = {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
    _refused(_resize_model({"mode": "linear"}, [1, 1, 2, 2], None, (1, 2, 3, 3), 17, name="bilinear"),
             "Resize (mode 'linear'; only 'nearest' with integer scales is supported): bilinear")
    _refused(_resize_model(dict(floor), [1, 1, 1.5, 2], None, (1, 2, 4, 4), 17, name="frac"),
             "Resize (scale 1.5 on axis 2; only integer up-scales (1, 2, 3, ...) are supported): frac")
    _refused(_resize_model(dict(floor), [1, 1, 0.5, 0.5], None, (1, 2, 4, 4), 17, name="down"),
             "scale 0.5 on axis 2", ": down")
    _refused(_resize_model(dict(floor), None, [1, 2, 6, 5], (1, 2, 4, 4), 17, name="by_size"),
             "scale 1.5 on axis 2", ": by_size")
    _refused(_resize_model({"coordinate_transformation_mode": "asymmetric"}, [1, 1, 3, 3], None, (1, 2, 3, 3), 17,
                           name="rounded"),
             "coordinate_transformation_mode 'asymmetric' with nearest_mode 'round_prefer_floor' at scale 3 on axis 2 "
             "does not read each input cell 3 times in turn", ": rounded")
    _refused(_resize_model({"coordinate_transformation_mode": "align_corners"}, [1, 1, 3, 3], None, (1, 2, 3, 3), 17,
                           name="corners"), "'align_corners'", "at scale 3", ": corners")
    _refused(_resize_model({"coordinate_transformation_mode": "pytorch_half_pixel", "nearest_mode": "ceil"},
                           [1, 1, 4, 1], None, (1, 2, 3, 3), 17, name="ceil"), "nearest_mode 'ceil' at scale 4", ": ceil")
    _refused(_resize_model({"coordinate_transformation_mode": "tf_crop_and_resize"}, [1, 1, 2, 2], None, (1, 2, 3, 3),
                           17, name="crop"), "coordinate_transformation_mode 'tf_crop_and_resize'", ": crop")
    _refused(_model([N("Upsample", ["x", "s"], ["y"], name="u_lin", mode="linear")], (1, 2, 3, 3),
                    [_floats("s", [1, 1, 2, 2])], opset=9), "Upsample (mode 'linear'", ": u_lin")


def test_computed_pads_repeats_axes_and_fills_are_refused_naming_the_node():
    pads_in = helper.make_tensor_value_info("pads", T.INT64, [4])
    _refused(_model([N("Pad", ["x", "pads"], ["y"], name="dyn_pad")], (3, 4), extra_inputs=[pads_in]),
             "Pad (its pads 'pads' is not a constant (the model computes it, or it is a graph input)", ": dyn_pad")
    v_in = helper.make_tensor_value_info("v", T.FLOAT, [1])
    _refused(_model([N("Pad", ["x", "pads", "v"], ["y"], name="dyn_fill")], (3, 4), [_ints("pads", [1, 1, 1, 1])],
                    extra_inputs=[v_in]), "its constant_value 'v' is not a constant", ": dyn_fill")
    reps_in = helper.make_tensor_value_info("reps", T.INT64, [2])
    _refused(_model([N("Tile", ["x", "reps"], ["y"], name="dyn_tile")], (3, 4), extra_inputs=[reps_in]),
             "Tile (its repeats 'reps' is not a constant", ": dyn_tile")
    ax_in = helper.make_tensor_value_info("ax", T.INT64, [1])
    _refused(_model([N("CumSum", ["x", "ax"], ["y"], name="dyn_cs")], (3, 4), extra_inputs=[ax_in]),
             "CumSum (its axis 'ax' is not a constant", ": dyn_cs")
    sc_in = helper.make_tensor_value_info("sc", T.FLOAT, [4])
    _refused(_model([N("Resize", ["x", "", "sc"], ["y"], name="dyn_up", mode="nearest")], (1, 2, 3, 3),
                    extra_inputs=[sc_in]), "Resize (its scales 'sc' is not a constant", ": dyn_up")


def test_unsupported_pads_and_repeats_are_refused_naming_the_node_and_mode():
    _refused(_pad_model("reflect", [0, -1, 0, 1], None, None, (3, 4), 18),
             "Pad (negative pads [0, -1, 0, 1] (cropping) in mode 'reflect'; only mode 'constant' crops): my_pad")
    _refused(_pad_model("constant", [0, -2, 0, -2], None, None, (3, 4), 18), "crop axis 1 of 4 cells to nothing")
    _refused(_pad_model("mirror", [0, 1, 0, 1], None, None, (3, 4), 18),
             "Pad (mode 'mirror' (constant, edge, reflect and wrap are supported)): my_pad")
    _refused(_model([N("Tile", ["x", "reps"], ["y"], name="tile0")], (3, 4), [_ints("reps", [0, 2])]),
             "repeats [0, 2] for an input of rank 2 (one repeat >= 1 per axis)", ": tile0")


# -- gradients -------------------------------------------------------------------------------------

def _after_weight(nodes, shape, inits=(), opset=18):
    """``h = x · W`` over the channels (an einsum on a [C, C] weight), then ``nodes`` (ending in ``y``)."""
    w = onnx_models.weight("W", (shape[1], shape[1]), seed=5)
    eq = "nc" + "hw"[: len(shape) - 2] + ",cd->nd" + "hw"[: len(shape) - 2]
    return _model([N("Einsum", ["x", "W"], ["h"], name="mix", equation=eq), *nodes], shape, [w, *inits], opset=opset)


GRADS = {
    "group_norm_18": ([N("GroupNormalization", ["h", "s", "b"], ["y"], name="gn", num_groups=2)], (2, 4, 3, 3),
                      [onnx_models.weight("s", (2,), 1), onnx_models.weight("b", (2,), 2)], 18, ("W", "s", "b")),
    "group_norm_21": ([N("GroupNormalization", ["h", "s", "b"], ["y"], name="gn", num_groups=2)], (2, 4, 3),
                      [onnx_models.weight("s", (4,), 1), onnx_models.weight("b", (4,), 2)], 21, ("W", "s", "b")),
    "instance_norm": ([N("InstanceNormalization", ["h", "s", "b"], ["y"], name="inorm")], (2, 3, 2, 3),
                      [onnx_models.weight("s", (3,), 1), onnx_models.weight("b", (3,), 2)], 17, ("W", "s")),
    "pad_reflect": ([N("Pad", ["h", "pads"], ["y"], name="p", mode="reflect")], (2, 3, 4, 4),
                    [_ints("pads", [0, 0, 1, 2, 0, 0, 3, 1])], 18, ("W",)),
    "pad_edge": ([N("Pad", ["h", "pads"], ["y"], name="p", mode="edge")], (2, 3, 4),
                 [_ints("pads", [0, 0, 2, 0, 0, 3])], 18, ("W",)),
    "pad_crop_fill": ([N("Pad", ["h", "pads", "v"], ["y"], name="p")], (2, 3, 4, 4),
                      [_ints("pads", [0, 0, -1, 2, 0, 0, 1, -1]), _floats("v", 0.5)], 18, ("W",)),
    "cumsum": ([N("CumSum", ["h", "ax"], ["y"], name="cs", exclusive=1, reverse=1)], (2, 3, 5),
               [_ints("ax", -1)], 18, ("W",)),
    "tile": ([N("Tile", ["h", "reps"], ["y"], name="t")], (2, 3, 2), [_ints("reps", [2, 1, 3])], 18, ("W",)),
    "resize": ([N("Resize", ["h", "", "sc"], ["y"], name="up", mode="nearest")], (1, 3, 2, 3),
               [_floats("sc", [1, 1, 2, 3])], 18, ("W",)),
}


@pytest.mark.parametrize("case", list(GRADS))
def test_training_through_each_op_equals_central_differences(case):
    nodes, shape, inits, opset, wrt = GRADS[case]
    g, vals = import_onnx(_after_weight(nodes, shape, inits, opset), {})
    onnx_models.check_central_differences(g, vals, shape, wrt)


def test_a_sharded_training_step_through_group_norm_pad_and_resize_verifies():
    nodes = [N("GroupNormalization", ["h", "s", "b"], ["n"], name="gn", num_groups=2),
             N("Pad", ["n", "pads"], ["p"], name="pad", mode="reflect"),
             N("Resize", ["p", "", "sc"], ["u"], name="up", mode="nearest"),
             N("CumSum", ["u", "ax"], ["y"], name="cs")]
    inits = [onnx_models.weight("s", (4,), 1), onnx_models.weight("b", (4,), 2),
             _ints("pads", [0, 0, 1, 1, 0, 0, 1, 1]), _floats("sc", [1, 1, 2, 2]), _ints("ax", 3)]
    g, vals = import_onnx(_after_weight(nodes, (2, 4, 3, 3), inits, opset=21), {})
    step = training_step(g, loss="mse", optimizer="sgd")
    assert {"group_norm_grad", "pad_copy_grad", "cumsum", "reduce_sum"} <= set(kernels_of(step))
    rng = np.random.default_rng(0)
    for _ in range(3):
        rep = verify(random_walk(step, rng, 4, 30), values=vals)
        assert rep.ok, rep


# -- PyTorch modules -------------------------------------------------------------------------------

def _conv_sandwich(op, c=4, c_out=None):
    """``conv1x1 -> op -> conv1x1``: trained weights on both sides of the op."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.op, self.b = torch.nn.Conv2d(3, c, 1), op, torch.nn.Conv2d(c_out or c, 2, 1)

        def forward(self, x):
            return self.b(self.op(self.a(x)))

    return Net()


def _randomise(m):
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.7)
    return m


NORM_MODULES = {
    "group_norm": (lambda: torch.nn.GroupNorm(2, 4), 4),
    "group_norm_1": (lambda: torch.nn.GroupNorm(1, 4), 4),
    "group_norm_per_channel": (lambda: torch.nn.GroupNorm(4, 4), 4),
    "instance_norm_affine": (lambda: torch.nn.InstanceNorm2d(4, affine=True), 4),
    "instance_norm": (lambda: torch.nn.InstanceNorm2d(4), 4),
}


@needs_torch
@pytest.mark.parametrize("name", list(NORM_MODULES))
def test_torch_norms_import_and_train_like_torch(name):
    make, c = NORM_MODULES[name]
    torch.manual_seed(0)
    m = _randomise(_conv_sandwich(make(), c))
    g, _ = check_against_torch(m, torch.randn(2, 3, 5, 4), {"group_norm"})
    if name.startswith("group_norm"):  # the weight keeps its name through the exporter's [C, 1, 1] copy
        assert {"op.weight", "op.bias"} <= set(g.tensors)


class _Fn(torch.nn.Module if torch is not None else object):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


LAYOUT_MODULES = {
    # name: (module, channels after it, kernel)
    "reflection_pad": (lambda: torch.nn.ReflectionPad2d((1, 2, 0, 1)), 4, "pad_copy"),
    "replication_pad": (lambda: torch.nn.ReplicationPad2d(1), 4, "pad_copy"),
    "zero_pad": (lambda: torch.nn.ZeroPad2d((2, 0, 1, 1)), 4, "pad"),
    "constant_pad": (lambda: torch.nn.ConstantPad2d(1, 0.25), 4, "pad"),
    "f_pad_negative": (lambda: _Fn(lambda x: torch.nn.functional.pad(x, (1, -1, -2, 1))), 4, "pad"),
    "upsample": (lambda: torch.nn.Upsample(scale_factor=2, mode="nearest"), 4, "expand"),
    "interpolate": (lambda: _Fn(lambda x: torch.nn.functional.interpolate(x, scale_factor=(3, 2), mode="nearest")), 4,
                    "expand"),
    "cumsum": (lambda: _Fn(lambda x: torch.cumsum(x, dim=2)), 4, "cumsum"),
    "repeat": (lambda: _Fn(lambda x: x.repeat(1, 2, 1, 3)), 8, "expand"),
}


@needs_torch
@pytest.mark.parametrize("name", list(LAYOUT_MODULES))
def test_torch_pads_upsampling_cumsum_and_repeat_import_and_train_like_torch(name):
    make, c_out, kernel = LAYOUT_MODULES[name]
    torch.manual_seed(0)
    m = _conv_sandwich(make(), 4, c_out)
    check_against_torch(m, torch.randn(2, 3, 4, 5), {kernel})
