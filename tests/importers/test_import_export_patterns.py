"""What PyTorch's exporter writes for models of ``transformers`` (the patterns behind
``test_hf_models.py``, checked without ``transformers``):

- ``torch.diff`` (no ONNX symbolic in torch): exported by ``ir.importers.torch_symbolics`` as
  Concat/Slice/Sub, equal to torch's forward and autograd; the symbolic is registered only for
  the export;
- ``IsNaN`` (torch's attention export zeroes NaN rows: ``Where(IsNaN(p), 0, p)``): ``x != x``,
  equal to ``onnx.reference`` on inputs holding NaNs;
- ``GatherElements`` on constants (BERT's buffered token types), folded with NumPy where
  ``onnx.reference`` fails (more than 32 source rows);
- ``Gather`` of constant index lists (repeats, runs, negative indices) as slices, equal to the
  reference, training like central differences; past 32 runs, rows of a 2-D table are an
  ``embedding`` of constant ids (T5's relative-position buckets); other scattered lists and
  out-of-range indices refused;
- empty slices (Phi-3's rotary pass-through when the rotary dims are the whole head) dropped by
  the ``Concat`` that reads them, and refused anywhere else;
- ``nn.Embedding(padding_idx=...)``: the padding row gets no gradient, as in torch;
- positions computed from the ids (RoBERTa's ``cumsum(ids != pad) * mask + pad``): integer
  arithmetic tracked through Add/Mul/CumSum, the lookup through ``float_to_index``; a Cast to an
  integer of a tensor that may hold fractions is still refused; a ``GatherElements`` at computed
  indices into a constant of equal cells (RoBERTa's token types) is that constant.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

import onnx_models  # noqa: E402
from torch_checks import check_against_torch, needs_torch, torch  # noqa: E402
from executor import verify  # noqa: E402
from executor.run import execute  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.graph import Graph  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.kernels import SignatureError, get_kernel  # noqa: E402
from ir.kernels.base import TensorSpec  # noqa: E402
from ir.rewrites import random_walk  # noqa: E402
from ir.rewrites.reduction import split_reduction  # noqa: E402

N = helper.make_node


def _model(nodes, shape, inits=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


# -- torch.diff ----------------------------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("kw", [{"dim": 1}, {"dim": -1, "prepend": True}, {"dim": 0, "n": 2, "append": True}])
def test_diff_equals_torch_and_trains(kw):
    kw = dict(kw)
    prepend, append = kw.pop("prepend", False), kw.pop("append", False)

    class Diff(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(6, 6)

        def forward(self, x):
            h = self.fc(x)
            extra = {}
            if prepend:
                extra["prepend"] = h[:, :1] - 1.0
            if append:
                extra["append"] = h[:1] * 2.0
            return torch.diff(h, **kw, **extra)

    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    check_against_torch(Diff(), x, {"slice", "sub"})


@needs_torch
def test_diff_symbolic_is_registered_only_for_the_export():
    from ir.importers.torch_export import import_torch

    class Diff(torch.nn.Module):
        def forward(self, x):
            return torch.diff(x, dim=1)

    import io
    import_torch(Diff(), {"x": torch.randn(2, 5)})
    with pytest.raises(Exception, match="diff"):  # torch's own exporter still lacks it afterwards
        torch.onnx.export(Diff(), (torch.randn(2, 5),), io.BytesIO(), dynamo=False, opset_version=17)


# -- IsNaN ---------------------------------------------------------------------------------------

def test_isnan_guard_equals_reference_on_nans():
    """``Where(IsNaN(softmax(x)), 0, softmax(x))``: rows of -inf give NaN, zeroed; others kept."""
    m = _model([N("Softmax", ["x"], ["p"], axis=-1), N("IsNaN", ["p"], ["nan"]),
                N("Where", ["nan", "zero", "p"], ["y"])], [3, 4],
               [numpy_helper.from_array(np.zeros((), np.float32), "zero")])
    x = np.array([[1, 2, 3, 4], [-np.inf] * 4, [0.5, np.nan, 1, 2]], np.float32)
    from onnx.reference import ReferenceEvaluator
    want = ReferenceEvaluator(m).run(None, {"x": x})[0]
    assert np.isnan(want).sum() == 0 and np.all(want[1] == 0)  # the guard does something here
    g, vals = import_onnx(m, {})
    got = np.asarray(execute(g, {"x": x, **vals})["y"])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert {"compare", "masked_fill"} <= {o.kernel for o in g.ops.values()}


# -- GatherElements on constants -----------------------------------------------------------------

def test_gather_elements_on_constants_folds_past_the_reference_limit():
    """BERT's ``gather(token_type_ids.expand(b, -1), 1, position_ids)`` with 80 buffered rows:
    ``onnx.reference`` raises there; the fold equals ``np.take_along_axis``."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((2, 80)).astype(np.float32)
    idx = np.array([[79, 0, 5, -1, 3, 40]], np.int64)
    m = _model([N("GatherElements", ["t", "i"], ["c"], axis=1), N("Add", ["x", "c"], ["y"])], [2, 6],
               [numpy_helper.from_array(table, "t"), _ints("i", idx)])
    x = rng.standard_normal((2, 6)).astype(np.float32)
    g, vals = import_onnx(m, {})
    got = np.asarray(execute(g, {"x": x, **vals})["y"])
    np.testing.assert_allclose(got, x + np.take_along_axis(table, np.where(idx < 0, idx + 80, idx), 1), rtol=1e-6)
    bad = _model([N("GatherElements", ["t", "i"], ["c"], axis=1), N("Add", ["x", "c"], ["y"])], [2, 6],
                 [numpy_helper.from_array(table, "t"), _ints("i", [[80, 0, 0, 0, 0, 0]])])
    onnx_models.check_refused(bad, "GatherElements", "outside axis 1 of length 80")


