"""ONNX import: imported programs equal onnx.reference on random inputs, their sharded plans
verify, recognisable patterns map to the IR's kernels, and bad models fail with one clear error."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import onnx_models  # noqa: E402
from executor import verify  # noqa: E402
from executor.run import execute, random_inputs  # noqa: E402
from ir.importers import ImportFailure  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.rewrites import place, random_walk, split  # noqa: E402

MODELS = {
    "mlp": (onnx_models.mlp, {"batch": 4}),
    "gpt2_block": (onnx_models.gpt2_block, {"batch": 2, "seq": 6}),
    "llama_block": (onnx_models.llama_block, {"batch": 2}),
    "convnet": (onnx_models.convnet, {"N": 2}),
}


def _compare(m, g, values, seed: int) -> float:
    ins = random_inputs(g, seed)
    ins.update(values)
    env = execute(g, ins)
    feeds = {}
    for vi in m.graph.input:
        a = ins[vi.name]
        feeds[vi.name] = a.astype(np.int64) if vi.type.tensor_type.elem_type == TensorProto.INT64 else a
    ref = ReferenceEvaluator(m).run(None, feeds)
    worst = 0.0
    for vi, r in zip(m.graph.output, ref):
        assert env[vi.name].shape == r.shape
        worst = max(worst, float(np.max(np.abs(env[vi.name] - r)) / np.max(np.abs(r))))
    return worst


@pytest.mark.parametrize("name", list(MODELS))
def test_import_equals_onnx_reference(name):
    make, params = MODELS[name]
    m = make()
    g, values = import_onnx(m, params)
    for seed in (0, 1):
        assert _compare(m, g, values, seed) < 1e-5
    # names kept: inputs, outputs, initializers
    assert {vi.name for vi in m.graph.input} <= {n for n, t in g.tensors.items() if t.role == "input"}
    assert [vi.name for vi in m.graph.output] == [n for n, t in g.tensors.items() if t.role == "output"]
    inits = {t.name for t in m.graph.initializer}
    params_ = {n for n, t in g.tensors.items() if t.role == "parameter"}
    assert inits & params_ and set(values) == params_
    for n in inits & params_:
        np.testing.assert_array_equal(values[n], onnx.numpy_helper.to_array(
            next(t for t in m.graph.initializer if t.name == n)))


def test_symbolic_dims_follow_params():
    m = onnx_models.gpt2_block()
    for batch, seq in ((1, 3), (3, 8)):
        g, values = import_onnx(m, {"batch": batch, "seq": seq})
        assert g.tensors["y"].shape == (batch, seq, 16)
        assert _compare(m, g, values, 0) < 1e-5


def _kernels(g) -> list[str]:
    return sorted(o.kernel for o in g.ops.values())


def test_patterns_map_to_ir_kernels():
    g, _ = import_onnx(onnx_models.gpt2_block(), {"batch": 2, "seq": 6})
    k = _kernels(g)
    assert k.count("linear") == 4 and k.count("gelu_erf") == 1 and k.count("causal_mask") == 1
    assert "erf" not in k and "where" not in k
    g, _ = import_onnx(onnx_models.llama_block(), {"batch": 2})
    k = _kernels(g)
    assert k.count("rmsnorm") == 2 and k.count("silu") == 1 and k.count("causal_mask") == 1
    assert k.count("embedding") == 1 and "pow" not in k and "sigmoid" not in k
    g, _ = import_onnx(onnx_models.mlp(), {"batch": 4})
    assert _kernels(g).count("linear") == 2


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_plans_verify(name):
    make, params = MODELS[name]
    g, values = import_onnx(make(), params)
    rng = np.random.default_rng(7)
    for _ in range(3):
        plan = random_walk(g, rng, 4, 25)
        rep = verify(plan, values=values)
        assert rep.ok and np.isfinite(rep.max_rel_error), rep


def test_megatron_heads_shard_through_the_reshape():
    """Attention split by heads: the head-splitting reshape, the score bmm and the merge all shard
    along heads; the plan verifies with the model's own weights."""
    g, values = import_onnx(onnx_models.gpt2_block(), {"batch": 2, "seq": 6})
    heads_dim = {"h.0_attn_Reshape_q": 2, "h.0_attn_Reshape_k": 2, "h.0_attn_Reshape_v": 2,
                 "h.0_attn_MatMul_qk": 1, "h.0_attn_Softmax": 1, "h.0_attn_MatMul_pv": 1,
                 "h.0_attn_Reshape_merge": 2}
    for op, d in heads_dim.items():
        assert g.signature(op).extents[d] == 2, op
        g = place(split(g, op, d, 2), op, [0, 1])
    rep = verify(g, values=values)
    assert rep.ok, rep


