"""Vector-Jacobian products: one rule per kernel, each emitting ordinary block ops.

A rule receives the context of one forward op (``VJP``: its tensors, a way to emit ops into the
growing graph) and the name of the gradient of the op's output, and returns, for each input port
whose tensor needs a gradient, the name of that gradient tensor. Rules never see shards: they
emit logical ops (one whole shard each); plans shard them later like any op.

Weight gradients are contractions or ``reduce_to`` over the batch and sequence, declared as
hidden ``sum`` reductions with the batch first, so data-parallel gradient synchronisation is
``split_reduction`` + ``accumulate`` on those ops (reduce-scatter or all-reduce by placement).
Broadcast inputs get ``reduce_to`` their shape (the adjoint of broadcasting).

The table (``RULES``) is the one place that says which kernels are differentiable (tinygrad's
``pm_gradient`` pattern); a kernel missing from it makes ``backward`` refuse with its name.
"""

from __future__ import annotations

import re
from typing import Callable

from ir.autodiff.errors import AutodiffError
from ir.builder import GraphBuilder
from ir.graph import Op, Tensor
from ir.kernels.conv import pads4, pair


class VJP:
    """One forward op's view for its rule: tensors by port, and ``emit`` for backward ops."""

    def __init__(self, b: GraphBuilder, op: Op, need: frozenset[str]) -> None:
        self.b, self.op, self.need = b, op, need
        self.params = dict(op.params)
        self._n: dict[str, int] = {}

    def t(self, port: str) -> Tensor:
        """The forward tensor on input ``port`` (``"y"``: the output)."""
        return self.b.tensor(self.op.output if port == "y" else self.op.input_map[port])

    def name(self, port: str) -> str:
        return self.op.output if port == "y" else self.op.input_map[port]

    def emit(self, kernel: str, inputs: dict[str, str], tag: str, **params) -> str:
        """Add backward op ``<op>.d<tag>`` (``.2``, ``.3``, ... when a rule emits several for one tag)."""
        k = self._n[tag] = self._n.get(tag, 0) + 1
        name = f"{self.op.name}.d{tag}" if k == 1 else f"{self.op.name}.d{tag}.{k}"
        return self.b.op(kernel, name, inputs, **params)

    def sum_to(self, g: str, port: str) -> str:
        """``g`` summed down to the shape of the input on ``port`` (identity when shapes agree)."""
        shape = self.t(port).shape
        if self.b.tensor(g).shape == shape:
            return g
        return self.emit("reduce_to", {"x": g}, port, shape=list(shape))


Rule = Callable[[VJP, str], dict[str, str]]
RULES: dict[str, Rule] = {}


def rule(*kernels: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for k in kernels:
            RULES[k] = fn
        return fn
    return register


# -- contractions ---------------------------------------------------------------------------------

def _einsum_grads(c: VJP, dy: str, la: str, lb: str, lo: str, alpha: float, ports=("a", "b")) -> dict[str, str]:
    out = {}
    pa, pb = ports
    for port, mine, other, other_port in ((pa, la, lb, pb), (pb, lb, la, pa)):
        if port not in c.need:
            continue
        lost = set(mine) - set(lo) - set(other)
        if lost:
            raise AutodiffError(f"op {c.op.name!r}: einsum {la},{lb}->{lo} sums letters {sorted(lost)} of one "
                                f"operand alone; its gradient would need a broadcast, which has no VJP here")
        eq = f"{lo},{other}->{mine}" if port == pa else f"{other},{lo}->{mine}"
        ins = {"a": dy, "b": c.name(other_port)} if port == pa else {"a": c.name(other_port), "b": dy}
        out[port] = c.emit("einsum", ins, port, equation=eq, alpha=alpha)
    return out


@rule("einsum")
def _einsum(c: VJP, dy: str) -> dict[str, str]:
    m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]+)", c.params["equation"].replace(" ", ""))
    la, lb, lo = m.groups()
    return _einsum_grads(c, dy, la, lb, lo, c.params.get("alpha", 1.0))


@rule("matmul")
def _matmul(c: VJP, dy: str) -> dict[str, str]:
    return _einsum_grads(c, dy, "mk", "kn", "mn", c.params.get("alpha", 1.0))


