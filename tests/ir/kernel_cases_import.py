"""Cases for the kernels imported programs use
(``ir/kernels/{mathfn,select,shape,pooling,batchnorm,groupnorm,padding,scan,argreduce}``), with
the pooling, batch-norm, group-norm and padding gradients, each with a reference written here
independently (SciPy's erf, NumPy slicing, padding and loops)."""

from __future__ import annotations

import math

import numpy as np
import scipy.special


def _pool(x, k, st, pad, fn, fill=0.0, dil=1):
    """Windows of ``k x k`` taps ``dil`` apart, ``st`` apart, on ``x`` padded with ``fill``."""
    x = np.pad(x, [(0, 0), (0, 0), (pad, pad), (pad, pad)], constant_values=fill)
    e = dil * (k - 1) + 1
    oh, ow = (x.shape[2] - e) // st + 1, (x.shape[3] - e) // st + 1
    return np.stack([np.stack([fn(x[:, :, i * st:i * st + e:dil, j * st:j * st + e:dil], axis=(2, 3))
                               for j in range(ow)], -1) for i in range(oh)], -2)


def _maxpool_grad(x, dy, k, st, pad):
    """Loops: each window's dy goes to its first maximum (row-major), padding never wins."""
    xp = np.pad(x, [(0, 0), (0, 0), (pad, pad), (pad, pad)], constant_values=-np.inf)
    dx = np.zeros_like(xp)
    for n, c, i, j in np.ndindex(*dy.shape):
        win = xp[n, c, i * st:i * st + k, j * st:j * st + k]
        u, v = np.unravel_index(int(np.argmax(win)), win.shape)
        dx[n, c, i * st + u, j * st + v] += dy[n, c, i, j]
    return dx[:, :, pad:pad + x.shape[2], pad:pad + x.shape[3]]


def _avgpool_grad(dy, shape, k, st, pad, include_pad):
    dx = np.zeros((shape[0], shape[1], shape[2] + 2 * pad, shape[3] + 2 * pad))
    inside = np.pad(np.ones(shape[2:]), pad)
    for n, c, i, j in np.ndindex(*dy.shape):
        count = k * k if include_pad else inside[i * st:i * st + k, j * st:j * st + k].sum()
        dx[n, c, i * st:i * st + k, j * st:j * st + k] += dy[n, c, i, j] / count
    return dx[:, :, pad:pad + shape[2], pad:pad + shape[3]]


def _bn_param_grad(i, wrt, eps=1e-5):
    inv = 1.0 / np.sqrt(i["var"] + eps)
    xc = i["x"] - i["mean"][:, None, None]
    if wrt == "scale":
        return np.einsum("nchw,nchw->c", i["dy"], xc) * inv
    if wrt == "mean":
        return -i["scale"] * inv * i["dy"].sum(axis=(0, 2, 3))
    return np.einsum("nchw,nchw->c", i["dy"], xc) * i["scale"] * -0.5 * (i["var"] + eps) ** -1.5


def _group_norm_ref(x, groups, eps=1e-5):
    """``x̂`` by loops over (sample, group): the slab's own mean and biased variance."""
    out = np.empty_like(x)
    per = x.shape[1] // groups
    for n in range(x.shape[0]):
        for g in range(groups):
            s = x[n, g * per:(g + 1) * per]
            out[n, g * per:(g + 1) * per] = (s - s.mean()) / math.sqrt(s.var() + eps)
    return out


def _group_norm_grad_ref(dy, x, scale, groups, eps=1e-5):
    """``dx`` of ``Σ dy·group_norm(x)`` by the chain rule through the mean and variance, per slab."""
    dx = np.empty_like(x)
    per = x.shape[1] // groups
    for n in range(x.shape[0]):
        for g in range(groups):
            sl = slice(g * per, (g + 1) * per)
            s, h = x[n, sl], dy[n, sl] * scale[sl].reshape((-1,) + (1,) * (x.ndim - 2))
            m, mu, var = s.size, s.mean(), s.var()
            dvar = np.sum(h * (s - mu)) * -0.5 * (var + eps) ** -1.5
            dmu = -np.sum(h) / math.sqrt(var + eps) + dvar * -2.0 * np.mean(s - mu)
            dx[n, sl] = h / math.sqrt(var + eps) + dvar * 2.0 * (s - mu) / m + dmu / m
    return dx