# -- Gather of constant index lists --------------------------------------------------------------

@pytest.mark.parametrize("idx,axis", [
    ([[3, 4, 5], [0, 0, 0]], 0),  # a run, then one row repeated
    ([0, 0, 0, 0], 1),  # BERT's all-zero token types: one column read four times
    ([5, -1, 2, 3, 1, 1], 0),  # negative indices, runs of one
    ([[2, 1], [0, 3]], 1),
])
def test_gather_of_constant_indices_equals_reference_and_trains(idx, axis):
    """``y = Gather(x * w, idx)``: equal to the reference; ``w``'s gradient is ``x`` times the
    scatter-add of the output gradient onto the gathered cells."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    m = _model([N("Mul", ["x", "w"], ["t"]), N("Gather", ["t", "i"], ["y"], axis=axis)], [6, 4],
               [numpy_helper.from_array(w, "w"), _ints("i", idx)])
    g, vals = onnx_models.check_reference(m, {"x": (6, 4)}, kernels={"slice"})
    step = training_step(g, loss="mse", optimizer="sgd")
    ii = np.asarray(idx) % w.shape[axis]
    x = rng.standard_normal((6, 4))
    y = np.take(x * w, ii, axis=axis)
    target = rng.standard_normal(y.shape)
    env = execute(step, {"w": w.astype(np.float64), "x": x, "target": target}, precision="float64")
    dy = 2.0 * (y - target) / y.size
    dt = np.zeros((6, 4))
    for pos in np.ndindex(*ii.shape):  # each gathered row (axis 0) or column (axis 1), added back
        src = [slice(None)] * 2
        src[axis] = ii[pos]
        dt[tuple(src)] += dy[(slice(None),) * axis + pos]
    np.testing.assert_allclose(env["w.grad"], dt * x, rtol=1e-9, atol=1e-12)
    assert verify(random_walk(step, np.random.default_rng(2), 4, 20), values=vals).ok


def test_gather_of_many_constant_ids_is_an_embedding_lookup_that_trains():
    """T5's bias lookup: ``Gather(table[32, 4], buckets[s, t])`` with scattered bucket ids: an
    ``embedding`` whose ids are an int32 constant; the table's gradient is the scatter-add, and the
    ids get none (a training step trains float parameters only)."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((32, 4)).astype(np.float32)
    buckets = rng.integers(0, 32, (6, 6))
    m = _model([N("Mul", ["x", "w"], ["t"]), N("Gather", ["t", "i"], ["y"], axis=0)], [32, 4],
               [numpy_helper.from_array(table, "w"), _ints("i", buckets)])
    g, vals = onnx_models.check_reference(m, {"x": (32, 4)}, kernels={"embedding"})
    step = training_step(g, loss="mse", optimizer="adamw")
    ids = [n for n, t in g.tensors.items() if t.role == "parameter" and t.dtype == "int32"]
    assert len(ids) == 1 and f"{ids[0]}.next" not in step.tensors and f"{ids[0]}.grad" not in step.tensors
    x = rng.standard_normal((32, 4))
    y = (x * table)[buckets]
    target = rng.standard_normal(y.shape)
    env = execute(training_step(g, loss="mse", optimizer="sgd"),
                  {"w": table.astype(np.float64), "x": x, "target": target, ids[0]: vals[ids[0]]}, precision="float64")
    dt = np.zeros((32, 4))
    np.add.at(dt, buckets.reshape(-1), (2.0 * (y - target) / y.size).reshape(-1, 4))
    np.testing.assert_allclose(env["w.grad"], dt * x, rtol=1e-9, atol=1e-12)
    assert verify(random_walk(step, np.random.default_rng(4), 4, 20), values=vals).ok


