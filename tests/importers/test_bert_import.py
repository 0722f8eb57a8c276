"""BERT: the padding mask is an int64 graph input, Unsqueezed and Cast to float
(``(1 - mask.float()) * -10000`` added to the scores). Its import runs (``index_to_float`` on the
int32 mask, the Unsqueezes as float views), equals ``onnx.reference`` and the PyTorch module, and
sharded plans of it verify with real 0/1 masks."""

from __future__ import annotations

import math

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import onnx_models  # noqa: E402
from executor import verify  # noqa: E402
from executor.run import execute, random_inputs  # noqa: E402
from ir.importers import ImportFailure  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.rewrites import place, random_walk, split  # noqa: E402

SHAPE = {"batch": 3, "seq": 7}


def _feeds(seed: int, vocab: int = 40, batch: int = 3, seq: int = 7) -> dict[str, np.ndarray]:
    """Token ids and a right-padded 0/1 mask (each row keeps at least its first token)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, seq + 1, batch)
    lengths[0] = seq - 2  # at least one row is padded
    return {"input_ids": rng.integers(0, vocab, (batch, seq)),
            "attention_mask": (np.arange(seq)[None] < lengths[:, None]).astype(np.int64)}


def _run(g, values, feeds) -> np.ndarray:
    ins = random_inputs(g, 0)
    ins.update(values)
    ins.update({k: v.astype(np.int32) for k, v in feeds.items()})
    return np.asarray(execute(g, ins)["last_hidden_state"])


def test_bert_block_equals_onnx_reference():
    m = onnx_models.bert_block()
    g, values = import_onnx(m, SHAPE)
    kernels = sorted(o.kernel for o in g.ops.values())
    assert kernels.count("index_to_float") == 1 and kernels.count("layernorm") == 3
    assert kernels.count("linear") == 6 and "gelu_erf" in kernels and "embedding" in kernels
    assert g.tensors["attention_mask"].dtype == "int32" and g.tensors["attention_mask"].role == "input"
    ref_eval = ReferenceEvaluator(m)
    for seed in (0, 1, 2):
        feeds = _feeds(seed)
        (ref,) = ref_eval.run(None, feeds)
        np.testing.assert_allclose(_run(g, values, feeds), ref, rtol=1e-5, atol=2e-5)
    # the mask matters: unmasking the padding changes the padded row, and the import follows
    feeds = _feeds(0)
    ones = {**feeds, "attention_mask": np.ones_like(feeds["attention_mask"])}
    (ref_ones,) = ref_eval.run(None, ones)
    assert np.abs(ref_ones - ref_eval.run(None, feeds)[0]).max() > 1e-2
    np.testing.assert_allclose(_run(g, values, ones), ref_ones, rtol=1e-5, atol=2e-5)


def test_bert_sharded_plans_verify_with_real_masks():
    g, values = import_onnx(onnx_models.bert_block(), SHAPE)
    mask = _feeds(3)["attention_mask"].astype(np.int32)
    vals = {**values, "attention_mask": mask}
    rng = np.random.default_rng(11)
    for _ in range(3):
        rep = verify(random_walk(g, rng, 4, 25), values=vals)
        assert rep.ok and np.isfinite(rep.max_rel_error), rep
    # data parallel over the batch of the mask conversion and the masked scores, heads split too
    cast = next(o.name for o in g.ops.values() if o.kernel == "index_to_float")
    add = next(o.name for o in g.ops.values() if o.kernel == "add" and len(g.tensors[o.output].shape) == 4)
    plan = place(split(g, cast, 0, 3), cast, [0, 1, 2])
    plan = place(split(plan, add, 1, 2), add, [1, 3])
    rep = verify(plan, values=vals)
    assert rep.ok, rep


def test_bert_block_trains():
    """The mask conversion reads an index port, so autodiff passes it by: the step has gradients for
    every initializer read by a float op and none for the mask, and a random plan of it verifies."""
    from ir.autodiff import training_step  # noqa: PLC0415

    g, values = import_onnx(onnx_models.bert_block(), {"batch": 2, "seq": 5})
    step = training_step(g, loss="mse", optimizer="sgd")
    assert "attention_mask.grad" not in step.tensors and "attention.self.query.W.next" in step.tensors
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    rep = verify(random_walk(step, np.random.default_rng(0), 4, 20), values={**values, "attention_mask": mask})
    assert rep.ok, rep


def _cast_model(nodes, in_type, out_type, out_shape):
    x = helper.make_tensor_value_info("x", in_type, [2, 3])
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", out_type, out_shape)]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_integer_casts_and_views():
    """int -> int keeps the tensor; a Reshape of ids that changes nothing leaves them integer ids
    (an embedding still reads them); a Transpose + Flatten of an int tensor then Cast runs on the
    float copy; a float -> int Cast is refused by name."""
    table = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(6, 2), "table")
    shape = numpy_helper.from_array(np.array([2, 3], np.int64), "same")
    m = _cast_model([helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT32),
                     helper.make_node("Reshape", ["xi", "same"], ["xr"]),
                     helper.make_node("Gather", ["table", "xr"], ["y"])], TensorProto.INT64, TensorProto.FLOAT, [2, 3, 2])
    m.graph.initializer.extend([table, shape])
    g, values = import_onnx(m)
    assert "index_to_float" not in {o.kernel for o in g.ops.values()}
    x = np.array([[0, 5, 2], [3, 3, 1]])
    np.testing.assert_array_equal(execute(g, {**values, "x": x.astype(np.int32)})["y"],
                                  ReferenceEvaluator(m).run(None, {"x": x})[0])

    m = _cast_model([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
                     helper.make_node("Flatten", ["t"], ["f"], axis=0),
                     helper.make_node("Cast", ["f"], ["c"], to=TensorProto.DOUBLE),
                     helper.make_node("Cast", ["c"], ["y"], to=TensorProto.FLOAT)],
                    TensorProto.INT64, TensorProto.FLOAT, [1, 6])
    g, values = import_onnx(m)
    assert [o.kernel for o in g.ops.values()] == ["index_to_float", "permute", "reshape"]
    x = np.array([[7, -2, 0], [1, 40000, 3]])
    np.testing.assert_array_equal(execute(g, {"x": x.astype(np.int32)})["y"], ReferenceEvaluator(m).run(None, {"x": x})[0])

    m = _cast_model([helper.make_node("Relu", ["x"], ["r"]),
                     helper.make_node("Cast", ["r"], ["y"], to=TensorProto.INT64, name="to_int")],
                    TensorProto.FLOAT, TensorProto.INT64, [2, 3])
    with pytest.raises(ImportFailure, match=r"Cast \(Cast of a computed float tensor to integer.*\): to_int"):
        import_onnx(m)


torch = pytest.importorskip("torch")


class TinyBert(torch.nn.Module):
    """One BERT layer in Hugging Face's shape: word + position embeddings (position ids a slice of
    a registered buffer), embedding LayerNorm, the extended attention mask from an int64
    ``attention_mask``, post-norm attention and an exact-GELU FFN."""

    def __init__(self, vocab: int = 50, d: int = 32, h: int = 4, ff: int = 64, max_pos: int = 16) -> None:
        super().__init__()
        self.h = h
        self.word, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(max_pos, d)
        self.register_buffer("position_ids", torch.arange(max_pos)[None])
        self.ln_e, self.ln1, self.ln2 = (torch.nn.LayerNorm(d, eps=1e-12) for _ in range(3))
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(d, ff), torch.nn.Linear(ff, d)

    def forward(self, input_ids, attention_mask):
        B, T = input_ids.shape
        x = self.ln_e(self.word(input_ids) + self.pos(self.position_ids[:, :T]))
        ext = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        C = x.shape[-1]
        q, k, v = (lin(x).view(B, T, self.h, C // self.h).transpose(1, 2) for lin in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.h) + ext, dim=-1)
        x = self.ln1(x + self.o((att @ v).transpose(1, 2).reshape(B, T, C)))
        return self.ln2(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def test_tiny_bert_from_torch_equals_module():
    from ir.importers.torch_export import import_torch  # noqa: PLC0415

    torch.manual_seed(0)
    m = TinyBert().eval()
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[0, 5:] = 0
    mask[1, 7:] = 0
    g, values = import_torch(m, {"input_ids": ids, "attention_mask": mask})
    assert "index_to_float" in {o.kernel for o in g.ops.values()}
    ins = random_inputs(g, 0)
    ins.update(values)
    for mk in (mask, torch.ones_like(mask)):
        ins["input_ids"], ins["attention_mask"] = ids.numpy().astype(np.int32), mk.numpy().astype(np.int32)
        with torch.no_grad():
            ref = m(ids, mk).numpy()
        np.testing.assert_allclose(execute(g, ins)["output"], ref, rtol=1e-5, atol=2e-5)
    rep = verify(random_walk(g, np.random.default_rng(5), 4, 20), values={**values, "attention_mask": mask.numpy()
                                                                          .astype(np.int32)})
    assert rep.ok, rep