def _single(op_type: str, inputs, outputs, **attrs):
    n = helper.make_node(op_type, [i.name for i in inputs], [o.name for o in outputs], name=f"my_{op_type}", **attrs)
    return n


def test_unsupported_ops_listed_in_one_error():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    nodes = [helper.make_node("Hardmax", ["x"], ["a"], name="hm1"),
             helper.make_node("Relu", ["a"], ["b"], name="relu"),
             helper.make_node("LpNormalization", ["x"], ["c"], name="lp1"),
             helper.make_node("Hardmax", ["c"], ["d"], name="hm2"),
             helper.make_node("Add", ["b", "d"], ["y"], name="add")]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", 1, [4, 8])]),
                          opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ImportFailure) as e:
        import_onnx(m)
    msg = str(e.value)
    assert "Hardmax: hm1, hm2" in msg and "LpNormalization: lp1" in msg
    assert "Relu" not in msg.split("Supported")[0]  # nodes after an unsupported one are not blamed


def test_bad_files(tmp_path):
    with pytest.raises(ImportFailure, match="does not exist"):
        import_onnx(tmp_path / "missing.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01 certainly not protobuf \xff" * 10)
    with pytest.raises(ImportFailure, match="not an ONNX model"):
        import_onnx(bad)


def test_dims_that_cannot_be_bound():
    m = onnx_models.gpt2_block()
    with pytest.raises(ImportFailure, match=r"seq \(at x\[1\]\).*--set"):
        import_onnx(m, {"batch": 2})
    with pytest.raises(ImportFailure, match="name no symbolic dim"):
        import_onnx(m, {"batch": 2, "seq": 4, "sequence": 4})
    with pytest.raises(ImportFailure, match="positive integers"):
        import_onnx(m, {"batch": 0, "seq": 4})


def test_verify_fails_on_nan_outputs():
    """A plan producing NaN must not PASS (max() over floats skips NaN)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Sqrt", ["x"], ["s"], name="sqrt")],
        "g", [x], [helper.make_tensor_value_info("r", 1, [4, 8]), helper.make_tensor_value_info("s", 1, [4, 8])]),
        opset_imports=[helper.make_opsetid("", 17)])
    g, values = import_onnx(m)
    with np.errstate(invalid="ignore"):
        rep = verify(g, values=values)  # sqrt of negative random inputs: NaN in output s
    assert not rep.ok


@pytest.mark.parametrize("kind", ["causal_offset", "arbitrary"])
def test_where_masks(kind):
    """A lower-triangular constant mask (any diagonal offset) is causal_mask; any other constant
    mask with a scalar fill is masked_fill over a float mask (the fill a parameter of the op). Both
    equal the ONNX reference."""
    s = 5
    mask = np.tril(np.ones((s, s), bool), 1) if kind == "causal_offset" else \
        np.random.default_rng(0).random((s, s)) > 0.5
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, s, s])
    inits = [onnx.numpy_helper.from_array(mask, "mask"),
             onnx.numpy_helper.from_array(np.array(-np.inf, np.float32), "fill")]
    nodes = [helper.make_node("Where", ["mask", "x", "fill"], ["m"], name="mask_scores"),
             helper.make_node("Softmax", ["m"], ["y"], name="sm", axis=-1)]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", 1, [2, s, s])],
                                            inits), opset_imports=[helper.make_opsetid("", 17)])
    if kind == "arbitrary":
        mask[:, 0] = True  # every row keeps a key (a fully masked row is NaN in both)
        m.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(mask, "mask"))
    g, values = import_onnx(m)
    kernels = {o.kernel for o in g.ops.values()}
    assert ("causal_mask" in kernels) == (kind == "causal_offset")
    assert ("masked_fill" in kernels) == (kind == "arbitrary") and "where" not in kernels
    if kind == "causal_offset":
        assert next(o for o in g.ops.values() if o.kernel == "causal_mask").params["offset"] == 1
    assert _compare(m, g, values, 0) < 1e-6
