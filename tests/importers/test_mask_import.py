"""Boolean masks as newer Hugging Face exports build them: comparisons (``Equal``, ``Less``,
``Greater``, ``LessOrEqual``, ``GreaterOrEqual``), ``Not``/``And``/``Or``/``Xor``, ``Cast`` to and
from bool, feeding ``Where`` and ``Cast``. Comparisons of shape-only values fold to constants
(the causal ``arange`` mask); those of computed tensors become the mask kernels. Each import
equals ``onnx.reference`` on real 0/1 padding masks, and sharded plans of it verify."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from executor import verify  # noqa: E402
from executor.run import execute, random_inputs  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.rewrites import place, random_walk, split  # noqa: E402
from onnx_models import weight  # noqa: E402

B, S, D = 3, 6, 8
n = helper.make_node


def _const(name: str, value) -> onnx.NodeProto:
    return n("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _model(nodes, inputs, out_shape, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                          list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def sdpa_mask_attention() -> onnx.ModelProto:
    """One attention head with the mask of ``transformers``' sdpa path: a causal ``kv_idx <=
    q_idx`` from ``arange(seq)`` (shape-only: folded), ``~(attention_mask == 0)`` as the padding
    mask, ``causal & padding`` into ``Where(mask, scores, -inf)``, and the padded query rows
    zeroed by ``Cast(valid, float)``."""
    nodes = [
        n("MatMul", ["x", "Wq"], ["q"]), n("MatMul", ["x", "Wk"], ["k"]), n("MatMul", ["x", "Wv"], ["v"]),
        n("Transpose", ["k"], ["kT"], perm=[0, 2, 1]), n("MatMul", ["q", "kT"], ["s"]),
        _const("scale", np.float32(D ** -0.5)), n("Mul", ["s", "scale"], ["sc"]),
        n("Shape", ["x"], ["shp"]), _const("one", np.int64(1)), n("Gather", ["shp", "one"], ["seqlen"]),
        _const("zero", np.int64(0)), n("Range", ["zero", "seqlen", "one"], ["pos"]),
        _const("ax0", np.array([0], np.int64)), _const("ax1", np.array([1], np.int64)),
        n("Unsqueeze", ["pos", "ax1"], ["q_idx"]), n("Unsqueeze", ["pos", "ax0"], ["kv_idx"]),
        n("LessOrEqual", ["kv_idx", "q_idx"], ["causal"]),
        n("Equal", ["attention_mask", "zero"], ["is_pad"], name="is_pad"),
        n("Not", ["is_pad"], ["valid"], name="valid"),
        n("Unsqueeze", ["valid", "ax1"], ["valid3"]), n("And", ["causal", "valid3"], ["keep"], name="keep"),
        _const("neg_inf", np.float32(-np.inf)), n("Where", ["keep", "sc", "neg_inf"], ["masked"]),
        n("Softmax", ["masked"], ["p"], axis=-1), n("MatMul", ["p", "v"], ["o"]),
        n("Cast", ["valid"], ["validf"], to=TensorProto.FLOAT), _const("ax2", np.array([2], np.int64)),
        n("Unsqueeze", ["validf", "ax2"], ["validf3"]), n("Mul", ["o", "validf3"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])]
    return _model(nodes, inputs, ["batch", "seq", D], [weight(w, (D, D), k) for k, w in enumerate(("Wq", "Wk", "Wv"))])


def every_mask_op() -> onnx.ModelProto:
    """Each comparison and connective on computed floats, computed integers, a constant vector,
    scalars on either side, masks compared with masks, and Casts bool -> int -> float."""
    nodes = [
        _const("half", np.float32(0.5)), _const("i1", np.int64(1)), _const("i2", np.int64(2)),
        n("Greater", ["x", "half"], ["a"], name="gt_scalar"),
        n("Less", ["x", "t"], ["b"], name="lt_vector"),
        n("GreaterOrEqual", ["m", "i1"], ["c"], name="ge_int"),
        n("LessOrEqual", ["i2", "m"], ["d"], name="le_scalar_left"),
        n("Equal", ["a", "c"], ["e"], name="eq_masks"),
        n("Or", ["a", "b"], ["f"]), n("Xor", ["f", "d"], ["g"]), n("Not", ["e"], ["ne"]),
        n("And", ["g", "ne"], ["h"]),
        n("Cast", ["h"], ["hf"], to=TensorProto.FLOAT), _const("zf", np.float32(0.0)),
        n("Where", ["h", "x", "zf"], ["w"]), n("Add", ["w", "hf"], ["w2"]),
        n("Cast", ["e"], ["ei"], to=TensorProto.INT64), n("Cast", ["ei"], ["ef"], to=TensorProto.FLOAT),
        n("Cast", ["m"], ["mb"], to=TensorProto.BOOL), n("Where", ["mb", "ef", "x"], ["w3"]),
        n("Add", ["w2", "w3"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", S]),
              helper.make_tensor_value_info("m", TensorProto.INT64, ["batch", S])]
    t = numpy_helper.from_array(np.linspace(-1, 1, S).astype(np.float32), "t")
    return _model(nodes, inputs, ["batch", S], [t])


def _padding_mask(seed: int) -> np.ndarray:
    """Right-padded 0/1 rows, each keeping at least one token, one row padded for sure."""
    lengths = np.random.default_rng(seed).integers(1, S + 1, B)
    lengths[0] = S - 2
    return (np.arange(S)[None] < lengths[:, None]).astype(np.int64)


def _equals_reference(m, dims, feeds_for_seed, ints):
    g, values = import_onnx(m, dims)
    ref = ReferenceEvaluator(m)
    for seed in (0, 1, 2):
        feeds = feeds_for_seed(seed)
        ins = {**random_inputs(g, seed), **values, **{k: v.astype(np.int32) for k, v in feeds.items() if k in ints}}
        feeds["x"] = ins["x"]
        (want,) = ref.run(None, feeds)
        np.testing.assert_allclose(np.asarray(execute(g, ins)["y"]), want, rtol=1e-5, atol=1e-6)
    return g, values


def test_hf_sdpa_mask_equals_onnx_reference():
    g, values = _equals_reference(sdpa_mask_attention(), {"batch": B, "seq": S},
                                  lambda s: {"attention_mask": _padding_mask(s)}, {"attention_mask"})
    kernels = sorted(o.kernel for o in g.ops.values())
    # the causal comparison folded; the padding mask is computed (Equal and Not), then And and Where
    assert kernels.count("compare_scalar") == 2 and kernels.count("logical") == 1 and "compare" not in kernels
    assert "masked_fill" in kernels and "where" not in kernels and kernels.count("index_to_float") == 1
    # the padding mask matters: without it the reference changes, and the import follows
    feeds = {"x": np.random.default_rng(4).standard_normal((B, S, D)).astype(np.float32),
             "attention_mask": _padding_mask(0)}
    ones = {**feeds, "attention_mask": np.ones((B, S), np.int64)}
    ref = ReferenceEvaluator(sdpa_mask_attention())
    assert np.abs(ref.run(None, ones)[0] - ref.run(None, feeds)[0]).max() > 1e-2
    got = execute(g, {**values, "x": ones["x"], "attention_mask": ones["attention_mask"].astype(np.int32)})["y"]
    np.testing.assert_allclose(got, ref.run(None, ones)[0], rtol=1e-5, atol=1e-6)
    fill = next(o for o in g.ops.values() if o.kernel == "masked_fill")
    assert fill.params == {"value": None, "fill_where": "zero"}  # -inf where the mask is false, no -inf tensor
    causal = next(v for k, v in values.items() if k.startswith("causal"))
    np.testing.assert_array_equal(causal, np.tril(np.ones((S, S))))


def test_hf_sdpa_mask_sharded_plans_and_training_verify():
    g, values = import_onnx(sdpa_mask_attention(), {"batch": B, "seq": S})
    vals = {**values, "attention_mask": _padding_mask(3).astype(np.int32)}
    rng = np.random.default_rng(7)
    for _ in range(3):
        rep = verify(random_walk(g, rng, 4, 25), values=vals)
        assert rep.ok and np.isfinite(rep.max_rel_error), rep
    # the masks split over the batch on three devices, the masked scores over query rows
    plan = g
    for o in g.ops.values():
        if o.kernel in ("compare_scalar", "logical"):
            plan = place(split(plan, o.name, 0, 3), o.name, [0, 1, 2])
        if o.kernel == "masked_fill":
            plan = place(split(plan, o.name, 1, 2), o.name, [3, 1])
    rep = verify(plan, values=vals)
    assert rep.ok, rep
    # the weights train through the masked fill; the masks get no gradient
    step = training_step(g, loss="mse", optimizer="sgd")
    assert {"Wq.next", "Wk.next", "Wv.next"} <= set(step.tensors) and not any("causal" in t for t in step.carried)
    rep = verify(random_walk(step, np.random.default_rng(8), 4, 30), values=vals)
    assert rep.ok, rep


def test_every_mask_op_equals_onnx_reference():
    m_vals = lambda s: {"m": np.random.default_rng(s + 10).integers(0, 4, (B, S))}  # noqa: E731
    g, values = _equals_reference(every_mask_op(), {"batch": B}, m_vals, {"m"})
    ops = {o.name: o for o in g.ops.values()}
    assert ops["le_scalar_left"].kernel == "compare_scalar"
    assert ops["le_scalar_left"].params == {"op": "ge", "value": 2.0}  # 2 <= m  is  m >= 2
    assert ops["lt_vector"].kernel == "compare" and ops["eq_masks"].kernel == "compare"
    assert sum(o.kernel == "logical" for o in g.ops.values()) == 3
    assert {o.kernel for o in g.ops.values()} >= {"masked_fill", "where"}  # Where(h, x, 0.0) and Where(mb, ef, x)
    vals = {**values, "m": m_vals(5)["m"].astype(np.int32)}
    rng = np.random.default_rng(9)
    for _ in range(2):
        rep = verify(random_walk(g, rng, 4, 25), values=vals)
        assert rep.ok, rep