def test_empty_slices_are_dropped_by_concat_and_refused_elsewhere():
    """``concat(x[..., :4], x[..., 4:4])`` is ``x[..., :4]``; an empty slice read by a Relu is refused."""
    nodes = [N("Slice", ["x", "s0", "e0", "ax"], ["a"]), N("Slice", ["x", "s1", "e1", "ax"], ["empty"]),
             N("Concat", ["a", "empty"], ["y"], axis=-1)]
    inits = [_ints("s0", [0]), _ints("e0", [4]), _ints("s1", [4]), _ints("e1", [4]), _ints("ax", [-1])]
    g, _ = onnx_models.check_reference(_model(nodes, [3, 6], inits), {"x": (3, 6)}, kernels={"slice"})
    assert "concat" not in {o.kernel for o in g.ops.values()}
    nodes[2] = N("Relu", ["empty"], ["y"])
    onnx_models.check_refused(_model(nodes, [3, 6], inits), "Relu", "empty slice [3, 0]", "only a Concat")


def test_gather_of_scattered_indices_and_out_of_range_are_refused():
    scattered = list(range(0, 80, 2))  # 40 runs of one, gathering columns: not an embedding lookup
    m = _model([N("Gather", ["x", "i"], ["y"], axis=1)], [2, 80], [_ints("i", scattered)])
    onnx_models.check_refused(m, "Gather", "40 runs", "up to 32")
    m = _model([N("Gather", ["x", "i"], ["y"], axis=0)], [80, 2], [_ints("i", [0, 80])])
    onnx_models.check_refused(m, "Gather", "outside axis 0 of length 80")


# -- padding_idx ---------------------------------------------------------------------------------

@needs_torch
def test_embedding_padding_row_gets_no_gradient_as_in_torch():
    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = torch.nn.Embedding(10, 8, padding_idx=0)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, ids):
            return self.out(torch.tanh(self.e(ids)))

    ids = torch.tensor([[0, 3, 0, 7], [1, 0, 9, 3]])
    g, env = check_against_torch(Tagger(), ids, {"embedding"})
    assert np.all(env["e.weight.grad"][0] == 0) and np.abs(env["e.weight.grad"][3]).max() > 0
    step = training_step(g, loss="mse", optimizer="sgd")
    grads = [o for o in step.ops.values() if o.kernel == "embedding_grad"]
    assert [o.params["padding_idx"] for o in grads] == [0]


