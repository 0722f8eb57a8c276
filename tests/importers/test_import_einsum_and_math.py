"""Einsum, Abs, Log, Elu and Mish import.

ONNX models built with ``onnx.helper`` equal ``onnx.reference`` (and their random sharded plans
verify); the Einsum equation normalisation (spaces, implicit outputs, ellipses, uppercase
letters, MatMul's letters for a matrix product) is pinned on ``parse_equation`` and on the
emitted ops; what the einsum kernel cannot do is refused naming the node and the reason.
PyTorch modules using ``torch.einsum`` (with weights, attention-like), ``abs``, ``log``, ``ELU``
and ``Mish`` equal the module forward, and their training steps' gradients equal
``torch.autograd``'s (torch tests skip without torch). The gradient kernels equal torch's at
their special points (``abs`` and ``elu`` at 0, ``mish`` far out).
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

import onnx_models  # noqa: E402
from torch_checks import check_against_torch, kernels_of, needs_torch, net, torch  # noqa: E402
from executor.run import execute  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.errors import ImportFailure  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.importers.onnx_einsum import parse_equation  # noqa: E402
from ir.importers.onnx_ops import Unsupported  # noqa: E402
from ir.kernels import SignatureError, TensorSpec, get_kernel  # noqa: E402

N = helper.make_node


def _graph_model(nodes, inputs, inits=(), opset=17):
    """Inputs ``{name: shape}`` (float32), output ``y``."""
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, T.FLOAT, list(s)) for n, s in inputs.items()],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _ops(g, kernel):
    return [o for o in g.ops.values() if o.kernel == kernel]


def _check(m, inputs, kernels=(), walks=2):
    """``onnx_models.check_reference`` on random inputs of the shapes ``inputs`` (or arrays)."""
    return onnx_models.check_reference(m, inputs, kernels, walks)


# -- the equation, normalised -----------------------------------------------------------------------

@pytest.mark.parametrize("equation,shapes,terms,out", [
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)], ["bhqd", "bhkd"], "bhqk"),
    (" bhqd , bhkd -> bhqk ", [(2, 3, 4, 5), (2, 3, 6, 5)], ["bhqd", "bhkd"], "bhqk"),  # spaces dropped
    ("ij,jk", [(2, 3), (3, 4)], ["ij", "jk"], "ik"),  # implicit: the letters seen once, sorted
    ("ba,cb", [(2, 3), (4, 2)], ["ba", "cb"], "ac"),
    ("ji", [(2, 3)], ["ji"], "ij"),  # one operand, implicit: a transpose
    ("bij->bj", [(2, 3, 4)], ["bij"], "bj"),
    # the ellipsis: fresh letters (a, b, ... unused by the equation), aligned from the right
    ("...ij,...jk->...ik", [(2, 3, 4, 5), (2, 3, 5, 6)], ["abij", "abjk"], "abik"),
    ("...ij,...jk->...ik", [(2, 3, 4, 5), (3, 5, 6)], ["abij", "bjk"], "abik"),
    ("...ij,...jk", [(7, 4, 5), (7, 5, 6)], ["aij", "ajk"], "aik"),  # implicit: ellipsis dims first
    ("...ab,...bc->...ac", [(2, 4, 5), (2, 5, 6)], ["dab", "dbc"], "dac"),
    ("ij...,jk->ik...", [(4, 5, 2), (5, 6)], ["ija", "jk"], "ika"),
    ("...ij,jk->...ik", [(4, 5), (5, 6)], ["ij", "jk"], "ik"),  # an ellipsis covering no dims
    ("BD,DF->BF", [(2, 3), (3, 4)], ["ab", "bc"], "ac"),  # uppercase: unused lowercase letters
    ("Ab,bc", [(2, 3), (3, 4)], ["ab", "bc"], "ac"),  # implicit order is NumPy's: 'A' before 'c'
])
def test_equations_normalise_to_the_kernel_form(equation, shapes, terms, out):
    assert parse_equation(equation, shapes) == (terms, out)
    # the normalised equation computes what NumPy's einsum computes with the original one
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s) for s in shapes]
    np.testing.assert_allclose(np.einsum(f"{','.join(terms)}->{out}", *xs), np.einsum(equation, *xs), rtol=1e-12)


@pytest.mark.parametrize("equation,shapes,says", [
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)], "has 3 operands; the einsum kernel contracts two (write it as "
                                                "pairwise Einsums)"),
    ("ii->i", [(3, 3)], "letter(s) ['i'] repeat within the term 'ii' (a diagonal or trace); the einsum kernel "
                        "reads each operand dim once"),
    ("ii", [(3, 3)], "repeat within the term 'ii' (a diagonal or trace)"),
    ("ij,jk->ii", [(2, 3), (3, 4)], "output letter(s) ['i'] repeat"),
    ("ij,jk->iz", [(2, 3), (3, 4)], "output letter(s) ['z'] appear in no input"),
    ("i,i->", [(3,), (3,)], "has a scalar output; graph tensors have rank >= 1"),
    ("ij,jk->ik", [(2, 3), (4, 5)], "letter 'j' has extents 3 and 4 (NumPy broadcasts a 1; the einsum kernel "
                                    "needs one extent per letter)"),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 6)], "ellipsis dim 1 has extents 1 and 5"),
    ("...ij->ij", [(2, 3, 4)], "the output has no '...' but the ellipsis covers 1 dim(s) (NumPy refuses this too)"),
    ("ij,jk->ik", [(2, 3, 1), (3, 4)], "term 'ij' has 2 letters for an operand of rank 3"),
    ("i.j,jk->ik", [(2, 3), (3, 4)], "term 'i.j' is not letters with at most one '...'"),
    ("ij,jk->ik->i", [(2, 3), (3, 4)], "is malformed"),
])
def test_what_the_kernel_cannot_do_is_refused_saying_why(equation, shapes, says):
    with pytest.raises(Unsupported) as e:
        parse_equation(equation, shapes)
    assert says in str(e.value)


# -- Einsum models against onnx.reference -----------------------------------------------------------

def test_einsum_with_an_explicit_output_equals_the_reference():
    m = _graph_model([N("Einsum", ["x", "z"], ["y"], name="bmm", equation="bij,bjk->bik")],
                     {"x": (2, 3, 4), "z": (2, 4, 5)})
    g, _ = _check(m, {"x": (2, 3, 4), "z": (2, 4, 5)}, {"einsum"})
    (op,) = _ops(g, "einsum")
    assert op.params["equation"] == "bij,bjk->bik" and dict(op.inputs) == {"a": "x", "b": "z"}


@pytest.mark.parametrize("equation,want", [("ij,jk", "mk,kn->mn"), ("ba,cb", "ba,cb->ac")])
def test_einsum_with_an_implicit_output_equals_the_reference(equation, want):
    shapes = {"ij,jk": ((3, 4), (4, 5)), "ba,cb": ((4, 3), (5, 4))}[equation]
    m = _graph_model([N("Einsum", ["x", "z"], ["y"], name="e", equation=equation)], dict(zip("xz", shapes)))
    g, _ = _check(m, dict(zip("xz", shapes)), {"einsum"})
    assert _ops(g, "einsum")[0].params["equation"] == want


@pytest.mark.parametrize("xs,zs", [((2, 3, 4, 5), (2, 3, 5, 6)), ((2, 3, 4, 5), (3, 5, 6)), ((4, 5), (5, 6))],
                         ids=["same_batch", "fewer_batch_dims", "no_batch_dims"])
def test_einsum_with_ellipsis_batch_dims_equals_the_reference(xs, zs):
    m = _graph_model([N("Einsum", ["x", "z"], ["y"], name="e", equation="...ij,...jk->...ik")], {"x": xs, "z": zs})
    _check(m, {"x": xs, "z": zs}, {"einsum"})


def test_einsum_with_a_weight_keeps_its_name_and_fuses_a_bias_into_linear():
    """``bsd,df->bsf`` takes MatMul's letters, so the ``linear`` pattern fuses the bias after it;
    the weight and bias keep their initializer names."""
    inits = [onnx_models.weight("W", (6, 8), seed=1), onnx_models.weight("b", (8,), seed=2)]
    plain = _graph_model([N("Einsum", ["x", "W"], ["y"], name="proj", equation="bsd,df->bsf")], {"x": (2, 5, 6)}, inits)
    g, vals = _check(plain, {"x": (2, 5, 6)}, {"einsum"})
    (op,) = _ops(g, "einsum")
    assert op.params["equation"] == "amk,kn->amn" and dict(op.inputs) == {"a": "x", "b": "W"}
    assert set(vals) == {"W"}
    biased = _graph_model([N("Einsum", ["x", "W"], ["xw"], name="proj", equation="bsd,df->bsf"),
                           N("Add", ["xw", "b"], ["y"], name="bias")], {"x": (2, 5, 6)}, inits)
    g, vals = _check(biased, {"x": (2, 5, 6)}, {"linear"})
    (op,) = _ops(g, "linear")
    assert kernels_of(g) == ["linear"] and dict(op.inputs) == {"x": "x", "W": "W", "b": "b"} and set(vals) == {"W", "b"}


def test_einsum_with_the_weight_on_the_left_is_swapped_into_matmul_form():
    inits = [onnx_models.weight("W", (6, 8), seed=1), onnx_models.weight("b", (8,), seed=2)]
    m = _graph_model([N("Einsum", ["W", "x"], ["xw"], name="proj", equation="df,bsd->bsf"),
                      N("Add", ["xw", "b"], ["y"], name="bias")], {"x": (2, 5, 6)}, inits)
    g, _ = _check(m, {"x": (2, 5, 6)}, {"linear"})
    assert dict(_ops(g, "linear")[0].inputs)["W"] == "W"


def test_attention_like_einsums_equal_the_reference():
    """``softmax(q·kᵀ)·v`` per head, both contractions Einsums of two activations."""
    shapes = {"q": (2, 3, 4, 5), "k": (2, 3, 6, 5), "v": (2, 3, 6, 5)}
    m = _graph_model([N("Einsum", ["q", "k"], ["s"], name="scores", equation="bhqd,bhkd->bhqk"),
                      N("Softmax", ["s"], ["p"], name="probs", axis=-1),
                      N("Einsum", ["p", "v"], ["y"], name="mix", equation="bhqk, bhkd -> bhqd")], shapes)
    g, _ = _check(m, shapes, {"einsum", "softmax"}, walks=3)
    assert sorted(o.params["equation"] for o in _ops(g, "einsum")) == ["bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd"]


@pytest.mark.parametrize("equation,shape,kernels", [
    ("ij->ji", (3, 4), ["permute", "tanh"]),
    ("ji", (3, 4), ["permute", "tanh"]),
    ("bij->bj", (2, 3, 4), ["reduce_sum", "tanh"]),
    ("bij->jb", (2, 3, 4), ["permute", "reduce_sum", "tanh"]),
    ("ij->ij", (3, 4), ["tanh"]),  # the input itself
])
def test_one_operand_einsums_are_sums_and_permutes(equation, shape, kernels):
    m = _graph_model([N("Einsum", ["x"], ["e"], name="e", equation=equation), N("Tanh", ["e"], ["y"], name="t")],
                     {"x": shape})
    g, _ = _check(m, {"x": shape}, walks=1)
    assert kernels_of(g) == kernels


def _w_grad_and_central_differences(step, feed):
    """The training step's gradient of ``W`` and its central differences of the loss (h = 1e-6)."""
    grad = np.asarray(execute(step, feed, precision="float64")["W.grad"])
    fd = np.zeros_like(grad)
    for idx in np.ndindex(*grad.shape):
        loss = []
        for h in (1e-6, -1e-6):
            w = feed["W"].copy()
            w[idx] += h
            loss.append(float(execute(step, {**feed, "W": w}, precision="float64")["loss"][0]))
        fd[idx] = (loss[0] - loss[1]) / 2e-6
    return grad, fd


