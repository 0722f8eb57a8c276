"""Every VJP rule against central finite differences in float64.

For a small program ``y = f(params)`` and the step's loss ``L = mean((y - target)²)`` (or the
cross-entropy), the gradients the backward emits (tensors ``<P>.grad``) must equal
``(L(P + h·e) - L(P - h·e)) / 2h`` for every element ``e`` of every parameter. Programs are
single ops (or short chains) on random small shapes drawn by hypothesis.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.run import execute, random_inputs
from ir.autodiff import RULES, training_step
from ir.builder import GraphBuilder
from ir.graph import Graph

H = 1e-6


def _inputs64(step: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    out = {}
    for n, a in random_inputs(step, seed).items():
        out[n] = a.astype(np.float64) if a.dtype.kind == "f" else a
    return out


def fd_check(g: Graph, loss: str = "mse", positive: tuple[str, ...] = (), rtol: float = 1e-6,
             values: dict[str, np.ndarray] | None = None) -> int:
    """Compare every parameter's ``.grad`` with central differences; returns the elements checked."""
    step = training_step(g, loss=loss, optimizer="sgd")
    ins = _inputs64(step)
    for p in positive:
        ins[p] = np.abs(ins[p]) + 0.5
    ins.update(values or {})
    env = execute(step, ins, precision="float64")
    checked = 0
    for p, t in step.tensors.items():
        if t.role != "parameter":
            continue
        grad = np.asarray(env[f"{p}.grad"])
        assert grad.shape == t.shape and grad.dtype == np.float64
        fd = np.zeros(t.shape)
        base = ins[p]
        for idx in np.ndindex(*t.shape):
            vals = []
            for sign in (1.0, -1.0):
                moved = base.copy()
                moved[idx] += sign * H
                vals.append(float(execute(step, {**ins, p: moved}, precision="float64")["loss"][0]))
            fd[idx] = (vals[0] - vals[1]) / (2 * H)
            checked += 1
        scale = max(float(np.max(np.abs(fd))), 1e-3)
        np.testing.assert_allclose(grad, fd, rtol=0, atol=rtol * scale + 1e-9, err_msg=f"gradient of {p}")
    return checked


def one_op(kernel: str, shapes: dict[str, tuple[int, ...]], inputs: tuple[str, ...] = (), **params) -> Graph:
    """A program of one op whose float ports are parameters (``inputs``: plain inputs instead)."""
    b = GraphBuilder()
    ins = {}
    for port, shape in shapes.items():
        if port in inputs:
            ins[port] = b.input(f"in_{port}", shape)
        else:
            ins[port] = b.parameter(f"p_{port}", shape)
    b.op(kernel, "f", ins, **params)
    return b.build()