@rule("bmm")
def _bmm(c: VJP, dy: str) -> dict[str, str]:
    batch = "abcdefgh"[: len(c.t("a").shape) - 2]
    return _einsum_grads(c, dy, batch + "mk", batch + "kn", batch + "mn", c.params.get("alpha", 1.0))


@rule("linear")
def _linear(c: VJP, dy: str) -> dict[str, str]:
    batch = "nmpqrs"[: len(c.t("x").shape) - 1]
    out = _einsum_grads(c, dy, batch + "f", "fo", batch + "o", 1.0, ports=("x", "W"))
    if "b" in c.need:
        out["b"] = c.sum_to(dy, "b")
    return out


# -- elementwise ----------------------------------------------------------------------------------

@rule("add")
def _add(c: VJP, dy: str) -> dict[str, str]:
    return {p: c.sum_to(dy, p) for p in ("a", "b") if p in c.need}


@rule("sub")
def _sub(c: VJP, dy: str) -> dict[str, str]:
    out = {}
    if "a" in c.need:
        out["a"] = c.sum_to(dy, "a")
    if "b" in c.need:
        out["b"] = c.emit("scale", {"x": c.sum_to(dy, "b")}, "b", alpha=-1.0)
    return out


@rule("mul")
def _mul(c: VJP, dy: str) -> dict[str, str]:
    out = {}
    for port, other in (("a", "b"), ("b", "a")):
        if port in c.need:
            out[port] = c.sum_to(c.emit("mul", {"a": dy, "b": c.name(other)}, port), port)
    return out


@rule("div")
def _div(c: VJP, dy: str) -> dict[str, str]:
    out = {}
    if "a" in c.need:
        out["a"] = c.sum_to(c.emit("div", {"a": dy, "b": c.name("b")}, "a"), "a")
    if "b" in c.need:  # d(a/b)/db = -y/b
        t = c.emit("div", {"a": c.emit("mul", {"a": dy, "b": c.name("y")}, "b"), "b": c.name("b")}, "b")
        out["b"] = c.emit("scale", {"x": c.sum_to(t, "b")}, "b", alpha=-1.0)
    return out


def _unary(grad_kernel: str, reads: str):
    def fn(c: VJP, dy: str) -> dict[str, str]:
        return {"x": c.emit(grad_kernel, {"dy": dy, "x": c.name(reads)}, "x")}
    return fn


RULES["relu"] = _unary("relu_grad", "x")
RULES["gelu"] = _unary("gelu_grad", "x")
RULES["silu"] = _unary("silu_grad", "x")
RULES["tanh"] = _unary("tanh_grad", "y")  # reads the forward output: 1 - y²
# Kernels of imported programs (``ir.kernels.mathfn``); the gradient kernels are in ``mathfn_grads``.
RULES["sigmoid"] = _unary("sigmoid_grad", "y")
RULES["sqrt"] = _unary("sqrt_grad", "y")
RULES["reciprocal"] = _unary("reciprocal_grad", "y")
RULES["erf"] = _unary("erf_grad", "x")
RULES["gelu_erf"] = _unary("gelu_erf_grad", "x")
RULES["softplus"] = _unary("softplus_grad", "x")
RULES["abs"] = _unary("abs_grad", "x")  # sign(x): 0 at x == 0, as torch
RULES["log"] = _unary("log_grad", "x")
RULES["mish"] = _unary("mish_grad", "x")


@rule("clip")
def _clip(c: VJP, dy: str) -> dict[str, str]:
    # dy where min <= x <= max: the bounds pass, as torch.clamp's backward (ir.kernels.mathfn_grads.ClipGrad)
    bounds = {k: c.params[k] for k in ("min", "max") if c.params.get(k) is not None}
    return {"x": c.emit("clip_grad", {"dy": dy, "x": c.name("x")}, "x", **bounds)}


@rule("leaky_relu")
def _leaky_relu(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("leaky_relu_grad", {"dy": dy, "x": c.name("x")}, "x", alpha=c.params.get("alpha", 0.01))}


