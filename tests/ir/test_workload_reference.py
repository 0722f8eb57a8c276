"""Each built-in workload against a hand-written NumPy formula of the same program.

This tests the executor itself (and the workload builders), not only plan-vs-original.
The formulas run in float64 on the executor's own random inputs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.special

from executor import execute, random_inputs
from ir import workloads
from ir.rewrites import random_rewrite, retile, split_reduction


def f64(inputs):
    return {k: np.asarray(v, np.float64) for k, v in inputs.items()}


def rel(a, ref):
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / np.max(np.abs(ref)))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


ACT = {"relu": lambda x: np.maximum(x, 0), "gelu": gelu_tanh, "tanh": np.tanh}


def mlp_formula(i, n_layers, activation):
    h = i["x"]
    for k in range(1, n_layers + 1):
        h = h @ i[f"W{k}"] + i[f"b{k}"]
        if k < n_layers:
            h = ACT[activation](h)
    return h


def layernorm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b


def transformer_formula(i, heads):
    x = i["x"]
    d = x.shape[-1]
    dh = d // heads
    h = layernorm(x, i["ln1_g"], i["ln1_b"])
    q = np.einsum("bsd,dhe->bhse", h, i["Wq"])
    k = np.einsum("bsd,dhe->bhse", h, i["Wk"])
    v = np.einsum("bsd,dhe->bhse", h, i["Wv"])
    att = scipy.special.softmax(q @ np.swapaxes(k, -1, -2) / np.sqrt(dh), axis=-1)
    ctx = att @ v
    r1 = x + np.einsum("bhse,hed->bsd", ctx, i["Wo"])
    h2 = layernorm(r1, i["ln2_g"], i["ln2_b"])
    f = gelu_tanh(h2 @ i["W1"] + i["b1"]) @ i["W2"] + i["b2"]
    return r1 + f


def conv3x3_pad1(x, w):
    n, c, hh, ww = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    y = np.zeros((n, w.shape[0], hh, ww))
    for a, i, j in itertools.product(range(n), range(hh), range(ww)):
        patch = xp[a, :, i:i + 3, j:j + 3]  # [c, 3, 3]
        y[a, :, i, j] = np.tensordot(w, patch, axes=([1, 2, 3], [0, 1, 2]))
    return y


def convnet_formula(i, layers):
    h = i["x"]
    for k in range(1, layers + 1):
        h = np.maximum(conv3x3_pad1(h, i[f"w{k}"]), 0)
    pooled = h.sum(axis=(2, 3))
    return pooled @ i["Wfc"] + i["bfc"]


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
@pytest.mark.parametrize("widths", [(16, 32, 8), (8, 12, 12, 4)])
def test_mlp_matches_formula(activation, widths):
    g = workloads.mlp(batch=5, widths=widths, activation=activation)
    for seed in (0, 3):
        inputs = random_inputs(g, seed)
        ref = mlp_formula(f64(inputs), len(widths) - 1, activation)
        out = execute(g, inputs)[f"fc{len(widths) - 1}.out"]
        assert out.dtype == np.float32 and out.shape == ref.shape
        assert rel(out, ref) < 1e-5


def test_transformer_matches_formula():
    g = workloads.transformer(batch=2, seq=5, d_model=12, heads=3, d_ff=20)
    inputs = random_inputs(g, 1)
    ref = transformer_formula(f64(inputs), heads=3)
    assert rel(execute(g, inputs)["resid2.out"], ref) < 1e-5


def test_convnet_matches_formula():
    g = workloads.convnet(batch=2, channels=(3, 5, 4), size=7, classes=6)
    inputs = random_inputs(g, 2)
    ref = convnet_formula(f64(inputs), layers=2)
    assert ref.shape == (2, 6)
    assert rel(execute(g, inputs)["fc.out"], ref) < 1e-5


@pytest.mark.parametrize("name", ["mlp", "transformer", "convnet"])
def test_sharded_plans_match_formula_too(kit, name):
    g = kit.small(name)
    formula = {"mlp": lambda i: mlp_formula(i, 2, "relu"),
               "transformer": lambda i: transformer_formula(i, heads=kit.SMALL["transformer"]["heads"]),
               "convnet": lambda i: convnet_formula(i, layers=2)}[name]
    out = [n for n, t in g.tensors.items() if t.role == "output"][0]
    inputs = random_inputs(g, 5)
    ref = formula(f64(inputs))
    rng = np.random.default_rng(11)
    h = g
    for op in g.ops:  # every op tiled 2 ways along its longest dim, then random rewrites
        sig = g.signature(op)
        parts = [1] * len(sig.extents)
        parts[int(np.argmax(sig.extents))] = 2
        h = retile(h, op, parts, devices=(0, 1))
    for _ in range(20):
        h, _ = random_rewrite(h, rng, 4)
    assert rel(execute(h, inputs)[out], ref) < 1e-5


def test_split_reduction_plan_matches_formula(mlp):
    h = split_reduction(split_reduction(mlp, "fc1", 4), "fc2", 2)
    inputs = random_inputs(mlp, 0)
    assert rel(execute(h, inputs)["fc2.out"], mlp_formula(f64(inputs), 2, "relu")) < 1e-5


def test_random_inputs_are_deterministic_per_name():
    a = random_inputs(workloads.mlp(batch=4, widths=(6, 8, 3)), 9)
    b = random_inputs(workloads.mlp(batch=4, widths=(6, 8, 3), activation="tanh"), 9)
    assert set(a) == {"x", "W1", "b1", "W2", "b2"}  # sources only
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(random_inputs(workloads.mlp(batch=4, widths=(6, 8, 3)), 10)["x"], a["x"])
    t = random_inputs(workloads.transformer(), 0)
    assert abs(float(t["ln1_g"].mean()) - 1.0) < 0.1  # layernorm gains near one