def test_padding_row_is_checked_and_survives_a_split_reduction():
    emb = get_kernel("embedding")
    with pytest.raises(SignatureError, match="padding_idx must be a row 0..9"):
        emb.signature({"table": TensorSpec((10, 4), "float32"), "ids": TensorSpec((3,), "int32")}, {"padding_idx": 10})
    from ir.builder import GraphBuilder

    b = GraphBuilder()
    b.input("ids", (8,), "int32")
    b.parameter("table", (10, 4))
    emb = b.op("embedding", "emb", {"table": "table", "ids": "ids"}, padding_idx=2)
    b.op("tanh", "act", {"x": emb})
    g: Graph = training_step(b.build(), loss="mse", optimizer="sgd")
    ids = np.array([2, 0, 2, 5, 9, 2, 1, 5], np.int32)
    dy = np.random.default_rng(0).standard_normal((8, 4))
    (grad_op,) = [n for n, o in g.ops.items() if o.kernel == "embedding_grad"]
    split = split_reduction(g, grad_op, 4)  # data parallel: the sum over tokens in four blocks
    for plan in (g, split):
        env = execute(plan, {"ids": ids, "table": np.ones((10, 4)), "target": dy}, precision="float64")
        dtable = env[g.ops[grad_op].output]
        assert np.all(dtable[2] == 0) and np.abs(dtable[5]).max() > 0
    assert verify(split).ok and verify(random_walk(split, np.random.default_rng(0), 4, 25)).ok


# -- ids computed from ids -------------------------------------------------------------------------