def test_a_letter_one_operand_alone_sums_is_summed_first_and_trains():
    """``bsd,df->bf`` sums ``s`` of ``x`` alone: a ``reduce_sum`` before the contraction (whose
    VJP refuses such letters), so the training step's weight gradient exists and equals central
    differences."""
    inits = [onnx_models.weight("W", (4, 3), seed=1)]
    m = _graph_model([N("Einsum", ["x", "W"], ["y"], name="pool", equation="bsd,df->bf")], {"x": (2, 5, 4)}, inits)
    g, vals = _check(m, {"x": (2, 5, 4)}, {"reduce_sum", "einsum"})
    assert _ops(g, "einsum")[0].params["equation"] == "mk,kn->mn"
    step = training_step(g, loss="mse", optimizer="sgd")
    rng = np.random.default_rng(3)
    feed = {"W": vals["W"].astype(np.float64), "x": rng.standard_normal((2, 5, 4)), "target": rng.standard_normal((2, 3))}
    grad, fd = _w_grad_and_central_differences(step, feed)
    assert np.abs(grad).max() > 1e-3
    np.testing.assert_allclose(grad, fd, rtol=0, atol=1e-6 * np.abs(fd).max())


@pytest.mark.parametrize("nodes_eq,inputs,says", [
    ("ij,jk,kl->il", {"x": (2, 3), "z": (3, 4), "w": (4, 5)}, "has 3 operands; the einsum kernel contracts two"),
    ("ii->i", {"x": (3, 3)}, "repeat within the term 'ii' (a diagonal or trace)"),
    ("...ij,...jk->...ik", {"x": (2, 1, 3, 4), "z": (5, 4, 6)}, "ellipsis dim 1 has extents 1 and 5"),
])
def test_refused_einsums_name_the_node_and_the_reason(nodes_eq, inputs, says):
    m = _graph_model([N("Einsum", list(inputs), ["y"], name="my_einsum", equation=nodes_eq)], inputs)
    with pytest.raises(ImportFailure) as e:
        import_onnx(m, {})
    msg = str(e.value)
    assert "Einsum (" in msg and says in msg and msg.split("Supported op types")[0].rstrip(". ").endswith("my_einsum")


