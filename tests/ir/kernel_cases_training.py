"""Cases for the training kernels (forward additions, gradients, losses, optimizers), each with a
reference written here independently of the kernel: explicit Jacobians by complex-step
differentiation (exact to rounding), one-hot contractions, naive loops."""

from __future__ import annotations

import itertools

import numpy as np
import scipy.special


def complex_step_vjp(f, x, dy, h=1e-30):
    """``dx_j = Σ_i dy_i ∂f_i/∂x_j`` row by row (last axis), with f applied to complex rows."""
    dx = np.zeros_like(x)
    n = x.shape[-1]
    for j in range(n):
        e = np.zeros(n)
        e[j] = h
        dx[..., j] = np.sum(dy * np.imag(f(x + 1j * e)) / h, axis=-1)
    return dx


def complex_step_elementwise(f, x, h=1e-30):
    return np.imag(f(x + 1j * h)) / h


def gelu_c(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def silu_c(x):
    return x / (1.0 + np.exp(-x))


def layernorm_rows(x, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def rms_rows(x, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def softmax_vjp(x_y, dy):
    # Jacobian diag(y) - y yᵀ, applied explicitly per row.
    J = np.einsum("...i,ij->...ij", x_y, np.eye(x_y.shape[-1])) - np.einsum("...i,...j->...ij", x_y, x_y)
    return np.einsum("...ij,...i->...j", J, dy)


def rope_ref(x, base=10000.0, inverse=False):
    e = x.shape[-1]
    pos = np.arange(x.shape[-2])[:, None]
    theta = pos * base ** (-np.arange(e // 2) * 2.0 / e)
    z = (x[..., : e // 2] + 1j * x[..., e // 2 :]) * np.exp((-1j if inverse else 1j) * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def onehot(ids, n):
    return (ids[..., None] == np.arange(n)).astype(float)


def conv_input_grad_naive(dy, w, padding):
    n, co, oh, ow = dy.shape
    _, ci, kh, kw = w.shape
    H, W = oh + kh - 1 - 2 * padding, ow + kw - 1 - 2 * padding
    dxp = np.zeros((n, ci, H + 2 * padding, W + 2 * padding))
    for a, o, i, j in itertools.product(range(n), range(co), range(oh), range(ow)):
        dxp[a, :, i:i + kh, j:j + kw] += dy[a, o, i, j] * w[o]
    return dxp[:, :, padding:padding + H, padding:padding + W]


def conv_input_grad_blocks_naive(dy, w, stride, padding, dilation, size):
    """The strided transposed convolution by scattering every ``dy`` cell through every tap:
    ``dx[oh·sh - top + i·dh, ow·sw - left + j·dw] += dy[oh, ow] · w[i, j]``, on the kernel's output
    plane of whole stride blocks ``[ceil(H/sh)·sh, ceil(W/sw)·sw]`` (rows past H included)."""
    (sh, sw), (dh, dw), (t, l) = stride, dilation, padding
    n, co, oh, ow = dy.shape
    _, ci, kh, kw = w.shape
    rows, cols = -(-size[0] // sh) * sh, -(-size[1] // sw) * sw
    dx = np.zeros((n, ci, rows, cols))
    for a, b, i, j in itertools.product(range(oh), range(ow), range(kh), range(kw)):
        r, c = a * sh - t + i * dh, b * sw - l + j * dw
        if 0 <= r < rows and 0 <= c < cols:
            dx[:, :, r, c] += np.einsum("no,oc->nc", dy[:, :, a, b], w[:, :, i, j])
    return dx


def conv_weight_grad_naive(x, dy, padding, stride, kh, kw):
    n, ci, h, wd = x.shape
    _, co, oh, ow = dy.shape
    xp = np.zeros((n, ci, h + 2 * padding, wd + 2 * padding))
    xp[:, :, padding:padding + h, padding:padding + wd] = x
    dw = np.zeros((co, ci, kh, kw))
    for a, o, i, j in itertools.product(range(n), range(co), range(oh), range(ow)):
        dw[o] += dy[a, o, i, j] * xp[a, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
    return dw


def training_cases(Case):
    """The cases, built with the test module's ``Case`` class."""
    return [
        Case("silu", "silu", {"x": (4, 5)}, {}, lambda i: i["x"] * scipy.special.expit(i["x"])),
        Case("scale", "scale", {"x": (3, 4)}, {"alpha": -2.5}, lambda i: -2.5 * i["x"]),
        Case("cast_f16", "cast", {"x": (3, 4)}, {"dtype": "float16"},
             lambda i: i["x"].astype(np.float16).astype(np.float64)),
        Case("relu_grad", "relu_grad", {"dy": (4, 5), "x": (4, 5)}, {}, lambda i: i["dy"] * (i["x"] > 0)),
        Case("gelu_grad", "gelu_grad", {"dy": (3, 6), "x": (3, 6)}, {},
             lambda i: i["dy"] * complex_step_elementwise(gelu_c, i["x"])),
        Case("silu_grad", "silu_grad", {"dy": (3, 6), "x": (3, 6)}, {},
             lambda i: i["dy"] * complex_step_elementwise(silu_c, i["x"])),
        Case("tanh_grad", "tanh_grad", {"dy": (3, 6), "x": (3, 6)}, {},
             lambda i: i["dy"] * (1 - i["x"] ** 2)),  # port x carries the forward output y
        Case("rmsnorm", "rmsnorm", {"x": (3, 4, 6), "gamma": (6,)}, {}, lambda i: rms_rows(i["x"]) * i["gamma"]),
        Case("normalize_layer", "normalize", {"x": (4, 6)}, {}, lambda i: layernorm_rows(i["x"])),
        Case("normalize_rms", "normalize", {"x": (4, 6)}, {"kind": "rms", "eps": 1e-6}, lambda i: rms_rows(i["x"])),
        Case("softmax_grad", "softmax_grad", {"dy": (3, 2, 5), "y": (3, 2, 5)}, {},
             lambda i: softmax_vjp(i["y"], i["dy"])),
        Case("norm_grad_layer", "norm_grad", {"dy": (4, 6), "x": (4, 6), "gamma": (6,)}, {},
             lambda i: complex_step_vjp(lambda z: layernorm_rows(z) * i["gamma"], i["x"], i["dy"])),
        Case("norm_grad_rms", "norm_grad", {"dy": (2, 3, 6), "x": (2, 3, 6), "gamma": (6,)},
             {"kind": "rms", "eps": 1e-6},
             lambda i: complex_step_vjp(lambda z: rms_rows(z) * i["gamma"], i["x"], i["dy"])),
        Case("causal_mask", "causal_mask", {"x": (2, 5, 5)}, {"fill": 0.0},
             lambda i: i["x"] * np.tril(np.ones((5, 5)))),
        Case("causal_mask_offset", "causal_mask", {"x": (4, 6)}, {"fill": -7.0, "offset": 2},
             lambda i: np.where(np.tril(np.ones((4, 6)), 2) > 0, i["x"], -7.0)),
        Case("rope", "rope", {"x": (2, 5, 6)}, {}, lambda i: rope_ref(i["x"])),
        Case("rope_inverse", "rope", {"x": (3, 4, 8)}, {"inverse": True, "base": 100.0},
             lambda i: rope_ref(i["x"], 100.0, True)),
        Case("embedding", "embedding", {"table": (7, 4), "ids": (3, 5)}, {}, lambda i: i["table"][i["ids"]],
             ints={"ids": 7}),
        Case("embedding_grad", "embedding_grad", {"ids": (4, 3), "dy": (4, 3, 5)}, {"vocab": 6},
             lambda i: np.einsum("nsv,nsd->vd", onehot(i["ids"], 6), i["dy"]), ints={"ids": 6}),
        Case("reduce_mean", "reduce_mean", {"x": (4, 6, 3)}, {"dim": 1}, lambda i: i["x"].mean(axis=1)),
        Case("reduce_to_bias", "reduce_to", {"x": (4, 3, 5)}, {"shape": [5]}, lambda i: i["x"].sum(axis=(0, 1))),
        Case("reduce_to_keep", "reduce_to", {"x": (4, 3, 5)}, {"shape": [3, 1]},
             lambda i: i["x"].sum(axis=0).sum(axis=-1, keepdims=True)),
        Case("expand", "expand", {"x": (3, 4)}, {"dim": 1, "size": 5},
             lambda i: np.repeat(i["x"][:, None, :], 5, axis=1)),
        Case("conv2d_input_grad", "conv2d_input_grad", {"dy": (2, 3, 5, 4), "w": (3, 2, 3, 3)}, {"padding": 1},
             lambda i: conv_input_grad_naive(i["dy"], i["w"], 1), pads=True),
        Case("conv2d_input_grad_nopad", "conv2d_input_grad", {"dy": (1, 2, 3, 3), "w": (2, 2, 2, 2)}, {},
             lambda i: conv_input_grad_naive(i["dy"], i["w"], 0), pads=True),
        # strided: blocks of stride rows (3x3 / 2 with padding 1 on 7x8: ResNet's stage entry)
        Case("conv2d_input_grad_stride2", "conv2d_input_grad", {"dy": (2, 3, 4, 4), "w": (3, 2, 3, 3)},
             {"stride": 2, "padding": 1, "size": [7, 8]},
             lambda i: conv_input_grad_blocks_naive(i["dy"], i["w"], (2, 2), (1, 1), (1, 1), (7, 8)), pads=True),
        # per-axis strides above the dilated extent (skipped rows get zeros), asymmetric padding
        Case("conv2d_input_grad_strides_dilation", "conv2d_input_grad", {"dy": (1, 2, 4, 3), "w": (2, 3, 2, 2)},
             {"stride": [3, 4], "dilation": [2, 1], "padding": [1, 1, 0, 1], "size": [11, 10]},
             lambda i: conv_input_grad_blocks_naive(i["dy"], i["w"], (3, 4), (1, 1), (2, 1), (11, 10)), pads=True),
        Case("conv2d_weight_grad", "conv2d_weight_grad", {"x": (2, 2, 5, 4), "dy": (2, 3, 5, 4)},
             {"padding": 1, "window": [3, 3]}, lambda i: conv_weight_grad_naive(i["x"], i["dy"], 1, 1, 3, 3),
             pads=True),
        Case("conv2d_weight_grad_stride2", "conv2d_weight_grad", {"x": (2, 2, 7, 7), "dy": (2, 3, 3, 3)},
             {"stride": 2, "window": [3, 3]}, lambda i: conv_weight_grad_naive(i["x"], i["dy"], 0, 2, 3, 3)),
        Case("mse_loss", "mse_loss", {"y": (4, 3), "target": (4, 3)}, {},
             lambda i: np.array([np.mean((i["y"] - i["target"]) ** 2)])),
        Case("mse_loss_grad", "mse_loss_grad", {"y": (4, 3), "target": (4, 3)}, {"count": 12},
             lambda i: 2 * (i["y"] - i["target"]) / 12),
        Case("cross_entropy", "cross_entropy", {"logits": (4, 3, 7), "labels": (4, 3)}, {},
             lambda i: np.array([-np.mean(np.take_along_axis(scipy.special.log_softmax(i["logits"], -1),
                                                              i["labels"][..., None], -1))]),
             ints={"labels": 7}),
        Case("cross_entropy_grad", "cross_entropy_grad", {"logits": (4, 3, 7), "labels": (4, 3)}, {"count": 12},
             lambda i: (scipy.special.softmax(i["logits"], -1) - onehot(i["labels"], 7)) / 12, ints={"labels": 7}),
        Case("sgd_update", "sgd_update", {"p": (3, 4), "g": (3, 4)}, {"lr": 0.1, "weight_decay": 0.01},
             lambda i: i["p"] - 0.1 * i["g"] - 0.1 * 0.01 * i["p"]),
        Case("momentum_update", "momentum_update", {"buf": (5,), "g": (5,)}, {"momentum": 0.8},
             lambda i: 0.8 * i["buf"] + i["g"]),
        Case("momentum_decay_update", "momentum_decay_update", {"buf": (5,), "g": (5,), "p": (5,)},
             {"momentum": 0.8, "weight_decay": 0.01}, lambda i: 0.8 * i["buf"] + i["g"] + 0.01 * i["p"]),
        Case("adam_m", "adam_moment", {"m": (3, 4), "g": (3, 4)}, {"beta": 0.9},
             lambda i: 0.9 * i["m"] + 0.1 * i["g"]),
        Case("adam_v", "adam_moment", {"m": (3, 4), "g": (3, 4)}, {"beta": 0.99, "power": 2},
             lambda i: 0.99 * i["m"] + 0.01 * i["g"] ** 2, positive=("m",)),
        Case("adamw_update", "adamw_update", {"p": (3, 4), "m": (3, 4), "v": (3, 4)},
             {"lr": 0.01, "step": 3, "weight_decay": 0.1},
             lambda i: i["p"] - 0.01 * 0.1 * i["p"]
             - 0.01 * (i["m"] / (1 - 0.9**3)) / (np.sqrt(i["v"] / (1 - 0.999**3)) + 1e-8), positive=("v",)),
        # gradients of the imported-program kernels (port x carries the forward output for sigmoid,
        # sqrt and reciprocal)
        Case("sigmoid_grad", "sigmoid_grad", {"dy": (3, 4), "x": (3, 4)}, {}, lambda i: i["dy"] * i["x"] * (1 - i["x"])),
        Case("sqrt_grad", "sqrt_grad", {"dy": (3, 4), "x": (3, 4)}, {}, lambda i: i["dy"] / (2 * i["x"]),
             positive=("x",)),
        Case("reciprocal_grad", "reciprocal_grad", {"dy": (3, 4), "x": (3, 4)}, {}, lambda i: -i["dy"] * i["x"] ** 2),
        Case("erf_grad", "erf_grad", {"dy": (3, 4), "x": (3, 4)}, {},
             lambda i: i["dy"] * complex_step_elementwise(scipy.special.erf, i["x"])),
        Case("gelu_erf_grad", "gelu_erf_grad", {"dy": (3, 4), "x": (3, 4)}, {},
             lambda i: i["dy"] * complex_step_elementwise(lambda z: 0.5 * z * (1 + scipy.special.erf(z / np.sqrt(2))),
                                                          i["x"])),
        Case("pow_grad", "pow_grad", {"dy": (3, 4), "x": (3, 4)}, {"exponent": 3.0},
             lambda i: i["dy"] * complex_step_elementwise(lambda z: z**3, i["x"]), positive=("x",)),
        Case("clip_grad", "clip_grad", {"dy": (4, 5), "x": (4, 5)}, {"min": -0.5, "max": 0.75},
             lambda i: i["dy"] * ((i["x"] >= -0.5) & (i["x"] <= 0.75))),
        Case("clip_grad_max_only", "clip_grad", {"dy": (4, 5), "x": (4, 5)}, {"max": 0.3},
             lambda i: i["dy"] * (i["x"] <= 0.3)),
        Case("leaky_relu_grad", "leaky_relu_grad", {"dy": (3, 4), "x": (3, 4)}, {"alpha": 0.2},
             lambda i: i["dy"] * complex_step_elementwise(lambda z: np.where(z.real > 0, z, 0.2 * z), i["x"])),
        Case("softplus_grad", "softplus_grad", {"dy": (3, 4), "x": (3, 4)}, {},
             lambda i: i["dy"] * complex_step_elementwise(lambda z: np.log(1 + np.exp(z)), i["x"])),
        Case("abs_grad", "abs_grad", {"dy": (4, 5), "x": (4, 5)}, {},
             lambda i: i["dy"] * np.where(i["x"] > 0, 1.0, np.where(i["x"] < 0, -1.0, 0.0))),
        Case("log_grad", "log_grad", {"dy": (3, 4), "x": (3, 4)}, {},
             lambda i: i["dy"] * complex_step_elementwise(np.log, i["x"]), positive=("x",)),
        Case("elu_grad", "elu_grad", {"dy": (4, 5), "x": (4, 5)}, {"alpha": 0.7},
             lambda i: i["dy"] * complex_step_elementwise(lambda z: np.where(z.real > 0, z, 0.7 * (np.exp(z) - 1)),
                                                          i["x"])),
        Case("mish_grad", "mish_grad", {"dy": (3, 4), "x": (3, 4)}, {},
             lambda i: i["dy"] * complex_step_elementwise(lambda z: z * np.tanh(np.log(1 + np.exp(z))), i["x"])),
        Case("log_softmax_grad", "log_softmax_grad", {"dy": (3, 2, 5), "y": (3, 2, 5)}, {},
             lambda i: i["dy"] - np.exp(i["y"]) * i["dy"].sum(-1, keepdims=True)),
        Case("where_grad", "where_grad", {"dy": (3, 4), "c": (3, 1)}, {"take": "b"},
             lambda i: np.where(i["c"] == 0, i["dy"], 0.0)),
    ]