def _pad_copy_grad_ref(dy, axis, before, after, mode, size):
    """The adjoint of ``np.pad``: each output cell's dy added to the input cell it copies."""
    src = np.pad(np.arange(size), (before, after), mode=mode)
    dx = np.zeros(dy.shape[:axis] + (size,) + dy.shape[axis + 1:])
    for i, j in enumerate(src):
        np.moveaxis(dx, axis, 0)[j] += np.moveaxis(dy, axis, 0)[i]
    return dx


def _cumsum_ref(x, axis, exclusive, reverse):
    """Loops: each cell the sum of the cells before (after, ``reverse``) it, itself unless ``exclusive``."""
    xm = np.moveaxis(x, axis, 0)
    y = np.zeros_like(xm)
    n = xm.shape[0]
    for i in range(n):
        js = range(i, n) if reverse else range(0, i + 1)
        y[i] = sum((xm[j] for j in js if not (exclusive and j == i)), np.zeros_like(xm[0]))
    return np.moveaxis(y, 0, axis)


def _arg_ref(x, axis, fn, last, keepdims):
    """Loops: per row along ``axis``, the first (``last``: the last) position holding ``fn`` of the row."""
    xm = np.moveaxis(x, axis, -1)
    out = np.zeros(xm.shape[:-1], dtype=np.int64)
    for idx in np.ndindex(*xm.shape[:-1]):
        hits = [k for k, v in enumerate(xm[idx]) if v == fn(xm[idx])]
        out[idx] = hits[-1] if last else hits[0]
    return np.expand_dims(out, axis) if keepdims else out