CASES = {
    "linear": lambda: one_op("linear", {"x": (3, 4), "W": (4, 5), "b": (5,)}),
    "linear3d": lambda: one_op("linear", {"x": (2, 3, 4), "W": (4, 2), "b": (2,)}),
    "linear1d": lambda: one_op("linear", {"x": (4,), "W": (4, 3), "b": (3,)}),
    "matmul_alpha": lambda: one_op("matmul", {"a": (3, 4), "b": (4, 2)}, alpha=0.5),
    "bmm": lambda: one_op("bmm", {"a": (2, 3, 4), "b": (2, 4, 2)}),
    "einsum_heads": lambda: one_op("einsum", {"a": (2, 3, 4), "b": (4, 2, 2)}, equation="bsd,dhe->bhse"),
    "einsum_out": lambda: one_op("einsum", {"a": (2, 2, 3, 2), "b": (2, 2, 3)}, equation="bhse,hed->bsd"),
    "add_bcast": lambda: one_op("add", {"a": (3, 4), "b": (4,)}),
    "sub_bcast": lambda: one_op("sub", {"a": (3, 1), "b": (2, 3, 4)}),
    "mul_bcast": lambda: one_op("mul", {"a": (3, 4), "b": (3, 1)}),
    "div_bcast": lambda: one_op("div", {"a": (3, 4), "b": (4,)}),
    "relu": lambda: one_op("relu", {"x": (3, 5)}),
    "gelu": lambda: one_op("gelu", {"x": (3, 5)}),
    "silu": lambda: one_op("silu", {"x": (3, 5)}),
    "tanh": lambda: one_op("tanh", {"x": (3, 5)}),
    "exp": lambda: one_op("exp", {"x": (3, 5)}),
    "scale": lambda: one_op("scale", {"x": (3, 5)}, alpha=-1.5),
    "softmax": lambda: one_op("softmax", {"x": (2, 3, 5)}),
    "layernorm": lambda: one_op("layernorm", {"x": (3, 5), "gamma": (5,), "beta": (5,)}),
    "rmsnorm": lambda: one_op("rmsnorm", {"x": (2, 2, 5), "gamma": (5,)}),
    "rope": lambda: one_op("rope", {"x": (2, 3, 4)}),
    "permute": lambda: one_op("permute", {"x": (2, 3, 4)}, perm=[2, 0, 1]),
    "transpose": lambda: one_op("transpose", {"x": (3, 4)}),
    "reduce_sum": lambda: one_op("reduce_sum", {"x": (3, 4, 2)}, dim=1),
    "reduce_mean": lambda: one_op("reduce_mean", {"x": (3, 4)}, dim=0),
    "expand": lambda: one_op("expand", {"x": (3, 2)}, dim=1, size=3),
    "conv2d": lambda: one_op("conv2d", {"x": (2, 2, 4, 4), "w": (3, 2, 3, 3)}, padding=1),
    "conv2d_stride2": lambda: one_op("conv2d", {"x": (1, 2, 5, 5), "w": (2, 2, 3, 3)}, stride=2),
    "attention_gqa_causal": lambda: one_op("attention", {"q": (1, 2, 2, 3, 2), "k": (1, 2, 3, 2), "v": (1, 2, 3, 2)},
                                           scale=0.7, causal=True, offset=1),
}
POSITIVE = {"div_bcast": ("p_b",)}


@pytest.mark.parametrize("name", list(CASES))
def test_vjp_matches_finite_differences(name):
    assert fd_check(CASES[name](), positive=POSITIVE.get(name, ())) > 0


def test_masked_attention_chain():
    """causal_mask (forward -inf fill) -> softmax -> bmm: the mask's gradient zeroes masked cells."""
    b = GraphBuilder()
    q, k, v = (b.parameter(n, (2, 4, 3)) for n in ("q", "kT_src", "v"))
    kt = b.permute(k, name="kt", perm=[0, 2, 1])
    s = b.bmm(q, kt, name="qk", alpha=0.5)
    m = b.causal_mask(s, name="mask")
    p = b.softmax(m, name="sm")
    b.bmm(p, v, name="av")
    assert fd_check(b.build()) == 3 * 24


def test_embedding_and_cross_entropy():
    """Token ids pick table rows (scatter-add gradient); the loss is the token cross-entropy."""
    b = GraphBuilder()
    ids = b.input("ids", (2, 3), "int32")
    h = b.embedding(b.parameter("wte", (5, 4)), ids, name="emb")
    b.einsum(h, b.parameter("head", (4, 6)), name="logits", equation="bsd,dv->bsv")
    assert fd_check(b.build(), loss="cross_entropy") == 5 * 4 + 4 * 6


def test_fan_out_gradients_are_summed():
    """x is read by three ops: its gradient is the sum of three contributions."""
    b = GraphBuilder()
    x = b.parameter("x", (3, 4))
    a = b.relu(x, name="r")
    c = b.mul(x, a, name="m")
    b.add(c, x, name="s")
    g = b.build()
    step = training_step(g)
    assert {"x.gsum1", "x.gsum2"} <= set(step.ops)
    fd_check(g)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 3), f=st.integers(1, 4), o=st.integers(1, 4), act=st.sampled_from(["relu", "gelu", "tanh"]))
def test_property_linear_chains(n, f, o, act):
    b = GraphBuilder()
    h = b.linear(b.parameter("x", (n, f)), b.parameter("W", (f, o)), b.parameter("c", (o,)), name="fc")
    b.op(act, "act", {"x": h})
    fd_check(b.build())


@settings(max_examples=8, deadline=None)
@given(shape_a=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data(),
       kernel=st.sampled_from(["add", "sub", "mul"]))
