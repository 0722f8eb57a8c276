"""Contractions: matmul, batched matmul, linear (x·W + b) and two-operand einsum.

Index dims are the output's dims; the contracted dims hide in projection shapes at full extent
and are declared as splittable ``sum`` reductions.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ir.kernels.base import Kernel, Reduction, Signature, SignatureError, TensorSpec, unit_row, zero_row
from ir.zspace import Projection, identity_projection


def _letters_projection(letters: str, out: str, shape: tuple[int, ...]) -> Projection:
    n = len(out)
    rows, s = [], []
    for L, ext in zip(letters, shape):
        if L in out:
            rows.append(unit_row(n, out.index(L)))
            s.append(1)
        else:
            rows.append(zero_row(n))
            s.append(ext)
    return Projection(tuple(rows), (0,) * len(letters), tuple(s))


def einsum_signature(eq: str, ins: Mapping[str, TensorSpec], alpha_ok: bool = True) -> Signature:
    """Signature of ``a,b -> out`` in einsum notation (ports ``a`` and ``b``)."""
    m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]+)", eq.replace(" ", ""))
    if not m:
        raise SignatureError(f"einsum equation {eq!r} must look like 'ij,jk->ik' (two operands, lowercase)")
    la, lb, lo = m.groups()
    for part in (la, lb, lo):
        if len(set(part)) != len(part):
            raise SignatureError(f"einsum equation {eq!r} repeats a letter within one operand")
    if set(lo) - set(la + lb):
        raise SignatureError(f"einsum output letters {sorted(set(lo) - set(la + lb))} appear in no input")
    a, b = ins["a"], ins["b"]
    if len(la) != len(a.shape) or len(lb) != len(b.shape):
        raise SignatureError(f"einsum {eq!r} needs ranks {len(la)},{len(lb)}; got shapes {a.shape}, {b.shape}")
    ext: dict[str, int] = {}
    for letters, shape, port in ((la, a.shape, "a"), (lb, b.shape, "b")):
        for L, e in zip(letters, shape):
            if ext.setdefault(L, e) != e:
                raise SignatureError(f"einsum letter {L!r} has extent {ext[L]} and {e} (input {port!r})")
    reduced = [L for L in dict.fromkeys(la + lb) if L not in lo]
    flops = 2.0
    for L in reduced:
        flops *= ext[L]
    reds = tuple(
        Reduction(L, ext[L], "sum", tuple((p, ls.index(L)) for p, ls in (("a", la), ("b", lb)) if L in ls))
        for L in reduced
    )
    out_shape = tuple(ext[L] for L in lo)
    return Signature(tuple(lo), out_shape,
                     {"a": _letters_projection(la, lo, a.shape), "b": _letters_projection(lb, lo, b.shape)},
                     identity_projection(len(lo)), TensorSpec(out_shape, a.dtype), flops, reds)


def _scaled(y: Any, alpha: float) -> Any:
    return y if alpha == 1.0 else y * alpha


def _blocks_first(xp: Any, arr: Any, dim: int, n: int, chunk: int) -> Any:
    """``arr`` with its dim ``dim`` (``n`` reduction blocks of ``chunk``) split in two and the
    block axis moved to the front (a view: splitting one axis needs no copy)."""
    shape = tuple(arr.shape)
    return xp.moveaxis(arr.reshape(shape[:dim] + (n, chunk) + shape[dim + 1:]), dim, 0)


def _batched_matmul(xp: Any, a: Any, b: Any, spans: Any, n: int, chunk: int, ports: tuple[str, str]) -> Any:
    """``matmul`` of every block's chunks at once (broadcast over the block axis in front); the
    right operand gets unit axes where the left has batch dims it lacks (linear's ``W``)."""
    a = _blocks_first(xp, a, spans[ports[0]], n, chunk)
    b = _blocks_first(xp, b, spans[ports[1]], n, chunk)
    vector = a.ndim == 2  # linear of one feature vector: a row per block, dropped again after
    if vector:
        a = a.reshape((n, 1, chunk))
    if b.ndim < a.ndim:
        b = b.reshape((b.shape[0],) + (1,) * (a.ndim - b.ndim) + tuple(b.shape[1:]))
    y = xp.matmul(a, b)
    return y.reshape((n,) + tuple(y.shape[2:])) if vector else y


def _ab_partials(self: Kernel, xp: Any, blocks: Any, params: Any, spans: Any, first: int, n: int, chunk: int) -> Any:
    """``Kernel.batched_partials`` of ``matmul`` and ``bmm`` (operands ``a`` and ``b``)."""
    return _scaled(_batched_matmul(xp, blocks["a"], blocks["b"], spans, n, chunk, ("a", "b")), params["alpha"])


class Einsum(Kernel):
    """General two-operand contraction, e.g. ``bsd,dhe->bhse`` for per-head projections."""

    name = "einsum"
    inputs = ("a", "b")
    # its own subclass: executors pay its operands' transposes (NumPy's and CuPy's einsum); a
    # hardware without a "matmul.einsum" entry charges it as "matmul" (costmodel.hardware)
    kernel_class = "matmul.einsum"
    # ``origin``: the chain a reassociation replaced (``ir.rewrites.substitute_reassoc``), else None.
    params_defaults = {"equation": "", "alpha": 1.0, "origin": None}

    def base_signature(self, ins, params):
        return einsum_signature(params["equation"], ins)

    def compute(self, xp, blocks, params):
        # NumPy's einsum is a naive loop unless told to optimise (then tensordot: BLAS, like the
        # GEMM the cost model charges, ~7x faster at 4x128x256 @ 256x4x64 on one core)
        kw = {"optimize": True} if getattr(xp, "__name__", "") == "numpy" else {}
        return _scaled(xp.einsum(params["equation"], blocks["a"], blocks["b"], **kw), params["alpha"])


class Matmul(Kernel):
    """``y[m,n] = alpha · Σ_k a[m,k] b[k,n]``."""

    name = "matmul"
    inputs = ("a", "b")
    kernel_class = "matmul"
    params_defaults = {"alpha": 1.0}

    def base_signature(self, ins, params):
        if len(ins["a"].shape) != 2 or len(ins["b"].shape) != 2:
            raise SignatureError(f"matmul takes 2-D inputs, got {ins['a'].shape} and {ins['b'].shape}; use bmm")
        return einsum_signature("mk,kn->mn", ins)

    def compute(self, xp, blocks, params):
        return _scaled(xp.matmul(blocks["a"], blocks["b"]), params["alpha"])

    batched_partials = _ab_partials


class BatchedMatmul(Kernel):
    """``y[*b,m,n] = alpha · Σ_k a[*b,m,k] b[*b,k,n]`` with equal leading batch dims."""

    name = "bmm"
    inputs = ("a", "b")
    kernel_class = "matmul"
    params_defaults = {"alpha": 1.0}

    def base_signature(self, ins, params):
        a, b = ins["a"].shape, ins["b"].shape
        if len(a) < 3 or len(a) != len(b):
            raise SignatureError(f"bmm takes inputs of one rank >= 3, got {a} and {b}")
        batch = "abcdefgh"[: len(a) - 2]
        return einsum_signature(f"{batch}mk,{batch}kn->{batch}mn", ins)

    def compute(self, xp, blocks, params):
        return _scaled(xp.matmul(blocks["a"], blocks["b"]), params["alpha"])

    batched_partials = _ab_partials


class Linear(Kernel):
    """``y[*n, o] = Σ_f x[*n, f] W[f, o] + b[o]``."""

    name = "linear"
    inputs = ("x", "W", "b")
    kernel_class = "matmul"

    def base_signature(self, ins, params):
        x, W, b = ins["x"].shape, ins["W"].shape, ins["b"].shape
        if len(W) != 2 or len(b) != 1 or x[-1] != W[0] or b[0] != W[1]:
            raise SignatureError(f"linear needs x[..., F], W[F, O], b[O]; got x{list(x)}, W{list(W)}, b{list(b)}")
        batch = "nmpqrs"[: len(x) - 1]
        sig = einsum_signature(f"{batch}f,fz->{batch}z", {"a": ins["x"], "b": ins["W"]})
        n = len(batch) + 1
        dims = tuple(("n" if len(batch) == 1 else f"n{i}") for i in range(len(batch))) + ("o",)
        red = sig.reductions[0]
        red = Reduction("f", red.extent, "sum", (("x", len(x) - 1), ("W", 0)))
        return Signature(dims, sig.extents,
                         {"x": sig.inputs["a"], "W": sig.inputs["b"],
                          "b": Projection((unit_row(n, n - 1),), (0,), (1,))},
                         sig.output, sig.out_spec, sig.flops_per_point + 1.0, (red,))

    def compute(self, xp, blocks, params):
        return xp.matmul(blocks["x"], blocks["W"]) + blocks["b"]

    def partial_compute(self, xp, blocks, params, block):
        # The bias belongs to exactly one partial, so the accumulated sum adds it once.
        y = xp.matmul(blocks["x"], blocks["W"])
        return y + blocks["b"] if block == 0 else y

    def batched_partials(self, xp, blocks, params, spans, first, n, chunk):
        y = _batched_matmul(xp, blocks["x"], blocks["W"], spans, n, chunk, ("x", "W"))
        if first == 0:  # the bias goes with block 0 alone, as in partial_compute
            y[0] += blocks["b"]
        return y


KERNELS = (Einsum, Matmul, BatchedMatmul, Linear)