def _positions_model(extra_div: bool = False):
    """RoBERTa's ``create_position_ids_from_input_ids`` (padding 1), then a lookup and an add."""
    ids = helper.make_tensor_value_info("ids", T.INT64, [2, 7])
    nodes = [N("Equal", ["ids", "pad"], ["is_pad"]), N("Not", ["is_pad"], ["keep"]),
             N("Cast", ["keep"], ["mask"], to=T.INT32), N("CumSum", ["mask", "axis"], ["run"]),
             N("Mul", ["run", "mask"], ["pos32"])]
    if extra_div:  # a halving: no longer integers
        nodes.append(N("Div", ["pos32", "two"], ["half"]))
        nodes.append(N("Cast", ["half"], ["pos64"], to=T.INT64))
    else:
        nodes.append(N("Cast", ["pos32"], ["pos64"], to=T.INT64))
    nodes += [N("Add", ["pos64", "pad"], ["pos"]), N("Gather", ["table", "pos"], ["emb"]),
              N("Gather", ["words", "ids"], ["w"]), N("Add", ["w", "emb"], ["y"])]
    rng = np.random.default_rng(5)
    inits = [_ints("pad", 1), numpy_helper.from_array(np.array(1, np.int32), "axis"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(rng.standard_normal((12, 4)).astype(np.float32), "table"),
             numpy_helper.from_array(rng.standard_normal((10, 4)).astype(np.float32), "words")]
    g = helper.make_graph(nodes, "g", [ids], [helper.make_tensor_value_info("y", T.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_positions_computed_from_the_ids_equal_the_reference():
    from onnx.reference import ReferenceEvaluator

    m = _positions_model()
    g, vals = import_onnx(m, {})
    assert {"float_to_index", "embedding"} <= {o.kernel for o in g.ops.values()}
    ids = np.array([[5, 3, 9, 1, 1, 1, 1], [2, 1, 7, 8, 4, 1, 1]], np.int64)  # 1 pads (RoBERTa's <pad>)
    want = ReferenceEvaluator(m).run(None, {"ids": ids})[0]
    got = np.asarray(execute(g, {**vals, "ids": ids.astype(np.int32)})["y"])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert verify(random_walk(g, np.random.default_rng(0), 4, 15), values=vals).ok


def test_a_cast_of_possible_fractions_to_integers_is_still_refused():
    onnx_models.check_refused(_positions_model(extra_div=True), "Cast", "computed float tensor to integer")


def test_gather_elements_at_computed_indices_into_equal_cells_is_the_constant():
    """RoBERTa's buffered token types (zeros) gathered at its computed positions: zeros; into
    cells that differ it is refused."""
    ids = helper.make_tensor_value_info("ids", T.INT64, [2, 5])
    for cells, ok in ((np.zeros((2, 9), np.int64), True), (np.arange(18, dtype=np.int64).reshape(2, 9), False)):
        nodes = [N("GatherElements", ["buf", "ids"], ["types"], axis=1), N("Gather", ["table", "types"], ["t"]),
                 N("Gather", ["words", "ids"], ["w"]), N("Add", ["w", "t"], ["y"])]
        rng = np.random.default_rng(6)
        inits = [numpy_helper.from_array(cells, "buf"),
                 numpy_helper.from_array(rng.standard_normal((18, 3)).astype(np.float32), "table"),
                 numpy_helper.from_array(rng.standard_normal((9, 3)).astype(np.float32), "words")]
        m = helper.make_model(helper.make_graph(nodes, "g", [ids], [helper.make_tensor_value_info("y", T.FLOAT, None)],
                                                inits), opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        if not ok:
            onnx_models.check_refused(m, "GatherElements into a constant whose cells differ")
            continue
        g, vals = import_onnx(m, {})
        x = np.array([[0, 3, 8, 2, 2], [1, 1, 4, 7, 0]], np.int64)
        from onnx.reference import ReferenceEvaluator
        want = ReferenceEvaluator(m).run(None, {"ids": x})[0]
        np.testing.assert_allclose(np.asarray(execute(g, {**vals, "ids": x.astype(np.int32)})["y"]), want, rtol=1e-6)


@needs_torch
@pytest.mark.parametrize("positions", [[[0, 1, 2, 3]], [[3, 0, 2, 0]]])  # [1, seq], as HF holds them
def test_padding_row_read_at_constant_ids_gets_no_gradient(positions):
    """Position ids held as a buffer: the Gather's indices are constants, which the importer would
    read as slices of the table; at the padding row they must stay a lookup with ``padding_idx``."""

    class Pos(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = torch.nn.Embedding(6, 8, padding_idx=0)
            self.register_buffer("position_ids", torch.tensor(positions), persistent=False)
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x + self.pos(self.position_ids))

    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    g, env = check_against_torch(Pos(), x, {"embedding"})
    assert np.all(env["pos.weight.grad"][0] == 0)
    assert [o.params.get("padding_idx") for o in g.ops.values() if o.kernel == "embedding"] == [0]


@needs_torch
def test_a_callers_own_diff_symbolic_is_used_and_kept():
    from torch.onnx._internal.torchscript_exporter.registration import registry

    from ir.importers.errors import ImportFailure
    from ir.importers.torch_export import import_torch

    def mine(g, x, n, dim, prepend, append):
        raise RuntimeError("the caller's symbolic ran")

    class D(torch.nn.Module):
        def forward(self, x):
            return torch.diff(x, dim=1)

    torch.onnx.register_custom_op_symbolic("aten::diff", mine, 9)
    try:
        with pytest.raises(ImportFailure, match="the caller's symbolic ran"):
            import_torch(D(), {"x": torch.randn(4, 4)})
        assert registry.get_function_group("aten::diff").get(17) is mine
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::diff", 9)
    import_torch(D(), {"x": torch.randn(4, 4)})  # ours again, once the caller's is gone