@rule("elu")
def _elu(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("elu_grad", {"dy": dy, "x": c.name("x")}, "x", alpha=c.params.get("alpha", 1.0))}


@rule("pow")
def _pow(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("pow_grad", {"dy": dy, "x": c.name("x")}, "x", exponent=c.params.get("exponent", 2.0))}


@rule("where")
def _where(c: VJP, dy: str) -> dict[str, str]:
    out = {}
    for port in ("a", "b"):
        if port in c.need:
            out[port] = c.sum_to(c.emit("where_grad", {"dy": dy, "c": c.name("c")}, port, take=port), port)
    return out


@rule("compare", "compare_scalar", "logical")
def _mask(c: VJP, dy: str) -> dict[str, str]:
    """Masks are piecewise constant: a zero gradient, so no op (their inputs get no contribution)."""
    return {}


@rule("masked_fill")
def _masked_fill(c: VJP, dy: str) -> dict[str, str]:
    if "x" not in c.need:
        return {}
    take = "a" if c.params.get("fill_where", "nonzero") == "zero" else "b"  # where x was kept
    return {"x": c.sum_to(c.emit("where_grad", {"dy": dy, "c": c.name("c")}, "x", take=take), "x")}


@rule("concat")
def _concat(c: VJP, dy: str) -> dict[str, str]:
    axis = c.params.get("axis", 0) % len(c.t("a").shape)
    na = c.t("a").shape[axis]
    bounds = {"a": (0, na), "b": (na, na + c.t("b").shape[axis])}
    return {p: c.emit("slice", {"x": dy}, p, axis=axis, start=bounds[p][0], stop=bounds[p][1]) for p in c.need}


@rule("slice")
def _slice(c: VJP, dy: str) -> dict[str, str]:
    """``dx[start + step·i] = dy[i]``, zero elsewhere: a negative step reverses ``dy`` first (a
    ``slice`` of step -1), a stride ``q > 1`` spreads it to every ``q``-th cell (a ``reshape`` to
    ``[cells, 1]``, a zero ``pad`` to ``[cells, q]``, a ``reshape`` back), then a ``pad`` places it
    between the cells before the lowest one read and after (a crop of the spread's trailing zeros
    where it runs past the end)."""
    x = c.t("x").shape
    axis = c.params.get("axis", 0) % len(x)
    ext = x[axis]
    start, step = c.params.get("start", 0), c.params.get("step", 1)
    cells = c.t("y").shape[axis]
    q, lo, g = abs(step), start if step > 0 else start + step * (cells - 1), dy
    if step < 0 and cells > 1:
        g = c.emit("slice", {"x": g}, "x", axis=axis, start=cells - 1, stop=-1, step=-1)
    if q > 1:
        shape = list(c.b.tensor(g).shape)
        unit = shape[:axis + 1] + [1] + shape[axis + 1:]
        spread = shape[:axis + 1] + [q] + shape[axis + 1:]
        g = c.emit("reshape", {"x": g}, "x", shape=unit, **{"from": shape})
        g = c.emit("pad", {"x": g}, "x", axis=axis + 1, before=0, after=q - 1)
        g = c.emit("reshape", {"x": g}, "x", shape=shape[:axis] + [cells * q] + shape[axis + 1:],
                   **{"from": spread})
    return {"x": c.emit("pad", {"x": g}, "x", axis=axis, before=lo, after=ext - lo - cells * q)}


@rule("reshape")
def _reshape(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("reshape", {"x": dy}, "x", shape=list(c.t("x").shape), **{"from": list(c.t("y").shape)})}


@rule("exp")
def _exp(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("mul", {"a": dy, "b": c.name("y")}, "x")}


@rule("scale")
def _scale(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("scale", {"x": dy}, "x", alpha=c.params.get("alpha", 1.0))}


@rule("cast")
def _cast(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("cast", {"x": dy}, "x", dtype=c.t("x").dtype)}


@rule("causal_mask")
def _causal_mask(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("causal_mask", {"x": dy}, "x", offset=c.params.get("offset", 0), fill=0.0)}


@rule("rope")
def _rope(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("rope", {"x": dy}, "x", base=c.params.get("base", 10000.0),
                        inverse=not c.params.get("inverse", False))}