def import_cases(Case):
    """The cases, built with the test module's ``Case`` class."""
    erf = scipy.special.erf
    return [
        Case("index_to_float", "index_to_float", {"x": (3, 4)}, {"dtype": "float32"},
             lambda i: i["x"].astype(np.float64), ints={"x": 7}),
        Case("float_to_index", "float_to_index", {"x": (3, 4)}, {}, lambda i: np.rint(i["x"])),
        Case("sigmoid", "sigmoid", {"x": (4, 5)}, {}, lambda i: scipy.special.expit(i["x"])),
        Case("sqrt", "sqrt", {"x": (4, 5)}, {}, lambda i: np.sqrt(i["x"]), positive=("x",)),
        Case("reciprocal", "reciprocal", {"x": (3, 4)}, {}, lambda i: 1.0 / i["x"], positive=("x",)),
        Case("erf", "erf", {"x": (3, 4)}, {}, lambda i: erf(i["x"])),
        Case("gelu_erf", "gelu_erf", {"x": (2, 3, 4)}, {},
             lambda i: 0.5 * i["x"] * (1 + erf(i["x"] / math.sqrt(2)))),
        Case("pow3", "pow", {"x": (3, 4)}, {"exponent": 3.0}, lambda i: i["x"] ** 3),
        Case("clip", "clip", {"x": (4, 5)}, {"min": -0.5, "max": 0.75},
             lambda i: np.where(i["x"] < -0.5, -0.5, np.where(i["x"] > 0.75, 0.75, i["x"]))),
        Case("clip_min_only", "clip", {"x": (4, 5)}, {"min": 0.1}, lambda i: np.where(i["x"] < 0.1, 0.1, i["x"])),
        Case("clip_max_only", "clip", {"x": (3, 4)}, {"max": -0.2}, lambda i: np.where(i["x"] > -0.2, -0.2, i["x"])),
        Case("leaky_relu", "leaky_relu", {"x": (4, 5)}, {"alpha": 0.2}, lambda i: np.where(i["x"] >= 0, i["x"], 0.2 * i["x"])),
        Case("softplus", "softplus", {"x": (2, 3, 4)}, {}, lambda i: np.log1p(np.exp(i["x"]))),
        Case("log_softmax", "log_softmax", {"x": (3, 2, 6)}, {},
             lambda i: np.log(scipy.special.softmax(i["x"], axis=-1))),
        Case("abs", "abs", {"x": (4, 5)}, {}, lambda i: np.where(i["x"] < 0, -i["x"], i["x"])),
        Case("log", "log", {"x": (3, 4)}, {}, lambda i: np.log(i["x"]), positive=("x",)),
        Case("elu", "elu", {"x": (4, 5)}, {"alpha": 0.7},
             lambda i: np.where(i["x"] > 0, i["x"], 0.7 * (np.exp(i["x"]) - 1.0))),
        Case("elu_default_alpha", "elu", {"x": (3, 4)}, {}, lambda i: np.where(i["x"] > 0, i["x"], np.exp(i["x"]) - 1.0)),
        Case("mish", "mish", {"x": (2, 3, 4)}, {}, lambda i: i["x"] * np.tanh(np.log1p(np.exp(i["x"])))),
        Case("where", "where", {"c": (1, 4), "a": (3, 4), "b": (3, 1)}, {},
             lambda i: np.where(i["c"] != 0, i["a"], i["b"])),
        Case("compare_lt", "compare", {"a": (3, 4), "b": (1, 4)}, {"op": "lt"},
             lambda i: (i["a"] < i["b"]).astype(float)),
        Case("compare_scalar_ge", "compare_scalar", {"x": (3, 5)}, {"op": "ge", "value": 0.25},
             lambda i: (i["x"] >= 0.25).astype(float)),
        Case("logical_xor", "logical", {"a": (2, 3, 4), "b": (3, 1)}, {"op": "xor"},
             lambda i: ((i["a"] != 0) ^ (i["b"] != 0)).astype(float), extra={"masks": ("a", "b")}),
        Case("masked_fill_zero", "masked_fill", {"x": (2, 3, 4), "c": (3, 1)}, {"value": -7.5, "fill_where": "zero"},
             lambda i: np.where(i["c"] != 0, i["x"], -7.5), extra={"masks": ("c",)}),
        Case("concat", "concat", {"a": (3, 2, 4), "b": (3, 5, 4)}, {"axis": 1},
             lambda i: np.concatenate([i["a"], i["b"]], axis=1)),
        Case("slice_step", "slice", {"x": (3, 10)}, {"axis": 1, "start": 0, "stop": 10, "step": 3},
             lambda i: i["x"][:, 0:10:3]),
        Case("slice_reversed", "slice", {"x": (3, 10)}, {"axis": 1, "start": 9, "stop": -1, "step": -1},
             lambda i: i["x"][:, ::-1]),
        Case("slice_negative_step", "slice", {"x": (7, 3)}, {"axis": 0, "start": 6, "stop": -1, "step": -3},
             lambda i: np.stack([i["x"][6], i["x"][3], i["x"][0]])),
        Case("argmax", "argmax", {"x": (3, 5, 4)}, {"axis": 1}, lambda i: _arg_ref(i["x"], 1, np.max, False, True)),
        Case("argmin_last", "argmin", {"x": (4, 3, 6)}, {"axis": -1, "keepdims": False, "select_last_index": True},
             lambda i: _arg_ref(i["x"], 2, np.min, True, False)),
        Case("pad", "pad", {"x": (3, 4)}, {"axis": 1, "before": 2, "after": 1},
             lambda i: np.pad(i["x"], [(0, 0), (2, 1)]), pads=True),
        Case("reshape_heads", "reshape", {"x": (2, 3, 8)}, {"shape": [2, 3, 2, 4], "from": [2, 3, 8]},
             lambda i: i["x"].reshape(2, 3, 2, 4)),
        Case("reshape_merge", "reshape", {"x": (2, 3, 2, 4)}, {"shape": [2, 3, 8], "from": [2, 3, 2, 4]},
             lambda i: i["x"].reshape(2, 3, 8)),
        Case("reshape_blocked", "reshape", {"x": (6, 4)}, {"shape": [4, 6], "from": [6, 4]},
             lambda i: i["x"].reshape(4, 6)),
        Case("maxpool2d", "maxpool2d", {"x": (2, 3, 6, 6)}, {"window": [2, 2], "stride": [2, 2]},
             lambda i: _pool(i["x"], 2, 2, 0, np.max)),
        Case("maxpool2d_pad", "maxpool2d", {"x": (1, 2, 5, 5)}, {"window": [3, 3], "stride": [2, 2], "padding": 1},
             lambda i: _pool(i["x"], 3, 2, 1, np.max, -np.inf), pads=True),
        Case("avgpool2d_exclude_pad", "avgpool2d", {"x": (1, 2, 5, 5)},
             {"window": [3, 3], "stride": [2, 2], "padding": 1, "count_include_pad": False},
             lambda i: _pool(i["x"], 3, 2, 1, np.nanmean, np.nan), pads=True),
        Case("maxpool2d_dilated", "maxpool2d", {"x": (1, 2, 8, 7)},
             {"window": [3, 3], "stride": [1, 1], "padding": 2, "dilation": 2},
             lambda i: _pool(i["x"], 3, 1, 2, np.max, -np.inf, dil=2), pads=True),
        Case("avgpool2d_dilated_exclude_pad", "avgpool2d", {"x": (2, 1, 9, 9)},
             {"window": [2, 2], "stride": [2, 2], "padding": 1, "dilation": 3, "count_include_pad": False},
             lambda i: _pool(i["x"], 2, 2, 1, np.nanmean, np.nan, dil=3), pads=True),
        Case("avgpool2d_pad", "avgpool2d", {"x": (1, 2, 5, 5)}, {"window": [3, 3], "stride": [1, 1], "padding": 1},
             lambda i: _pool(i["x"], 3, 1, 1, np.mean), pads=True),
        Case("batchnorm2d", "batchnorm2d", {"x": (2, 3, 2, 2), "scale": (3,), "bias": (3,), "mean": (3,),
                                            "var": (3,)}, {"eps": 1e-5},
             lambda i: (i["x"] - i["mean"][:, None, None]) / np.sqrt(i["var"][:, None, None] + 1e-5)
             * i["scale"][:, None, None] + i["bias"][:, None, None], positive=("var",)),
        Case("maxpool2d_grad_stem", "maxpool2d_grad", {"x": (2, 2, 5, 5), "dy": (2, 2, 3, 3)},
             {"window": [3, 3], "stride": [2, 2], "padding": 1, "size": [2, 2, 5, 5]},
             lambda i: _maxpool_grad(i["x"], i["dy"], 3, 2, 1)),
        Case("maxpool2d_grad_2x2", "maxpool2d_grad", {"x": (1, 3, 4, 6), "dy": (1, 3, 2, 3)},
             {"window": [2, 2], "stride": [2, 2], "size": [1, 3, 4, 6]},
             lambda i: _maxpool_grad(i["x"], i["dy"], 2, 2, 0)),
        Case("avgpool2d_grad_exclude_pad", "avgpool2d_grad", {"dy": (1, 2, 3, 3)},
             {"window": [3, 3], "stride": [2, 2], "padding": 1, "size": [1, 2, 5, 5], "count_include_pad": False},
             lambda i: _avgpool_grad(i["dy"], (1, 2, 5, 5), 3, 2, 1, False)),
        Case("avgpool2d_grad_global", "avgpool2d_grad", {"dy": (2, 3, 1, 1)},
             {"window": [4, 4], "stride": [1, 1], "size": [2, 3, 4, 4]},
             lambda i: _avgpool_grad(i["dy"], (2, 3, 4, 4), 4, 1, 0, True)),
        Case("batchnorm2d_input_grad", "batchnorm2d_input_grad", {"dy": (2, 3, 2, 2), "scale": (3,), "var": (3,)},
             {"eps": 1e-5}, lambda i: i["dy"] * (i["scale"] / np.sqrt(i["var"] + 1e-5))[:, None, None],
             positive=("var",)),
        *[Case(f"batchnorm2d_param_grad_{wrt}", "batchnorm2d_param_grad",
               {"dy": (4, 3, 2, 2), "x": (4, 3, 2, 2), "scale": (3,), "mean": (3,), "var": (3,)}, {"wrt": wrt},
               lambda i, wrt=wrt: _bn_param_grad(i, wrt), positive=("var",)) for wrt in ("scale", "mean", "var")],
        Case("group_norm", "group_norm", {"x": (2, 4, 3, 2), "scale": (4,), "bias": (4,)}, {"groups": 2},
             lambda i: _group_norm_ref(i["x"], 2) * i["scale"][:, None, None] + i["bias"][:, None, None]),
        Case("group_norm_per_group", "group_norm", {"x": (3, 6, 4), "scale": (3,), "bias": (3,)},
             {"groups": 3, "affine": "group", "eps": 1e-3},
             lambda i: _group_norm_ref(i["x"], 3, 1e-3) * np.repeat(i["scale"], 2)[:, None]
             + np.repeat(i["bias"], 2)[:, None]),
        Case("group_norm_instance", "group_norm", {"x": (2, 3, 5), "scale": (3,), "bias": (3,)}, {"groups": 3},
             lambda i: _group_norm_ref(i["x"], 3) * i["scale"][:, None] + i["bias"][:, None]),
        Case("group_normalize", "group_normalize", {"x": (2, 4, 2, 3)}, {"groups": 4},
             lambda i: _group_norm_ref(i["x"], 4)),
        Case("group_norm_grad", "group_norm_grad", {"dy": (2, 4, 3, 2), "x": (2, 4, 3, 2), "scale": (4,)},
             {"groups": 2}, lambda i: _group_norm_grad_ref(i["dy"], i["x"], i["scale"], 2)),
        Case("group_norm_grad_per_group", "group_norm_grad", {"dy": (2, 6, 3), "x": (2, 6, 3), "scale": (2,)},
             {"groups": 2, "affine": "group"},
             lambda i: _group_norm_grad_ref(i["dy"], i["x"], np.repeat(i["scale"], 3), 2)),
        Case("pad_value", "pad", {"x": (3, 4, 2)}, {"axis": 1, "before": 1, "after": 2, "value": -1.5},
             lambda i: np.pad(i["x"], [(0, 0), (1, 2), (0, 0)], constant_values=-1.5), pads=True),
        *[Case(f"pad_copy_{mode}", "pad_copy", {"x": (2, 4, 3)}, {"axis": 1, "before": 3, "after": 2, "mode": mode},
               lambda i, mode=mode: np.pad(i["x"], [(0, 0), (3, 2), (0, 0)], mode=mode))
          for mode in ("edge", "reflect", "wrap")],
        *[Case(f"pad_copy_grad_{mode}", "pad_copy_grad", {"dy": (2, 3, 9)},
               {"axis": -1, "before": 3, "after": 2, "mode": mode, "size": 4},
               lambda i, mode=mode: _pad_copy_grad_ref(i["dy"], 2, 3, 2, mode, 4))
          for mode in ("edge", "reflect", "wrap")],
        *[Case(f"cumsum{'_exclusive' * ex}{'_reverse' * rev}", "cumsum", {"x": (3, 5, 2)},
               {"axis": 1, "exclusive": ex, "reverse": rev}, lambda i, ex=ex, rev=rev: _cumsum_ref(i["x"], 1, ex, rev))
          for ex in (False, True) for rev in (False, True)],
    ]
