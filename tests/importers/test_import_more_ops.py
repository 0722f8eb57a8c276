"""Clip, LeakyRelu, Softplus, LogSoftmax and ``torch.nn.RMSNorm`` import.

ONNX models built with ``onnx.helper`` equal ``onnx.reference`` (and their random sharded plans
verify); PyTorch modules using ``clamp``, ``ReLU6``, ``Hardtanh``, ``LeakyReLU``, ``Softplus``,
``log_softmax`` + NLL and ``nn.RMSNorm`` equal the module forward, and their training steps'
gradients equal ``torch.autograd``'s (torch tests skip without torch). A Clip bound the model
computes is refused with the node's name.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import onnx_models  # noqa: E402
from torch_checks import check_against_torch, kernels_of, needs_torch, net, torch  # noqa: E402
from executor.run import execute  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.errors import ImportFailure  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.kernels import SignatureError, TensorSpec, get_kernel  # noqa: E402

N = helper.make_node


def _model(nodes, inits=(), shape=(4, 6), opset=17):
    """Input ``x`` (float32 ``shape``), output ``y``, weights ``W`` [6, 6] and ``b`` [6] available."""
    inits = list(inits) + [onnx_models.weight("W", (shape[-1], shape[-1]), seed=1), onnx_models.weight("b", (shape[-1],))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _c(name, value):
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _fc(out="h"):
    """``h = x @ W + b``: the op under test reads a computed tensor, as in a real model."""
    return [N("MatMul", ["x", "W"], ["xw"], name="fc"), N("Add", ["xw", "b"], [out], name="fc_bias")]


# -- ONNX models against onnx.reference ------------------------------------------------------------

CLIP_CASES = {
    # name: (nodes after fc, inits, opset, the clip op's params)
    "both_bounds_inputs": ([N("Clip", ["h", "lo", "hi"], ["y"], name="clip")],
                           [_c("lo", -0.3), _c("hi", 0.4)], 17, {"min": -0.3, "max": 0.4}),
    "min_only": ([N("Clip", ["h", "lo"], ["y"], name="clip")], [_c("lo", 0.1)], 17, {"min": 0.1}),
    "max_only": ([N("Clip", ["h", "", "hi"], ["y"], name="clip")], [_c("hi", -0.2)], 13, {"max": -0.2}),
    "infinite_max": ([N("Clip", ["h", "lo", "hi"], ["y"], name="clip")], [_c("lo", -0.5), _c("hi", np.inf)], 17,
                     {"min": -0.5}),
    "constant_nodes": ([N("Constant", [], ["lo"], value=_c("lo_v", 0.0)), N("Constant", [], ["hi"], value=_c("hi_v", 6.0)),
                        N("Mul", ["h", "four"], ["h4"], name="x4"),
                        N("Clip", ["h4", "lo", "hi"], ["y"], name="relu6")], [_c("four", 4.0)], 17,
                       {"min": 0.0, "max": 6.0}),
    "opset6_attributes": ([N("Clip", ["h"], ["y"], name="clip", min=-0.25, max=0.5)], [], 6,
                          {"min": -0.25, "max": 0.5}),
    "opset6_min_attribute_only": ([N("Clip", ["h"], ["y"], name="clip", min=0.0)], [], 6, {"min": 0.0}),
}


@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_clip_equals_the_onnx_reference(case):
    nodes, inits, opset, params = CLIP_CASES[case]
    m = _model(_fc() + nodes, inits, opset=opset)
    g, _ = onnx_models.check_import(m, {}, {"clip"})
    (clip,) = [o for o in g.ops.values() if o.kernel == "clip"]
    # constant bounds are parameters (float32 values); an absent or infinite one is none
    assert clip.params == pytest.approx(params, rel=1e-7)
    # the bounds bite: some cells are clipped, some pass (so the comparison above means something)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    (y,) = ReferenceEvaluator(m).run(None, {"x": x})
    h = execute(g, {"x": x, **import_onnx(m, {})[1]})["y"]
    np.testing.assert_allclose(h, y, rtol=1e-6, atol=1e-6)
    bounds = np.float32(list(params.values()))
    assert np.isin(y, bounds).any() and (~np.isin(y, bounds)).any()


def test_clip_without_bounds_is_its_input():
    m = _model(_fc() + [N("Clip", ["h"], ["c"], name="clip"), N("Tanh", ["c"], ["y"], name="act")])
    g, _ = onnx_models.check_import(m, {}, {"tanh"})
    assert "clip" not in kernels_of(g)


@pytest.mark.parametrize("alpha", [None, 0.2, -0.5])
def test_leaky_relu_equals_the_onnx_reference(alpha):
    kw = {} if alpha is None else {"alpha": alpha}
    m = _model(_fc() + [N("LeakyRelu", ["h"], ["y"], name="act", **kw)])
    g, _ = onnx_models.check_import(m, {}, {"leaky_relu"})
    (op,) = [o for o in g.ops.values() if o.kernel == "leaky_relu"]
    assert op.params["alpha"] == pytest.approx(0.01 if alpha is None else alpha)  # ONNX's default slope


def test_softplus_equals_the_onnx_reference_and_stays_finite_far_out():
    m = _model(_fc() + [N("Softplus", ["h"], ["y"], name="act")])
    onnx_models.check_import(m, {}, {"softplus"})
    # log(1 + e^x) written naively overflows at x = 89 in float32; the kernel's is x there, e^x far left
    m = _model([N("Softplus", ["x"], ["y"], name="act")], shape=(1, 4))
    g, vals = import_onnx(m, {})
    x = np.array([[-80.0, -20.0, 20.0, 100.0]], np.float32)
    y = execute(g, {"x": x, **vals})["y"]
    want = np.array([[np.exp(-80.0), np.log1p(np.exp(-20.0)), 20.0 + np.log1p(np.exp(-20.0)), 100.0]])
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, want, rtol=1e-6)


@pytest.mark.parametrize("axis,opset,shape,kernels", [
    (None, 17, (4, 6), {"log_softmax"}),
    (-1, 13, (2, 3, 6), {"log_softmax"}),
    (1, 17, (2, 3, 6), {"log_softmax", "permute"}),  # another axis: a permute to the last and back
    (0, 17, (2, 3, 6), {"log_softmax", "permute"}),
])
def test_log_softmax_equals_the_onnx_reference(axis, opset, shape, kernels):
    kw = {} if axis is None else {"axis": axis}
    m = _model(_fc() + [N("LogSoftmax", ["h"], ["y"], name="logp", **kw)], shape=shape, opset=opset)
    onnx_models.check_import(m, {}, kernels)


def test_log_softmax_opset11_flattens_from_axis():
    """Before opset 13 ``axis`` means the dims from it on taken as one row (the operator spec;
    ``onnx.reference`` applies the opset-13 rule to every opset, so the reference is NumPy)."""
    m = _model([N("LogSoftmax", ["x"], ["y"], name="logp", axis=1)], shape=(2, 3, 4), opset=11)
    g, vals = import_onnx(m, {})
    x = np.random.default_rng(2).standard_normal((2, 3, 4)).astype(np.float32)
    rows = x.reshape(2, 12).astype(np.float64)
    ref = (rows - np.log(np.exp(rows).sum(1, keepdims=True))).reshape(2, 3, 4)
    np.testing.assert_allclose(execute(g, {"x": x, **vals})["y"], ref, rtol=1e-5, atol=1e-6)
    assert {"log_softmax", "reshape"} <= set(kernels_of(g))


def test_log_softmax_of_large_logits_is_finite():
    m = _model([N("LogSoftmax", ["x"], ["y"], name="logp")], shape=(1, 3))
    g, vals = import_onnx(m, {})
    y = execute(g, {"x": np.array([[1000.0, 0.0, -1000.0]], np.float32), **vals})["y"]
    np.testing.assert_allclose(y, [[0.0, -1000.0, -2000.0]], rtol=1e-6)


def test_imported_activations_train_and_their_gradients_equal_finite_differences():
    """One program with all four: the training step's weight gradient equals central differences
    of its loss (float64), so each new VJP rule is wired through an imported graph."""
    nodes = _fc() + [N("Clip", ["h", "lo", "hi"], ["c"], name="clip"), N("LeakyRelu", ["h"], ["l"], name="leaky", alpha=0.1),
                     N("Softplus", ["h"], ["s"], name="softplus"), N("Add", ["c", "l"], ["cl"], name="add1"),
                     N("Add", ["cl", "s"], ["z"], name="add2"), N("LogSoftmax", ["z"], ["y"], name="logp")]
    g, vals = import_onnx(_model(nodes, [_c("lo", -0.3), _c("hi", 0.4)]), {})
    step = training_step(g, loss="mse", optimizer="sgd")
    rng = np.random.default_rng(1)
    feed = {**{k: v.astype(np.float64) for k, v in vals.items()}, "x": rng.standard_normal((4, 6)),
            "target": rng.standard_normal((4, 6))}
    env = execute(step, feed, precision="float64")
    grad = np.asarray(env["W.grad"])
    fd = np.zeros_like(grad)
    for idx in np.ndindex(*grad.shape):
        loss = []
        for s in (1e-6, -1e-6):
            w = feed["W"].copy()
            w[idx] += s
            loss.append(float(execute(step, {**feed, "W": w}, precision="float64")["loss"][0]))
        fd[idx] = (loss[0] - loss[1]) / 2e-6
    assert np.abs(grad).max() > 1e-3
    np.testing.assert_allclose(grad, fd, rtol=0, atol=1e-6 * np.abs(fd).max() + 1e-9)


# -- refusals --------------------------------------------------------------------------------------

def test_a_clip_bound_the_model_computes_is_refused_naming_the_node():
    nodes = _fc() + [N("ReduceMean", ["h"], ["lo"], name="mean", keepdims=1, axes=[0, 1]),
                     N("Clip", ["h", "lo"], ["y"], name="clip_to_mean")]
    with pytest.raises(ImportFailure) as e:
        import_onnx(_model(nodes, opset=17), {})
    msg = str(e.value)
    assert "Clip (its min bound 'lo' is not a constant (the model computes it" in msg and "): clip_to_mean" in msg


def test_a_clip_bound_that_is_a_graph_input_is_refused():
    g = helper.make_graph([N("Clip", ["x", "lo"], ["y"], name="clip_in")], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("lo", T.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ImportFailure, match=r"Clip \(its min bound 'lo' is not a constant.*graph input.*clip_in"):
        import_onnx(m, {})


def test_a_clip_bound_of_several_values_is_refused():
    m = _model(_fc() + [N("Clip", ["h", "lo"], ["y"], name="clip2")], [_c("lo", [0.0, 1.0])])
    with pytest.raises(ImportFailure, match=r"min bound 'lo' has shape \[2\].*clip2"):
        import_onnx(m, {})


@pytest.mark.parametrize("kernel,params,says", [
    ("clip", {"min": "0"}, "clip min must be a finite number or None (unbounded), got '0'"),
    ("clip", {"max": float("inf")}, "clip max must be a finite number or None (unbounded), got inf"),
    ("clip_grad", {"min": True}, "clip_grad min must be a finite number or None (unbounded), got True"),
    ("leaky_relu", {"alpha": None}, "leaky_relu alpha must be a finite number, got None"),
    ("leaky_relu_grad", {"alpha": float("nan")}, "leaky_relu_grad alpha must be a finite number, got nan"),
])
def test_bad_kernel_params_are_signature_errors(kernel, params, says):
    spec = TensorSpec((2, 3), "float32")
    ins = {"x": spec} if not kernel.endswith("_grad") else {"dy": spec, "x": spec}
    with pytest.raises(SignatureError) as e:
        get_kernel(kernel).signature(ins, params)
    assert str(e.value) == says


# -- PyTorch modules -------------------------------------------------------------------------------

ACTIVATIONS = {
    # name: (activation, kernel, the clip bounds; inputs scaled so that the bounds bite)
    "clamp": (lambda h: torch.clamp(h, -0.3, 0.4), "clip", (-0.3, 0.4)),
    "clamp_min": (lambda h: torch.clamp(h, min=0.1), "clip", (0.1,)),
    "relu6": (lambda h: torch.nn.functional.relu6(8.0 * h), "clip", (0.0, 6.0)),
    "hardtanh": (lambda h: torch.nn.functional.hardtanh(3.0 * h), "clip", (-1.0, 1.0)),
    "leaky_relu": (lambda h: torch.nn.functional.leaky_relu(h, 0.2), "leaky_relu", ()),
    "softplus": (lambda h: torch.nn.functional.softplus(h), "softplus", ()),
}


@needs_torch
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_torch_activations_import_and_train_like_torch(name):
    act, kernel, bounds = ACTIVATIONS[name]
    torch.manual_seed(0)
    m, x = net(act), torch.randn(7, 6)
    if bounds:  # some cells clipped, some not: the gradient's mask is exercised both ways
        with torch.no_grad():
            cut = np.isin(act(m.fc1(x)).numpy(), np.float32(bounds)).mean()
        assert 0.1 < cut < 0.9, cut
    check_against_torch(m, x, {kernel})


@needs_torch
def test_torch_log_softmax_head_trains_like_nll_loss():
    """A classifier returning ``log_softmax``: the import's cross-entropy on log-probabilities is
    torch's ``nll_loss`` (log_softmax of log-probabilities is themselves), and the gradients
    pass through the ``log_softmax`` VJP."""
    torch.manual_seed(1)
    m = net(lambda h: torch.tanh(h))
    head = torch.nn.Sequential(m, torch.nn.LogSoftmax(dim=-1))
    x, labels = torch.randn(2, 3, 6), torch.randint(0, 5, (2, 3))
    g, env = check_against_torch(head, x, {"log_softmax"}, loss="cross_entropy", labels=labels)
    with torch.no_grad():
        want = torch.nn.functional.nll_loss(head(x).reshape(-1, 5), labels.reshape(-1)).item()
    assert float(env["loss"][0]) == pytest.approx(want, rel=1e-5)
    assert "log_softmax_grad" in {o.kernel for o in training_step(g, loss="cross_entropy").ops.values()}


@needs_torch
def test_torch_log_softmax_over_another_dim_equals_torch():
    torch.manual_seed(2)
    m = net(lambda h: torch.log_softmax(h.reshape(2, 4, 4), dim=1).reshape(2, 16), d_h=16)
    check_against_torch(m, torch.randn(2, 6), {"log_softmax", "permute"})


def _rms_model(**norm_kw):
    shape = norm_kw.pop("normalized_shape", 8)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(6, 8)
            self.norm = torch.nn.RMSNorm(shape, **norm_kw)
            self.out = torch.nn.Linear(8, 3)
            if self.norm.weight is not None:
                with torch.no_grad():
                    self.norm.weight.uniform_(0.5, 1.5)  # not all ones: a lost gamma would show

        def forward(self, x):
            h = self.fc(x)
            if isinstance(shape, tuple):
                h = self.norm(h.reshape(*h.shape[:-1], *shape)).reshape(h.shape)
            else:
                h = self.norm(h)
            return self.out(h)

    return Block()


@needs_torch
@pytest.mark.parametrize("kw,fused", [
    ({}, True),  # eps None: torch.finfo(float32).eps
    ({"eps": 1e-3}, True),
    ({"elementwise_affine": False}, False),  # no gamma to fuse: elementary ops, still exact
    ({"normalized_shape": (2, 4)}, False),  # over two dims: not the last-dim rmsnorm kernel
], ids=["default_eps", "eps", "no_weight", "two_dims"])
def test_torch_rms_norm_imports_and_trains_like_torch(kw, fused):
    torch.manual_seed(3)
    m = _rms_model(**kw)
    norm, weight, keys = m.norm, m.norm.weight, list(m.state_dict())
    x = 3.0 * torch.randn(2, 5, 6)
    g, _ = check_against_torch(m, x, {"rmsnorm"} if fused else set())
    assert ("rmsnorm" in kernels_of(g)) == fused
    if fused:
        (op,) = [o for o in g.ops.values() if o.kernel == "rmsnorm"]
        eps = kw.get("eps", torch.finfo(torch.float32).eps)
        assert op.params["eps"] == pytest.approx(eps, rel=1e-6)
        assert dict(op.inputs)["gamma"] == "norm.weight"  # the state_dict name
    # the caller's module is as it was: the same norm, the same Parameter, the same names
    assert m.norm is norm and type(m.norm) is torch.nn.RMSNorm and m.norm.weight is weight
    assert list(m.state_dict()) == keys


@needs_torch
def test_a_bare_rms_norm_and_a_shared_one_import():
    """The module itself an RMSNorm (its weight named ``weight``), and one norm applied twice
    (one parameter getting both uses' gradients)."""
    from ir.importers.torch_export import import_torch

    torch.manual_seed(4)
    bare = torch.nn.RMSNorm(6, eps=1e-5)
    with torch.no_grad():
        bare.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 6)
    g, vals = import_torch(bare, {"x": x})
    assert kernels_of(g) == ["rmsnorm"] and set(vals) == {"weight"}
    with torch.no_grad():
        np.testing.assert_allclose(execute(g, {**vals, "x": x.numpy()})["output"], bare(x).numpy(), rtol=1e-5,
                                   atol=1e-6)

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc = bare, torch.nn.Linear(6, 6)

        def forward(self, x):
            return self.norm(self.fc(self.norm(x)))

    m = Twice()
    g, _ = check_against_torch(m, x, {"rmsnorm"})
    assert kernels_of(g).count("rmsnorm") == 2 and m.norm is bare