# -- Abs, Log, Elu, Mish against onnx.reference -------------------------------------------------------

def _fc_model(nodes, opset=17, shape=(4, 6)):
    """``h = x @ W + b`` then ``nodes`` (ending in ``y``)."""
    inits = [onnx_models.weight("W", (shape[-1], shape[-1]), seed=1), onnx_models.weight("b", (shape[-1],))]
    fc = [N("MatMul", ["x", "W"], ["xw"], name="fc"), N("Add", ["xw", "b"], ["h"], name="fc_bias")]
    return _graph_model(fc + nodes, {"x": shape}, inits, opset=opset)


@pytest.mark.parametrize("nodes,kernels,opset", [
    ([N("Abs", ["h"], ["y"], name="abs")], {"abs"}, 17),
    ([N("Softplus", ["h"], ["p"], name="sp"), N("Log", ["p"], ["y"], name="log")], {"softplus", "log"}, 17),
    ([N("Elu", ["h"], ["y"], name="elu")], {"elu"}, 17),
    ([N("Elu", ["h"], ["y"], name="elu", alpha=0.4)], {"elu"}, 17),
    ([N("Mish", ["h"], ["y"], name="mish")], {"mish"}, 18),
], ids=["abs", "log", "elu", "elu_alpha", "mish"])
def test_math_ops_equal_the_onnx_reference(nodes, kernels, opset):
    m = _fc_model(nodes, opset=opset)
    g, _ = onnx_models.check_import(m, {}, kernels)
    for o in _ops(g, "elu"):
        assert o.params["alpha"] == pytest.approx(nodes[0].attribute[0].f if nodes[0].attribute else 1.0)