@rule("attention")
def _attention(c: VJP, dy: str) -> dict[str, str]:
    # FlashAttention's backward (Dao et al. 2022, Alg. 4): recompute the scores from q, k and each
    # row's log-sum-exp; kernels in ir/kernels/attention.py.
    # The bias (optional) is read again to recompute the scores; its gradient is dS summed to its shape.
    p = {k: c.params[k] for k in ("scale", "causal", "offset") if k in c.params}
    q, k, v, o = c.name("q"), c.name("k"), c.name("v"), c.name("y")
    bias = {"bias": c.name("bias")} if "bias" in c.op.input_map else {}
    lse = c.emit("attention_lse", {"q": q, "k": k, **bias}, "lse", **p)
    rows = {"q": q, "k": k, "v": v, "o": o, "dy": dy, "lse": lse, **bias}
    grads = {"q": ("attention_grad_q", rows), "k": ("attention_grad_k", rows),
             "v": ("attention_grad_v", {"q": q, "k": k, "dy": dy, "lse": lse, **bias}),
             "bias": ("attention_grad_bias", rows)}
    return {port: c.emit(kernel, ins, port, **p) for port, (kernel, ins) in grads.items() if port in c.need}


# -- row-wise -------------------------------------------------------------------------------------

@rule("softmax")
def _softmax(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("softmax_grad", {"dy": dy, "y": c.name("y")}, "x")}


@rule("log_softmax")
def _log_softmax(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("log_softmax_grad", {"dy": dy, "y": c.name("y")}, "x")}


def _norm(kind: str, default_eps: float):
    def fn(c: VJP, dy: str) -> dict[str, str]:
        eps = c.params.get("eps", default_eps)
        out = {}
        if "x" in c.need:
            out["x"] = c.emit("norm_grad", {"dy": dy, "x": c.name("x"), "gamma": c.name("gamma")}, "x",
                              kind=kind, eps=eps)
        if "gamma" in c.need:
            xhat = c.emit("normalize", {"x": c.name("x")}, "gamma", kind=kind, eps=eps)
            out["gamma"] = c.sum_to(c.emit("mul", {"a": dy, "b": xhat}, "gamma"), "gamma")
        if "beta" in c.need:
            out["beta"] = c.sum_to(dy, "beta")
        return out
    return fn


RULES["layernorm"] = _norm("layer", 1e-5)
RULES["rmsnorm"] = _norm("rms", 1e-6)


# -- layout and reductions ------------------------------------------------------------------------

@rule("permute", "transpose")
def _permute(c: VJP, dy: str) -> dict[str, str]:
    n = len(c.t("x").shape)
    perm = c.params.get("perm")
    perm = list(range(n))[::-1] if perm is None else list(perm)
    inverse = [perm.index(i) for i in range(n)]
    return {"x": c.emit("permute", {"x": dy}, "x", perm=inverse)}


@rule("reduce_sum", "reduce_mean")
def _reduce(c: VJP, dy: str) -> dict[str, str]:
    shape = c.t("x").shape
    d = c.params.get("dim", -1) % len(shape)
    g = c.emit("expand", {"x": dy}, "x", dim=d, size=shape[d])
    if c.op.kernel == "reduce_mean":
        g = c.emit("scale", {"x": g}, "x", alpha=1.0 / shape[d])
    return {"x": g}


@rule("expand")
def _expand(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("reduce_sum", {"x": dy}, "x", dim=c.params.get("dim", 0))}


@rule("embedding")
def _embedding(c: VJP, dy: str) -> dict[str, str]:
    pad = {"padding_idx": c.params["padding_idx"]} if c.params.get("padding_idx") is not None else {}
    return {"table": c.emit("embedding_grad", {"ids": c.name("ids"), "dy": dy}, "table",
                            vocab=c.t("table").shape[0], **pad)}