def test_clip_gradient_passes_at_the_bounds_as_torch_clamp():
    """At ``x == min`` and ``x == max`` exactly the gradient passes (torch.clamp's backward; relu6
    and hardtanh give 0 there, but export the same ONNX Clip); outside it is 0."""
    x = np.array([[-0.5, -0.2, 0.5, 0.7, -0.9]], np.float32)
    dy = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]], np.float32)
    spec = TensorSpec(x.shape, "float32")
    k = get_kernel("clip_grad")
    params = k.check_params({"min": -0.5, "max": 0.5})
    sig = k.signature({"dy": spec, "x": spec}, params)
    got = k.run(np, {"dy": dy, "x": x}, params, sig.index, sig)
    np.testing.assert_array_equal(got, [[1.0, 2.0, 3.0, 0.0, 0.0]])
    if torch is not None:
        t = torch.tensor(x, requires_grad=True)
        (torch.clamp(t, -0.5, 0.5) * torch.tensor(dy)).sum().backward()
        np.testing.assert_array_equal(got, t.grad.numpy())


@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_rms_norm_is_refused_clearly_and_the_model_kept(dtype):
    """torch computes a float16/bfloat16 RMSNorm in float32 (with float32's eps): not mapped yet,
    so the import says so instead of importing other numbers; the caller's norm is put back."""
    from ir.importers.torch_export import import_torch

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RMSNorm(4)).to(getattr(torch, dtype))
    norm = m[1]
    with pytest.raises(ImportFailure, match=f"torch.nn.RMSNorm on {dtype} inputs is not supported.*model.float"):
        import_torch(m, {"x": torch.randn(2, 4).to(getattr(torch, dtype))})
    assert m[1] is norm and type(m[1]) is torch.nn.RMSNorm