def test_mish_spelled_in_elementary_ops_is_the_mish_kernel():
    """``x·tanh(softplus(x))``, how torch exports ``nn.Mish`` before opset 18, becomes ``mish``."""
    m = _fc_model([N("Softplus", ["h"], ["s"], name="sp"), N("Tanh", ["s"], ["t"], name="th"),
                   N("Mul", ["h", "t"], ["y"], name="mish")])
    g, _ = onnx_models.check_import(m, {}, {"mish"})
    assert kernels_of(g) == ["linear", "mish"]


def test_elu_and_mish_stay_finite_far_out():
    m = _graph_model([N("Elu", ["x"], ["e"], name="elu"), N("Mish", ["x"], ["m"], name="mish"),
                      N("Add", ["e", "m"], ["y"], name="add")], {"x": (1, 6)}, opset=18)
    g, vals = import_onnx(m, {})
    x = np.array([[-200.0, -30.0, -1.0, 0.0, 30.0, 200.0]], np.float32)
    y = execute(g, {"x": x, **vals})["y"]
    xd = x.astype(np.float64)
    want = np.where(xd > 0, xd, np.expm1(np.minimum(xd, 0))) + xd * np.tanh(np.logaddexp(0, xd))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-30)


def test_imported_math_ops_train_and_their_gradients_equal_finite_differences():
    """One program with Abs, Log, Elu, Mish and a weight Einsum: the training step's weight
    gradients equal central differences of its loss (float64)."""
    nodes = [N("Einsum", ["x", "W"], ["h"], name="proj", equation="nd,df->nf"),
             N("Abs", ["h"], ["a"], name="abs"), N("Elu", ["h"], ["e"], name="elu", alpha=0.5),
             N("Mish", ["h"], ["m"], name="mish"), N("Softplus", ["h"], ["s"], name="sp"),
             N("Log", ["s"], ["l"], name="log"), N("Add", ["a", "e"], ["ae"], name="add1"),
             N("Add", ["m", "l"], ["ml"], name="add2"), N("Add", ["ae", "ml"], ["y"], name="add3")]
    g, vals = import_onnx(_graph_model(nodes, {"x": (4, 6)}, [onnx_models.weight("W", (6, 5), seed=1)], opset=18), {})
    assert {"einsum", "abs", "elu", "mish", "log"} <= set(kernels_of(g))
    step = training_step(g, loss="mse", optimizer="sgd")
    assert {"abs_grad", "elu_grad", "mish_grad", "log_grad"} <= set(kernels_of(step))
    rng = np.random.default_rng(1)
    feed = {"W": vals["W"].astype(np.float64), "x": rng.standard_normal((4, 6)), "target": rng.standard_normal((4, 5))}
    grad, fd = _w_grad_and_central_differences(step, feed)
    assert np.abs(grad).max() > 1e-3
    np.testing.assert_allclose(grad, fd, rtol=0, atol=1e-6 * np.abs(fd).max() + 1e-9)