@rule("conv2d")
def _conv2d(c: VJP, dy: str) -> dict[str, str]:
    st, pad = c.params.get("stride", 1), c.params.get("padding", 0)
    dil = {"dilation": c.params["dilation"]} if c.params.get("dilation", 1) != 1 else {}
    x, w = c.t("x").shape, c.t("w").shape
    out = {}
    if "x" in c.need:
        if st in (1, [1, 1], (1, 1)):
            out["x"] = c.emit("conv2d_input_grad", {"dy": dy, "w": c.name("w")}, "x", padding=pad, **dil)
        else:  # whole blocks of stride rows and columns, cropped to the input's plane
            g = c.emit("conv2d_input_grad", {"dy": dy, "w": c.name("w")}, "x", stride=st, padding=pad,
                       size=[x[2], x[3]], **dil)
            for axis in (2, 3):
                if c.b.tensor(g).shape[axis] != x[axis]:
                    g = c.emit("slice", {"x": g}, "x", axis=axis, start=0, stop=x[axis])
            out["x"] = g
    if "w" in c.need:
        out["w"] = c.emit("conv2d_weight_grad", {"x": c.name("x"), "dy": dy}, "w", stride=st, padding=pad,
                          window=[w[2], w[3]], **dil)
    return out


@rule("conv2d_input_grad")
def _conv2d_input_grad(c: VJP, dy: str) -> dict[str, str]:
    """The transposed convolution's (ONNX ``ConvTranspose``'s) VJP: ``y[h] = Σ x[o]·w[i]`` over
    ``o·s - top + i·d = h``, so ``dx`` is the forward ``conv2d`` of ``g`` with ``w`` and ``dw`` is
    ``conv2d_weight_grad`` with ``g`` as the conv's input (the same strides, pads, dilations).

    Only ``g``'s rows below ``R = s·(O - 1) - top + d·(K - 1) + 1`` (``O`` the rows of ``x``) reach
    an ``x`` row: rows past ``R`` (whole blocks of ``y`` beyond the last tap) are cropped, and the
    end padding is ``R - rows``, so that the conv's output has exactly ``O`` rows."""
    st, pad = c.params.get("stride", 1), c.params.get("padding", 0)
    dil = c.params.get("dilation", 1)
    (sh, sw), (dh, dw) = pair(st, "stride", 1), pair(dil, "dilation", 1)
    t, l, _, _ = pads4(pad, "padding")
    x, w = c.t("dy").shape, c.t("w").shape
    g = dy
    ends = []
    for axis, s, d, begin in ((2, sh, dh, t), (3, sw, dw, l)):
        reach = s * (x[axis] - 1) - begin + d * (w[axis] - 1) + 1
        if reach < 1:
            raise AutodiffError(f"op {c.op.name!r}: conv2d_input_grad whose padding {pad} crops every output row")
        if c.b.tensor(g).shape[axis] > reach:
            g = c.emit("slice", {"x": g}, "g", axis=axis, start=0, stop=reach)
        ends.append(reach - c.b.tensor(g).shape[axis])
    p = {"stride": st, "padding": [t, l, ends[0], ends[1]],
         **({"dilation": dil} if dil not in (1, [1, 1], (1, 1)) else {})}
    out = {}
    if "dy" in c.need:
        out["dy"] = c.emit("conv2d", {"x": g, "w": c.name("w")}, "dy", **p)
    if "w" in c.need:
        out["w"] = c.emit("conv2d_weight_grad", {"x": g, "dy": c.name("dy")}, "w", window=[w[2], w[3]], **p)
    return out


# -- pooling and batch normalisation (inference form) ---------------------------------------------

@rule("maxpool2d", "avgpool2d")
def _pool2d(c: VJP, dy: str) -> dict[str, str]:
    p = {"window": list(c.params.get("window", [2, 2])), "stride": list(c.params.get("stride", [2, 2])),
         "padding": c.params.get("padding", 0), "size": list(c.t("x").shape),
         **({"ceil_mode": True} if c.params.get("ceil_mode") else {}),
         **({"dilation": c.params["dilation"]} if c.params.get("dilation", 1) != 1 else {})}
    if c.op.kernel == "maxpool2d":
        return {"x": c.emit("maxpool2d_grad", {"x": c.name("x"), "dy": dy}, "x", **p)}
    return {"x": c.emit("avgpool2d_grad", {"dy": dy}, "x", count_include_pad=c.params.get("count_include_pad", True),
                        **p)}