def test_property_broadcasting_binaries(shape_a, data, kernel):
    """Random right-aligned broadcasts: b has ones or fewer leading dims."""
    k = data.draw(st.integers(0, len(shape_a)))
    tail = shape_a[len(shape_a) - k:]
    shape_b = [1 if data.draw(st.booleans()) else e for e in tail] or [shape_a[-1]]
    if len(shape_b) > len(shape_a):
        shape_b = shape_b[-len(shape_a):]
    fd_check(one_op(kernel, {"a": tuple(shape_a), "b": tuple(shape_b)}))


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 3), n=st.integers(2, 5), kind=st.sampled_from(["layernorm", "rmsnorm", "softmax"]))
def test_property_rowwise(rows, n, kind):
    shapes = {"x": (rows, n)}
    if kind != "softmax":
        shapes["gamma"] = (n,)
    if kind == "layernorm":
        shapes["beta"] = (n,)
    fd_check(one_op(kind, shapes))


def test_every_differentiable_forward_kernel_is_checked():
    kernels = {CASES[n]().ops["f"].kernel for n in CASES} | {"causal_mask", "embedding", "bmm", "permute"}
    kernels |= {IMPORTED[n]().ops["f"].kernel for n in IMPORTED}
    kernels |= {"attention"}  # tests/ir/test_attention_grad.py: against finite differences too
    kernels |= {"slice"}  # below
    kernels |= {"maxpool2d", "avgpool2d", "batchnorm2d"}  # test_pool_batchnorm_grads.py: finite differences too
    kernels |= {"masked_fill", "compare", "compare_scalar", "logical"}  # below
    forward = set(RULES) - {"cast"}  # cast: checked in the mixed-precision test (fp32 <-> bf16 copies)
    assert forward <= kernels, sorted(forward - kernels)


IMPORTED = {
    "sigmoid": lambda: one_op("sigmoid", {"x": (3, 4)}),
    "sqrt": lambda: one_op("sqrt", {"x": (3, 4)}),
    "reciprocal": lambda: one_op("reciprocal", {"x": (3, 4)}),
    "erf": lambda: one_op("erf", {"x": (3, 4)}),
    "gelu_erf": lambda: one_op("gelu_erf", {"x": (3, 4)}),
    "pow3": lambda: one_op("pow", {"x": (3, 4)}, exponent=3.0),
    "pow2": lambda: one_op("pow", {"x": (3, 4)}),
    "where": lambda: one_op("where", {"c": (3, 1), "a": (3, 4), "b": (4,)}, inputs=("c",)),
    "concat": lambda: one_op("concat", {"a": (2, 3), "b": (2, 2)}, axis=1),
    "reshape": lambda: one_op("reshape", {"x": (2, 6)}, shape=[3, 4], **{"from": [2, 6]}),
    "slice": lambda: one_op("slice", {"x": (3, 7)}, axis=1, start=1, stop=6),
    "slice_reversed": lambda: one_op("slice", {"x": (3, 5)}, axis=1, start=4, stop=-1, step=-1),
    "slice_negative_stride": lambda: one_op("slice", {"x": (7, 2)}, axis=0, start=5, stop=0, step=-2),
    "slice_stride": lambda: one_op("slice", {"x": (3, 8)}, axis=1, start=1, stop=8, step=3),
    "conv2d_input_grad": lambda: one_op("conv2d_input_grad", {"dy": (2, 3, 3, 2), "w": (3, 2, 3, 2)}, stride=[2, 1],
                                        padding=[1, 0, 1, 1], size=[6, 2]),
    "conv_transpose_dilated": lambda: one_op("conv2d_input_grad", {"dy": (1, 2, 2, 3), "w": (2, 2, 2, 3)},
                                             stride=[3, 2], dilation=[2, 1], padding=[0, 1, 2, 0], size=[6, 6]),
    "clip": lambda: one_op("clip", {"x": (3, 4)}, min=-0.4, max=0.5),
    "clip_max": lambda: one_op("clip", {"x": (3, 4)}, max=0.2),
    "leaky_relu": lambda: one_op("leaky_relu", {"x": (3, 4)}, alpha=0.1),
    "softplus": lambda: one_op("softplus", {"x": (3, 4)}),
    "log_softmax": lambda: one_op("log_softmax", {"x": (2, 3, 5)}),
    "abs": lambda: one_op("abs", {"x": (3, 4)}),
    "log": lambda: one_op("log", {"x": (3, 4)}),
    "elu": lambda: one_op("elu", {"x": (3, 4)}, alpha=0.6),
    "mish": lambda: one_op("mish", {"x": (3, 4)}),
    "group_norm": lambda: one_op("group_norm", {"x": (2, 4, 3), "scale": (4,), "bias": (4,)}, groups=2),
    "group_norm_per_group": lambda: one_op("group_norm", {"x": (2, 6, 2, 2), "scale": (3,), "bias": (3,)}, groups=3,
                                           affine="group"),
    "instance_norm_rank2": lambda: one_op("group_norm", {"x": (3, 4), "scale": (4,), "bias": (4,)}, groups=4),
    "pad_fill_crop": lambda: one_op("pad", {"x": (3, 5)}, axis=1, before=-1, after=2, value=0.5),
    "pad_copy_reflect": lambda: one_op("pad_copy", {"x": (3, 4)}, axis=1, before=3, after=2, mode="reflect"),
    "pad_copy_wrap": lambda: one_op("pad_copy", {"x": (3, 2)}, axis=0, before=4, after=1, mode="wrap"),
    "cumsum": lambda: one_op("cumsum", {"x": (3, 4)}, axis=1),
    "cumsum_exclusive_reverse": lambda: one_op("cumsum", {"x": (2, 3, 2)}, axis=1, exclusive=True, reverse=True),
}
IMPORTED_POSITIVE = {"sqrt": ("p_x",), "reciprocal": ("p_x",), "pow3": ("p_x",), "log": ("p_x",)}