@pytest.mark.parametrize("kernel,params,says", [
    ("elu", {"alpha": None}, "elu alpha must be a finite number, got None"),
    ("elu_grad", {"alpha": float("inf")}, "elu_grad alpha must be a finite number, got inf"),
])
def test_bad_elu_alpha_is_a_signature_error(kernel, params, says):
    spec = TensorSpec((2, 3), "float32")
    ins = {"x": spec} if kernel == "elu" else {"dy": spec, "x": spec}
    with pytest.raises(SignatureError) as e:
        get_kernel(kernel).signature(ins, params)
    assert str(e.value) == says


# -- the gradient kernels at their special points ----------------------------------------------------

def _grad_kernel(kernel, x, dy, **params):
    k = get_kernel(kernel)
    p = k.check_params(params)
    spec = TensorSpec(x.shape, "float32")  # the signature's dtype; compute runs in the arrays' own
    sig = k.signature({"dy": spec, "x": spec}, p)
    return np.asarray(k.run(np, {"dy": dy, "x": x}, p, sig.index, sig))


def _torch_grad(fn, x, dy):
    t = torch.tensor(x, requires_grad=True)
    (fn(t) * torch.tensor(dy)).sum().backward()
    return t.grad.numpy()


SPECIAL = {
    # kernel: (params, x, the gradient at dy = 1, 2, 3, ...; its torch function)
    "abs_grad": ({}, [-2.0, -0.0, 0.0, 3.0], [-1.0, 0.0, 0.0, 4.0], lambda t: torch.abs(t)),
    "elu_grad": ({"alpha": 0.5}, [-1.0, 0.0, 1e-30, 2.0], [0.5 * np.exp(-1.0), 1.0, 3.0, 4.0],
                 lambda t: torch.nn.functional.elu(t, 0.5)),
    "log_grad": ({}, [0.25, 1.0, 4.0], [4.0, 2.0, 0.75], lambda t: torch.log(t)),
}


@pytest.mark.parametrize("kernel", list(SPECIAL))
def test_gradient_kernels_at_their_kinks_equal_torch(kernel):
    """``abs_grad`` is 0 at ``x == ±0`` (torch's ``sgn``); ``elu_grad`` at ``x == 0`` is
    ``alpha·dy`` (torch's ``elu_backward`` takes the ``x <= 0`` branch) and ``dy`` just above."""
    params, x, want, fn = SPECIAL[kernel]
    x = np.array([x], np.float64)
    dy = np.arange(1.0, x.size + 1).reshape(x.shape)
    got = _grad_kernel(kernel, x, dy, **params)
    np.testing.assert_allclose(got, [want], rtol=1e-12)
    if torch is not None:
        np.testing.assert_allclose(got, _torch_grad(fn, x, dy), rtol=1e-12)