@rule("batchnorm2d")
def _batchnorm2d(c: VJP, dy: str) -> dict[str, str]:
    eps = c.params.get("eps", 1e-5)
    out = {}
    if "x" in c.need:
        out["x"] = c.emit("batchnorm2d_input_grad", {"dy": dy, "scale": c.name("scale"), "var": c.name("var")}, "x",
                          eps=eps)
    stats = {"dy": dy, "x": c.name("x"), "scale": c.name("scale"), "mean": c.name("mean"), "var": c.name("var")}
    for port in ("scale", "mean", "var"):
        if port in c.need:
            out[port] = c.emit("batchnorm2d_param_grad", stats, port, eps=eps, wrt=port)
    if "bias" in c.need:  # Σ dy over all but the channel: sum to [C, 1, ...], then drop the ones
        x = c.t("x").shape
        ch = x[1]
        summed = c.emit("reduce_to", {"x": dy}, "bias", shape=[ch] + [1] * (len(x) - 2))
        out["bias"] = c.emit("reshape", {"x": summed}, "bias", shape=[ch], **{"from": [ch] + [1] * (len(x) - 2)})
    return out


# -- group normalisation, padding and scans (kernels of imported programs) ----------------------

@rule("group_norm")
def _group_norm(c: VJP, dy: str) -> dict[str, str]:
    """``dx`` by ``group_norm_grad``; the scale and bias gradients are ``Σ dy·x̂`` and ``Σ dy``
    over the batch and spatial cells (``reduce_to`` ``[C, 1, ...]``, a batch reduction that data
    parallelism splits), then per group for ONNX opset 18's per-group affine."""
    p = {k: c.params[k] for k in ("groups", "eps", "affine") if k in c.params}
    x = c.t("x").shape
    out = {}
    if "x" in c.need:
        out["x"] = c.emit("group_norm_grad", {"dy": dy, "x": c.name("x"), "scale": c.name("scale")}, "x", **p)
    for port in ("scale", "bias"):
        if port not in c.need:
            continue
        g = dy
        if port == "scale":
            xhat = c.emit("group_normalize", {"x": c.name("x")}, port,
                          **{k: v for k, v in p.items() if k != "affine"})
            g = c.emit("mul", {"a": dy, "b": xhat}, port)
        per_channel = [x[1]] + [1] * (len(x) - 2)
        if per_channel != [x[1]]:
            g = c.emit("reduce_to", {"x": g}, port, shape=per_channel)
            g = c.emit("reshape", {"x": g}, port, shape=[x[1]], **{"from": per_channel})
        else:
            g = c.emit("reduce_to", {"x": g}, port, shape=[x[1]])
        if c.t(port).shape != (x[1],):  # per group: the sum over each group's channels
            groups = c.t(port).shape[0]
            g = c.emit("reshape", {"x": g}, port, shape=[groups, x[1] // groups], **{"from": [x[1]]})
            g = c.emit("reduce_sum", {"x": g}, port, dim=1)
        out[port] = g
    return out


@rule("pad")
def _pad(c: VJP, dy: str) -> dict[str, str]:
    # cropping is the adjoint of zero padding and padding that of cropping; the fill has no gradient
    return {"x": c.emit("pad", {"x": dy}, "x", axis=c.params.get("axis", 0), before=-c.params.get("before", 0),
                        after=-c.params.get("after", 0))}


@rule("pad_copy")
def _pad_copy(c: VJP, dy: str) -> dict[str, str]:
    axis = c.params.get("axis", 0) % len(c.t("x").shape)
    return {"x": c.emit("pad_copy_grad", {"dy": dy}, "x", axis=axis, before=c.params.get("before", 0),
                        after=c.params.get("after", 0), mode=c.params.get("mode", "edge"),
                        size=c.t("x").shape[axis])}


@rule("cumsum")
def _cumsum(c: VJP, dy: str) -> dict[str, str]:
    return {"x": c.emit("cumsum", {"x": dy}, "x", axis=c.params.get("axis", 0),
                        exclusive=c.params.get("exclusive", False), reverse=not c.params.get("reverse", False))}