@pytest.mark.parametrize("name", list(IMPORTED))
def test_vjp_of_imported_program_kernels(name):
    g = IMPORTED[name]()
    values = {"in_c": np.array([[1.0], [0.0], [1.0]])} if name == "where" else None  # rows pick a, b, a
    assert fd_check(g, positive=IMPORTED_POSITIVE.get(name, ()), values=values) > 0


@pytest.mark.parametrize("where", ["zero", "nonzero"])
def test_masked_fill_gradient_reaches_the_kept_cells(where):
    """``masked_fill`` (a Where with a scalar fill) passes dy to the cells it kept, nothing to the
    filled ones; the 0/1 mask is a plain input with no gradient."""
    g = one_op("masked_fill", {"x": (2, 3), "c": (1, 3)}, inputs=("c",), value=-2.0, fill_where=where)
    assert fd_check(g, values={"in_c": np.array([[1.0, 0.0, 1.0]])}) == 6


def test_masks_pass_no_gradient():
    """``x · (x > 0.1)``, ``x · (x < v)`` and ``x · ((x > 0.1) xor (v > 0))``: the masks are piecewise
    constant, so the gradient of ``x`` is the mask itself (their ops emit nothing), as the central
    differences say away from the thresholds."""
    b = GraphBuilder()
    x, v = b.parameter("x", (3, 4)), b.input("v", (3, 4))
    gt = b.op("compare_scalar", "gt", {"x": x}, op="gt", value=0.1)
    lt = b.op("compare", "lt", {"a": x, "b": v}, op="lt")
    xor = b.op("logical", "xor", {"a": gt, "b": b.op("compare_scalar", "vpos", {"x": v}, op="gt", value=0.0)}, op="xor")
    y = b.op("add", "s1", {"a": b.op("mul", "m1", {"a": x, "b": gt}), "b": b.op("mul", "m2", {"a": x, "b": lt})})
    b.op("add", "s2", {"a": y, "b": b.op("mul", "m3", {"a": x, "b": xor})})
    g = b.build()
    rng = np.random.default_rng(3)
    xs = rng.choice([-1.0, 1.0], (3, 4)) * rng.uniform(0.3, 1.0, (3, 4))  # |x - 0.1| and |x - v| >> h
    vs = xs + rng.choice([-0.2, 0.2], (3, 4))
    assert fd_check(g, values={"x": xs, "v": vs}) == 12