def test_mish_gradient_is_finite_far_out_and_equals_torch():
    x = np.array([[-1000.0, -100.0, -20.0, -1.0, -1e-8, 0.0, 0.5, 20.0, 100.0, 1000.0]])
    dy = np.ones_like(x)
    for dtype in (np.float32, np.float64):
        got = _grad_kernel("mish_grad", x.astype(dtype), dy.astype(dtype))
        assert np.isfinite(got).all(), got
    got = _grad_kernel("mish_grad", x, dy)
    # far left the gradient is ~ (1 + x)·eˣ, far right 1; at 0 it is tanh(ln 2) = 0.6
    np.testing.assert_allclose(got[0, [5, 8, 9]], [0.6, 1.0, 1.0], rtol=1e-12)
    np.testing.assert_allclose(got[0, 1], -99.0 * np.exp(-100.0), rtol=1e-6)
    if torch is not None:
        np.testing.assert_allclose(got, _torch_grad(torch.nn.functional.mish, x, dy), rtol=1e-10, atol=1e-300)


# -- PyTorch modules -------------------------------------------------------------------------------

ACTIVATIONS = {
    # name: (activation, the kernel it imports as, opset)
    "abs": (lambda: torch.abs, "abs", 17),
    "log": (lambda: (lambda h: torch.log(torch.nn.functional.softplus(h) + 1.0)), "log", 17),
    "elu": (lambda: torch.nn.ELU(), "elu", 17),
    "elu_alpha": (lambda: torch.nn.ELU(alpha=0.3), "elu", 17),
    "mish_opset17": (lambda: torch.nn.Mish(), "mish", 17),  # Softplus/Tanh/Mul: the pattern makes it mish
    "mish_opset18": (lambda: torch.nn.Mish(), "mish", 18),  # the Mish op
}


@needs_torch
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_torch_activations_import_and_train_like_torch(name):
    make, kernel, opset = ACTIVATIONS[name]
    torch.manual_seed(0)
    m, x = net(make()), torch.randn(7, 6)
    with torch.no_grad():  # both sides of the kink are exercised
        h = m.fc1(x)
    assert 0.2 < float((h > 0).float().mean()) < 0.8
    g, _ = check_against_torch(m, x, {kernel}, opset=opset)
    if kernel == "elu":
        alpha = 0.3 if name == "elu_alpha" else 1.0
        assert _ops(g, "elu")[0].params["alpha"] == pytest.approx(alpha)


class _EinsumMLP(torch.nn.Module if torch is not None else object):
    """``torch.einsum`` with weights: a projection with a bias, an activation, a projection without."""

    def __init__(self, d=6, f=8, o=4) -> None:
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(d, f) / d**0.5)
        self.b_in = torch.nn.Parameter(0.1 * torch.randn(f))
        self.w_out = torch.nn.Parameter(torch.randn(f, o) / f**0.5)

    def forward(self, x):
        h = torch.nn.functional.elu(torch.einsum("bsd,df->bsf", x, self.w_in) + self.b_in)
        return torch.einsum("bsf,fo->bso", h, self.w_out)


@needs_torch
def test_torch_einsum_with_weights_imports_and_trains_like_torch():
    torch.manual_seed(1)
    m = _EinsumMLP()
    g, _ = check_against_torch(m, torch.randn(2, 5, 6), {"linear", "einsum", "elu"})
    (lin,) = _ops(g, "linear")
    assert dict(lin.inputs)["W"] == "w_in" and dict(lin.inputs)["b"] == "b_in"  # the state_dict names
    (ein,) = _ops(g, "einsum")
    assert dict(ein.inputs)["b"] == "w_out" and ein.params["equation"] == "amk,kn->amn"


class _EinsumAttention(torch.nn.Module if torch is not None else object):
    """Multi-head self-attention whose two contractions are ``torch.einsum``."""

    def __init__(self, d=8, heads=2) -> None:
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape

        def split(t):
            return t.reshape(b, s, self.h, self.dh).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        p = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) / self.dh**0.5, dim=-1)
        y = torch.einsum("bhqk,bhkd->bhqd", p, v)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


@needs_torch
def test_torch_einsum_attention_imports_and_trains_like_torch():
    torch.manual_seed(2)
    g, _ = check_against_torch(_EinsumAttention(), torch.randn(2, 5, 8), {"einsum", "softmax"})
    assert sorted(o.params["equation"] for o in _ops(g, "einsum")) == ["bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd"]


@needs_torch
def test_torch_einsum_with_an_ellipsis_imports():
    class Batched(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 6, 4))

        def forward(self, x):
            return torch.einsum("...ij,...jk->...ik", x, self.w)

    torch.manual_seed(3)
    check_against_torch(Batched(), torch.randn(2, 3, 5, 6), {"einsum"})
