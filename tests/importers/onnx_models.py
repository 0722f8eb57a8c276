"""Small ONNX models written with ``onnx.helper``, in the shapes real exporters emit.

- ``mlp``: MatMul+Add, Relu, Gemm (transB), Tanh; batch is symbolic.
- ``gpt2_block``: LayerNormalization, one fused QKV MatMul+Add, Split, heads by
  Reshape (its target shape computed from Shape/Gather/Concat, as torch exports do)
  and Transpose, scaled scores (Div by √dh), a Trilu causal mask applied with Where, Softmax,
  output projection, residuals, and an MLP with the Erf GELU; batch and seq are symbolic.
- ``llama_block``: the RMSNorm sequence (Pow, ReduceMean, Add eps, Sqrt, Reciprocal, Mul, Mul
  gamma), bias-free projections, an additive -inf causal mask, SwiGLU (Sigmoid·x gate times up),
  residuals; token ids through a Gather embedding.
- ``convnet``: Conv with bias and padding, BatchNormalization, Relu, a ResNet-stem MaxPool (3x3,
  stride 2, padding 1), a second Conv,
  GlobalAveragePool, Flatten, Gemm.
- ``resnet_block``: a ResNet stem (Conv, BN, Relu, MaxPool 3x3/2) and one downsampling basic
  block: a 3x3 stride-2 Conv (``auto_pad=SAME_UPPER``, as TensorFlow exports pad), a 3x3 Conv, a
  1x1 stride-2 projection shortcut, batch norms, the residual Add; pooled to a Gemm head
  (output ``y``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _init(rng: np.random.Generator, name: str, shape, scale: float = 0.3, offset: float = 0.0):
    return numpy_helper.from_array((offset + scale * rng.standard_normal(shape)).astype(np.float32), name)


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name + "_v"))


def _erf_gelu(x: str, y: str, scope: str) -> list[onnx.NodeProto]:
    """``y = 0.5 · x · (1 + erf(x / √2))`` as PyTorch's exact GELU exports it (the importer's
    Gelu/Erf pattern); intermediate names ``fd``, ``fe``, ``fa``, ``fm``."""
    n = helper.make_node
    return [
        _const("sqrt2", np.array(np.sqrt(2.0), np.float32)),
        n("Div", [x, "sqrt2"], ["fd"], name=f"{scope}/Div"),
        n("Erf", ["fd"], ["fe"], name=f"{scope}/Erf"),
        _const("c1", np.array(1.0, np.float32)),
        n("Add", ["fe", "c1"], ["fa"], name=f"{scope}/Add"),
        n("Mul", [x, "fa"], ["fm"], name=f"{scope}/Mul"),
        _const("half", np.array(0.5, np.float32)),
        n("Mul", ["fm", "half"], [y], name=f"{scope}/Mul_1"),
    ]


def _model(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def mlp(d_in: int = 16, d_h: int = 32, d_out: int = 8, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [_init(rng, "W1", (d_in, d_h)), _init(rng, "b1", (d_h,)), _init(rng, "W2t", (d_h, d_h)),
             _init(rng, "b2", (d_h,)), _init(rng, "W3", (d_h, d_out)), _init(rng, "b3", (d_out,))]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"], name="fc1"),
        helper.make_node("Add", ["h1", "b1"], ["h1b"], name="fc1_bias"),
        helper.make_node("Relu", ["h1b"], ["a1"], name="act1"),
        helper.make_node("Gemm", ["a1", "W2t", "b2"], ["h2"], name="fc2", transB=1),
        helper.make_node("Tanh", ["h2"], ["a2"], name="act2"),
        helper.make_node("MatMul", ["a2", "W3"], ["h3"], name="fc3"),
        helper.make_node("Add", ["h3", "b3"], ["y"], name="fc3_bias"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", d_in])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", d_out])], inits)


def gpt2_block(d: int = 16, heads: int = 2, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    dh = d // heads
    inits = [_init(rng, "ln1.g", (d,), 0.1, 1.0), _init(rng, "ln1.b", (d,), 0.1),
             _init(rng, "attn.c_attn.W", (d, 3 * d)), _init(rng, "attn.c_attn.b", (3 * d,), 0.1),
             _init(rng, "attn.c_proj.W", (d, d)), _init(rng, "attn.c_proj.b", (d,), 0.1),
             _init(rng, "ln2.g", (d,), 0.1, 1.0), _init(rng, "ln2.b", (d,), 0.1),
             _init(rng, "mlp.c_fc.W", (d, 4 * d)), _init(rng, "mlp.c_fc.b", (4 * d,), 0.1),
             _init(rng, "mlp.c_proj.W", (4 * d, d)), _init(rng, "mlp.c_proj.b", (d,), 0.1)]
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln1.g", "ln1.b"], ["ln1"], name="/h.0/ln_1/LayerNorm", epsilon=1e-5),
        n("MatMul", ["ln1", "attn.c_attn.W"], ["qkv0"], name="/h.0/attn/c_attn/MatMul"),
        n("Add", ["qkv0", "attn.c_attn.b"], ["qkv"], name="/h.0/attn/c_attn/Add"),
        _const("split_sizes", np.array([d, d, d], np.int64)),
        n("Split", ["qkv", "split_sizes"], ["q", "k", "v"], name="/h.0/attn/Split", axis=2),
        # the heads shape from Shape/Gather/Concat, as torch.onnx.export writes it
        n("Shape", ["x"], ["xs"], name="/h.0/attn/Shape"),
        _const("i0", np.array(0, np.int64)), _const("i1", np.array(1, np.int64)),
        n("Gather", ["xs", "i0"], ["B"], name="/h.0/attn/Gather_B", axis=0),
        n("Gather", ["xs", "i1"], ["S"], name="/h.0/attn/Gather_S", axis=0),
        _const("ax0", np.array([0], np.int64)),
        n("Unsqueeze", ["B", "ax0"], ["B1"], name="/h.0/attn/Unsqueeze_B"),
        n("Unsqueeze", ["S", "ax0"], ["S1"], name="/h.0/attn/Unsqueeze_S"),
        _const("hd", np.array([heads, dh], np.int64)),
        n("Concat", ["B1", "S1", "hd"], ["heads_shape"], name="/h.0/attn/Concat_shape", axis=0),
        _const("merge_shape", np.array([0, 0, d], np.int64)),
    ]
    for t in ("q", "k", "v"):
        nodes.append(n("Reshape", [t, "heads_shape"], [f"{t}4"], name=f"/h.0/attn/Reshape_{t}"))
    nodes += [
        n("Transpose", ["q4"], ["qh"], name="/h.0/attn/Transpose_q", perm=[0, 2, 1, 3]),
        n("Transpose", ["k4"], ["kT"], name="/h.0/attn/Transpose_k", perm=[0, 2, 3, 1]),
        n("Transpose", ["v4"], ["vh"], name="/h.0/attn/Transpose_v", perm=[0, 2, 1, 3]),
        n("MatMul", ["qh", "kT"], ["sc"], name="/h.0/attn/MatMul_qk"),
        _const("sqrt_dh", np.array(np.sqrt(dh), np.float32)),
        n("Div", ["sc", "sqrt_dh"], ["scs"], name="/h.0/attn/Div"),
        # causal mask: ones(S, S) -> Trilu -> Cast(bool), all constant after binding seq
        _const("one", np.array([1.0], np.float32)),
        n("Concat", ["S1", "S1"], ["SS"], name="/h.0/attn/Concat_SS", axis=0),
        n("Expand", ["one", "SS"], ["ones"], name="/h.0/attn/Expand"),
        n("Trilu", ["ones"], ["tril"], name="/h.0/attn/Trilu", upper=0),
        n("Cast", ["tril"], ["mask"], name="/h.0/attn/Cast", to=TensorProto.BOOL),
        _const("neg", np.array(np.finfo(np.float32).min, np.float32)),
        n("Where", ["mask", "scs", "neg"], ["masked"], name="/h.0/attn/Where"),
        n("Softmax", ["masked"], ["p"], name="/h.0/attn/Softmax", axis=-1),
        n("MatMul", ["p", "vh"], ["ctx"], name="/h.0/attn/MatMul_pv"),
        n("Transpose", ["ctx"], ["ctxT"], name="/h.0/attn/Transpose_ctx", perm=[0, 2, 1, 3]),
        n("Reshape", ["ctxT", "merge_shape"], ["ctx3"], name="/h.0/attn/Reshape_merge"),
        n("MatMul", ["ctx3", "attn.c_proj.W"], ["o0"], name="/h.0/attn/c_proj/MatMul"),
        n("Add", ["o0", "attn.c_proj.b"], ["o"], name="/h.0/attn/c_proj/Add"),
        n("Add", ["x", "o"], ["r1"], name="/h.0/Add_resid1"),
        n("LayerNormalization", ["r1", "ln2.g", "ln2.b"], ["ln2"], name="/h.0/ln_2/LayerNorm", epsilon=1e-5),
        n("MatMul", ["ln2", "mlp.c_fc.W"], ["f0"], name="/h.0/mlp/c_fc/MatMul"),
        n("Add", ["f0", "mlp.c_fc.b"], ["f"], name="/h.0/mlp/c_fc/Add"),
        *_erf_gelu("f", "g", "/h.0/mlp/act"),
        n("MatMul", ["g", "mlp.c_proj.W"], ["m0"], name="/h.0/mlp/c_proj/MatMul"),
        n("Add", ["m0", "mlp.c_proj.b"], ["m"], name="/h.0/mlp/c_proj/Add"),
        n("Add", ["r1", "m"], ["y"], name="/h.0/Add_resid2"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", d])], inits)


def llama_block(vocab: int = 32, d: int = 16, heads: int = 2, d_ff: int = 24, seq: int = 8,
                seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    dh = d // heads
    inits = [_init(rng, "embed_tokens", (vocab, d), 1.0), _init(rng, "input_layernorm.weight", (d,), 0.1, 1.0),
             _init(rng, "q_proj", (d, d)), _init(rng, "k_proj", (d, d)), _init(rng, "v_proj", (d, d)),
             _init(rng, "o_proj", (d, d)), _init(rng, "post_attention_layernorm.weight", (d,), 0.1, 1.0),
             _init(rng, "gate_proj", (d, d_ff)), _init(rng, "up_proj", (d, d_ff)), _init(rng, "down_proj", (d_ff, d))]
    mask = np.triu(np.full((seq, seq), -np.inf, np.float32), 1)[None, None]
    inits.append(numpy_helper.from_array(mask, "causal_mask"))
    n = helper.make_node

    def rmsnorm(x, w, tag):
        return [
            _const(f"{tag}.two", np.array(2.0, np.float32)),
            n("Pow", [x, f"{tag}.two"], [f"{tag}.sq"], name=f"{tag}/Pow"),
            n("ReduceMean", [f"{tag}.sq"], [f"{tag}.ms"], name=f"{tag}/ReduceMean", axes=[-1], keepdims=1),
            _const(f"{tag}.eps", np.array(1e-6, np.float32)),
            n("Add", [f"{tag}.ms", f"{tag}.eps"], [f"{tag}.mse"], name=f"{tag}/Add"),
            n("Sqrt", [f"{tag}.mse"], [f"{tag}.rms"], name=f"{tag}/Sqrt"),
            n("Reciprocal", [f"{tag}.rms"], [f"{tag}.inv"], name=f"{tag}/Reciprocal"),
            n("Mul", [x, f"{tag}.inv"], [f"{tag}.n"], name=f"{tag}/Mul"),
            n("Mul", [w, f"{tag}.n"], [f"{tag}.out"], name=f"{tag}/Mul_1"),
        ]

    nodes = [n("Gather", ["embed_tokens", "input_ids"], ["h0"], name="/embed_tokens/Gather")]
    nodes += rmsnorm("h0", "input_layernorm.weight", "/input_layernorm")
    nodes += [_const("heads_shape", np.array([0, 0, heads, dh], np.int64)),
              _const("merge_shape", np.array([0, 0, d], np.int64))]
    for t in ("q", "k", "v"):
        nodes += [n("MatMul", ["/input_layernorm.out", f"{t}_proj"], [t], name=f"/self_attn/{t}_proj/MatMul"),
                  n("Reshape", [t, "heads_shape"], [f"{t}4"], name=f"/self_attn/Reshape_{t}"),
                  n("Transpose", [f"{t}4"], [f"{t}h"], name=f"/self_attn/Transpose_{t}", perm=[0, 2, 1, 3])]
    nodes += [
        n("Transpose", ["kh"], ["kT"], name="/self_attn/Transpose_kT", perm=[0, 1, 3, 2]),
        n("MatMul", ["qh", "kT"], ["sc"], name="/self_attn/MatMul_qk"),
        _const("inv_sqrt_dh", np.array(1.0 / np.sqrt(dh), np.float32)),
        n("Mul", ["sc", "inv_sqrt_dh"], ["scs"], name="/self_attn/Mul_scale"),
        n("Add", ["scs", "causal_mask"], ["masked"], name="/self_attn/Add_mask"),
        n("Softmax", ["masked"], ["p"], name="/self_attn/Softmax", axis=-1),
        n("MatMul", ["p", "vh"], ["ctx"], name="/self_attn/MatMul_pv"),
        n("Transpose", ["ctx"], ["ctxT"], name="/self_attn/Transpose_ctx", perm=[0, 2, 1, 3]),
        n("Reshape", ["ctxT", "merge_shape"], ["ctx3"], name="/self_attn/Reshape_merge"),
        n("MatMul", ["ctx3", "o_proj"], ["o"], name="/self_attn/o_proj/MatMul"),
        n("Add", ["h0", "o"], ["r1"], name="/Add_resid1"),
    ]
    nodes += rmsnorm("r1", "post_attention_layernorm.weight", "/post_attention_layernorm")
    nodes += [
        n("MatMul", ["/post_attention_layernorm.out", "gate_proj"], ["gt"], name="/mlp/gate_proj/MatMul"),
        n("Sigmoid", ["gt"], ["gs"], name="/mlp/act_fn/Sigmoid"),
        n("Mul", ["gt", "gs"], ["ga"], name="/mlp/act_fn/Mul"),
        n("MatMul", ["/post_attention_layernorm.out", "up_proj"], ["up"], name="/mlp/up_proj/MatMul"),
        n("Mul", ["ga", "up"], ["gu"], name="/mlp/Mul"),
        n("MatMul", ["gu", "down_proj"], ["dn"], name="/mlp/down_proj/MatMul"),
        n("Add", ["r1", "dn"], ["hidden"], name="/Add_resid2"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq])],
                  [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", seq, d])], inits)


def convnet(c_in: int = 3, c: int = 8, size: int = 8, classes: int = 5, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [_init(rng, "conv1.w", (c, c_in, 3, 3)), _init(rng, "conv1.b", (c,), 0.1),
             _init(rng, "bn1.scale", (c,), 0.1, 1.0), _init(rng, "bn1.bias", (c,), 0.1),
             _init(rng, "bn1.mean", (c,), 0.1), numpy_helper.from_array(
                 rng.uniform(0.5, 1.5, c).astype(np.float32), "bn1.var"),
             _init(rng, "conv2.w", (c, c, 3, 3)), _init(rng, "fc.W", (classes, c)), _init(rng, "fc.b", (classes,))]
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "conv1.w", "conv1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        n("BatchNormalization", ["c1", "bn1.scale", "bn1.bias", "bn1.mean", "bn1.var"], ["b1"], name="bn1",
          epsilon=1e-5),
        n("Relu", ["b1"], ["r1"], name="relu1"),
        n("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        n("Conv", ["p1", "conv2.w"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        n("Relu", ["c2"], ["r2"], name="relu2"),
        n("GlobalAveragePool", ["r2"], ["gap"], name="gap"),
        n("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        n("Gemm", ["flat", "fc.W", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c_in, size, size])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])], inits)


def resnet_block(c_in: int = 3, c: int = 4, size: int = 9, classes: int = 5, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits, n = [], helper.make_node

    def bn(x: str, y: str, ch: int, tag: str) -> onnx.NodeProto:
        inits.extend([_init(rng, f"{tag}.scale", (ch,), 0.1, 1.0), _init(rng, f"{tag}.bias", (ch,), 0.1),
                      _init(rng, f"{tag}.mean", (ch,), 0.1),
                      numpy_helper.from_array(rng.uniform(0.5, 1.5, ch).astype(np.float32), f"{tag}.var")])
        return n("BatchNormalization", [x, f"{tag}.scale", f"{tag}.bias", f"{tag}.mean", f"{tag}.var"], [y], name=tag)

    inits += [_init(rng, "stem.w", (c, c_in, 3, 3)), _init(rng, "b1.w", (2 * c, c, 3, 3)),
              _init(rng, "b2.w", (2 * c, 2 * c, 3, 3)), _init(rng, "down.w", (2 * c, c, 1, 1)),
              _init(rng, "fc.W", (classes, 2 * c)), _init(rng, "fc.b", (classes,))]
    nodes = [
        n("Conv", ["x", "stem.w"], ["s"], name="stem", pads=[1, 1, 1, 1]), bn("s", "sb", c, "stem.bn"),
        n("Relu", ["sb"], ["sr"], name="stem.relu"),
        n("MaxPool", ["sr"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        n("Conv", ["p", "b1.w"], ["c1"], name="b1", strides=[2, 2], auto_pad="SAME_UPPER"),
        bn("c1", "c1b", 2 * c, "b1.bn"),
        n("Relu", ["c1b"], ["c1r"], name="b1.relu"),
        n("Conv", ["c1r", "b2.w"], ["c2"], name="b2", pads=[1, 1, 1, 1]), bn("c2", "c2b", 2 * c, "b2.bn"),
        n("Conv", ["p", "down.w"], ["d"], name="down", strides=[2, 2]), bn("d", "db", 2 * c, "down.bn"),
        n("Add", ["c2b", "db"], ["r"], name="residual"), n("Relu", ["r"], ["rr"], name="out.relu"),
        n("GlobalAveragePool", ["rr"], ["gap"], name="gap"), n("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        n("Gemm", ["flat", "fc.W", "fc.b"], ["y"], name="fc", transB=1),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c_in, size, size])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", classes])], inits)


def bert_block(vocab: int = 40, d: int = 16, heads: int = 2, d_ff: int = 32, max_pos: int = 32,
               seed: int = 0) -> onnx.ModelProto:
    """A BERT encoder layer as Hugging Face's ``BertModel`` exports it: token + position + token-type
    embeddings (the position ids a ``Slice`` of a registered ``arange`` buffer to the runtime
    sequence length, the token types a zeros buffer, so both fold to constants), embedding
    LayerNorm, multi-head self-attention with the padding mask
    ``(1 - attention_mask[:, None, None, :].float()) * -10000`` added to the scores, post-norm
    residuals and an Erf-GELU FFN. ``input_ids`` and ``attention_mask`` are int64 ``[batch, seq]``."""
    rng = np.random.default_rng(seed)
    dh = d // heads
    inits = [_init(rng, "embeddings.word_embeddings.weight", (vocab, d), 1.0),
             _init(rng, "embeddings.position_embeddings.weight", (max_pos, d), 0.5),
             _init(rng, "embeddings.token_type_embeddings.weight", (2, d), 0.5),
             numpy_helper.from_array(np.arange(max_pos, dtype=np.int64)[None], "embeddings.position_ids"),
             _init(rng, "embeddings.LayerNorm.weight", (d,), 0.1, 1.0),
             _init(rng, "embeddings.LayerNorm.bias", (d,), 0.1)]
    for t in ("query", "key", "value"):
        inits += [_init(rng, f"attention.self.{t}.W", (d, d)), _init(rng, f"attention.self.{t}.bias", (d,), 0.1)]
    inits += [_init(rng, "attention.output.dense.W", (d, d)), _init(rng, "attention.output.dense.bias", (d,), 0.1),
              _init(rng, "attention.output.LayerNorm.weight", (d,), 0.1, 1.0),
              _init(rng, "attention.output.LayerNorm.bias", (d,), 0.1),
              _init(rng, "intermediate.dense.W", (d, d_ff)), _init(rng, "intermediate.dense.bias", (d_ff,), 0.1),
              _init(rng, "output.dense.W", (d_ff, d)), _init(rng, "output.dense.bias", (d,), 0.1),
              _init(rng, "output.LayerNorm.weight", (d,), 0.1, 1.0), _init(rng, "output.LayerNorm.bias", (d,), 0.1)]
    n = helper.make_node
    nodes = [
        n("Gather", ["embeddings.word_embeddings.weight", "input_ids"], ["we"], name="/embeddings/word/Gather"),
        # position ids: position_ids[:, :seq] (seq from Shape, folded once bound)
        n("Shape", ["input_ids"], ["ids_shape"], name="/embeddings/Shape"),
        _const("one_i", np.array([1], np.int64)), _const("two_i", np.array([2], np.int64)),
        _const("zero_i", np.array([0], np.int64)),
        n("Slice", ["ids_shape", "one_i", "two_i"], ["seq_len"], name="/embeddings/Slice_seq"),
        n("Slice", ["embeddings.position_ids", "zero_i", "seq_len", "one_i"], ["pos_ids"],
          name="/embeddings/Slice_pos"),
        n("Gather", ["embeddings.position_embeddings.weight", "pos_ids"], ["pe"], name="/embeddings/position/Gather"),
        n("ConstantOfShape", ["ids_shape"], ["tt_ids"], name="/embeddings/ConstantOfShape",
          value=numpy_helper.from_array(np.array([0], np.int64), "zero_v")),
        n("Gather", ["embeddings.token_type_embeddings.weight", "tt_ids"], ["te"], name="/embeddings/type/Gather"),
        n("Add", ["we", "te"], ["e1"], name="/embeddings/Add"),
        n("Add", ["e1", "pe"], ["e2"], name="/embeddings/Add_1"),
        n("LayerNormalization", ["e2", "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"], ["h0"],
          name="/embeddings/LayerNorm", epsilon=1e-12),
        # extended attention mask
        n("Unsqueeze", ["attention_mask", "one_i"], ["m1"], name="/Unsqueeze"),
        n("Unsqueeze", ["m1", "two_i"], ["m2"], name="/Unsqueeze_1"),
        n("Cast", ["m2"], ["mf"], name="/Cast", to=TensorProto.FLOAT),
        _const("one_f", np.array(1.0, np.float32)),
        n("Sub", ["one_f", "mf"], ["inv"], name="/Sub"),
        _const("big_neg", np.array(-10000.0, np.float32)),
        n("Mul", ["inv", "big_neg"], ["ext_mask"], name="/Mul"),
        _const("heads_shape", np.array([0, 0, heads, dh], np.int64)),
        _const("merge_shape", np.array([0, 0, d], np.int64)),
    ]
    for t in ("query", "key", "value"):
        nodes += [n("MatMul", ["h0", f"attention.self.{t}.W"], [f"{t}0"], name=f"/attention/self/{t}/MatMul"),
                  n("Add", [f"{t}0", f"attention.self.{t}.bias"], [t], name=f"/attention/self/{t}/Add"),
                  n("Reshape", [t, "heads_shape"], [f"{t}4"], name=f"/attention/self/Reshape_{t}")]
    nodes += [
        n("Transpose", ["query4"], ["qh"], name="/attention/self/Transpose_q", perm=[0, 2, 1, 3]),
        n("Transpose", ["key4"], ["kT"], name="/attention/self/Transpose_k", perm=[0, 2, 3, 1]),
        n("Transpose", ["value4"], ["vh"], name="/attention/self/Transpose_v", perm=[0, 2, 1, 3]),
        n("MatMul", ["qh", "kT"], ["sc"], name="/attention/self/MatMul_qk"),
        _const("sqrt_dh", np.array(np.sqrt(dh), np.float32)),
        n("Div", ["sc", "sqrt_dh"], ["scs"], name="/attention/self/Div"),
        n("Add", ["scs", "ext_mask"], ["masked"], name="/attention/self/Add_mask"),
        n("Softmax", ["masked"], ["p"], name="/attention/self/Softmax", axis=-1),
        n("MatMul", ["p", "vh"], ["ctx"], name="/attention/self/MatMul_pv"),
        n("Transpose", ["ctx"], ["ctxT"], name="/attention/self/Transpose_ctx", perm=[0, 2, 1, 3]),
        n("Reshape", ["ctxT", "merge_shape"], ["ctx3"], name="/attention/self/Reshape_merge"),
        n("MatMul", ["ctx3", "attention.output.dense.W"], ["ao0"], name="/attention/output/dense/MatMul"),
        n("Add", ["ao0", "attention.output.dense.bias"], ["ao"], name="/attention/output/dense/Add"),
        n("Add", ["ao", "h0"], ["r1"], name="/attention/output/Add"),
        n("LayerNormalization", ["r1", "attention.output.LayerNorm.weight", "attention.output.LayerNorm.bias"],
          ["h1"], name="/attention/output/LayerNorm", epsilon=1e-12),
        n("MatMul", ["h1", "intermediate.dense.W"], ["f0"], name="/intermediate/dense/MatMul"),
        n("Add", ["f0", "intermediate.dense.bias"], ["f"], name="/intermediate/dense/Add"),
        *_erf_gelu("f", "g", "/intermediate/act"),
        n("MatMul", ["g", "output.dense.W"], ["o0"], name="/output/dense/MatMul"),
        n("Add", ["o0", "output.dense.bias"], ["o"], name="/output/dense/Add"),
        n("Add", ["o", "h1"], ["r2"], name="/output/Add"),
        n("LayerNormalization", ["r2", "output.LayerNorm.weight", "output.LayerNorm.bias"], ["last_hidden_state"],
          name="/output/LayerNorm", epsilon=1e-12),
    ]
    ids = [helper.make_tensor_value_info(x, TensorProto.INT64, ["batch", "seq"]) for x in ("input_ids", "attention_mask")]
    return _model(nodes, ids, [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT,
                                                             ["batch", "seq", d])], inits)


def weight(name: str, shape, seed: int = 0) -> onnx.TensorProto:
    """A random float32 initializer (standard normal × 0.5)."""
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.5, name)


def check_import(m: onnx.ModelProto, params: dict, kernels=(), exact: bool = False, walks: int = 1,
                 walk_seed: int = 4):
    """Import ``m`` (input ``x``, output ``y``), check it against ``onnx.reference`` on two random
    inputs, check the kernels it maps to (``exact``: exactly ``kernels``, else at least them), and
    verify ``walks`` random sharded plans of it (4 devices). Returns ``(graph, values)``."""
    from onnx.reference import ReferenceEvaluator

    from executor import verify
    from executor.run import execute, random_inputs
    from ir.importers.onnx import import_onnx
    from ir.rewrites import random_walk

    g, values = import_onnx(m, params)
    for seed in (0, 1):
        ins = random_inputs(g, seed)
        ins.update(values)
        got = np.asarray(execute(g, ins)["y"])
        (ref,) = ReferenceEvaluator(m).run(None, {"x": ins["x"]})
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    got_kernels = {o.kernel for o in g.ops.values()}
    if exact:
        assert got_kernels == set(kernels)
    else:
        assert set(kernels) <= got_kernels
    rng = np.random.default_rng(walk_seed)
    for _ in range(walks):
        rep = verify(random_walk(g, rng, 4, 20), values=values)
        assert rep.ok, rep
    return g, values


def check_reference(m: onnx.ModelProto, inputs: dict, kernels=(), walks: int = 2, ref=None):
    """Import ``m`` (output ``y``) and compare it with ``onnx.reference`` (or ``ref(feed)``) on two
    feeds of its ``inputs`` (name -> shape, drawn standard normal per seed, or -> a fixed array);
    check it maps to at least ``kernels`` and verify ``walks`` random sharded plans (4 devices).
    Returns ``(graph, values)``."""
    from onnx.reference import ReferenceEvaluator

    from executor import verify
    from executor.run import execute
    from ir.importers.onnx import import_onnx
    from ir.rewrites import random_walk

    g, vals = import_onnx(m, {})
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        feed = {n: s if isinstance(s, np.ndarray) else rng.standard_normal(s).astype(np.float32)
                for n, s in inputs.items()}
        want = ReferenceEvaluator(m).run(None, feed)[0] if ref is None else ref(feed)
        got = np.asarray(execute(g, {**feed, **vals})["y"])
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    got_kernels = {o.kernel for o in g.ops.values()}
    assert set(kernels) <= got_kernels, sorted(got_kernels)
    rng = np.random.default_rng(4)
    for _ in range(walks):
        rep = verify(random_walk(g, rng, 4, 20), values=vals)
        assert rep.ok, rep
    return g, vals


def check_refused(m: onnx.ModelProto, *says: str) -> str:
    """Importing ``m`` fails with an ``ImportFailure`` whose message holds each of ``says``;
    returns the message."""
    import pytest

    from ir.importers.errors import ImportFailure
    from ir.importers.onnx import import_onnx

    with pytest.raises(ImportFailure) as e:
        import_onnx(m, {})
    msg = str(e.value)
    for s in says:
        assert s in msg, msg
    return msg


def check_central_differences(g, vals: dict, shape, wrt=("W",), seed: int = 3):
    """The training step (mse, SGD) of imported ``g`` (input ``x`` of ``shape``, output ``y``): the
    gradients of ``wrt`` equal central differences of its loss (h = 1e-6, float64) and are not all
    zero. Returns the step."""
    from executor.run import execute
    from ir.autodiff import training_step

    step = training_step(g, loss="mse", optimizer="sgd")
    rng = np.random.default_rng(seed)
    out_shape = g.tensors["y"].shape
    feed = {**{k: v.astype(np.float64) for k, v in vals.items()}, "x": rng.standard_normal(shape),
            "target": rng.standard_normal(out_shape)}
    env = execute(step, feed, precision="float64")
    for name in wrt:
        grad = np.asarray(env[f"{name}.grad"])
        fd = np.zeros_like(grad)
        for idx in np.ndindex(*grad.shape):
            loss = []
            for h in (1e-6, -1e-6):
                w = feed[name].copy()
                w[idx] += h
                loss.append(float(execute(step, {**feed, name: w}, precision="float64")["loss"][0]))
            fd[idx] = (loss[0] - loss[1]) / 2e-6
        assert np.abs(grad).max() > 1e-4, name
        np.testing.assert_allclose(grad, fd, rtol=0, atol=1e-6 * np.abs(fd).max() + 1e-9, err_msg=name)
    return step
