"""Kernel signatures: what a block operation reads and writes for any box of its index space.

A kernel declares
- its input port names (every kernel has one output port, ``y``);
- ``signature(inputs, params)``: the named index dimensions and their extents (from input
  shapes and params), one ``Projection`` per input and for the output, the output's shape and
  dtype, FLOPs per index point, and the hidden reductions that ``split_reduction`` may split
  (with their monoid);
- ``compute(xp, blocks, params)``: the block function, written once against the array API
  (``xp`` is ``numpy`` or ``cupy``). It receives exactly the projected input boxes and returns
  the output box.

Every index dimension is output-injective: distinct index points write distinct output cells.
Reductions hide in projection shapes (matmul's ``k`` is a full-extent shape, not a dimension).

Reduction splitting is generic: with ``params["split"] = {"reduction": r, "parts": k}`` the
signature gains a leading block dimension ``kb`` of extent ``k``; every input that spans ``r``
reads only block ``kb``'s chunk, and the output gains a leading dimension of partials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import numpy as np

from ir.zspace import Projection, ZRange, project_boxes

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPE = "int32"  # token ids and labels; read only by a kernel's ``index_ports``
DTYPES = FLOAT_DTYPES + (INDEX_DTYPE,)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}

# Named kernel properties that rewrites query (tinygrad's GroupOp idea).
ELEMENTWISE = "elementwise"  # index space = output shape, identity output projection
MONOIDS = ("sum", "max")


class SignatureError(ValueError):
    """The kernel cannot be applied to these inputs/params; the message says why."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Reduction:
    """A hidden reduction: extent, monoid, and which dim of which input ports spans it."""

    name: str
    extent: int
    monoid: str
    spans: tuple[tuple[str, int], ...]  # (input port, tensor dim)


@dataclass(frozen=True)
class Signature:
    dims: tuple[str, ...]
    extents: tuple[int, ...]
    inputs: Mapping[str, Projection]
    output: Projection
    out_spec: TensorSpec
    flops_per_point: float
    reductions: tuple[Reduction, ...] = ()
    in_specs: Mapping[str, TensorSpec] = field(default_factory=dict)
    split_from: Reduction | None = None  # set on a partial op: the reduction it splits

    @property
    def index(self) -> ZRange:
        return ZRange.of_shape(self.extents)

    def dim_index(self, dim: str | int) -> int:
        if isinstance(dim, int) or (isinstance(dim, str) and dim.lstrip("-").isdigit()):
            i = int(dim)
            if not -len(self.dims) <= i < len(self.dims):
                raise SignatureError(f"dimension {i} out of range; index dims are {list(self.dims)}")
            return i % len(self.dims)
        if dim not in self.dims:
            raise SignatureError(f"no index dimension {dim!r}; index dims are {list(self.dims)}")
        return self.dims.index(dim)

    def flops(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """FLOPs of each index box (rows of ``lo``/``hi``)."""
        return np.prod(hi - lo, axis=1).astype(np.float64) * self.flops_per_point

    def io_bytes(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bytes each box reads (projected input boxes clipped to their tensors) and writes."""
        read = np.zeros(lo.shape[0])
        for port, proj in self.inputs.items():
            spec = self.in_specs[port]
            read += clipped_size(proj, lo, hi, spec.shape) * ITEMSIZE[spec.dtype]
        written = clipped_size(self.output, lo, hi, self.out_spec.shape) * ITEMSIZE[self.out_spec.dtype]
        return read, written


def clipped_size(proj: Projection, lo: np.ndarray, hi: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    tlo, thi = project_boxes(proj, lo, hi)
    tlo = np.clip(tlo, 0, np.array(shape))
    thi = np.clip(thi, tlo, np.array(shape))
    return np.prod(thi - tlo, axis=1).astype(np.float64)


class Kernel:
    """Base of all kernels. Leaves set the class attributes and two or three methods."""

    name: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]]
    properties: ClassVar[frozenset[str]] = frozenset()
    kernel_class: ClassVar[str] = "default"  # efficiency class for the cost model
    params_defaults: ClassVar[Mapping[str, Any]] = {}
    # Ports that take integer indices (int32: token ids, labels); every other port takes floats of
    # one dtype. An index port's values are checked against ``value_range`` by the executor.
    index_ports: ClassVar[tuple[str, ...]] = ()
    # Ports of ``inputs`` an op may leave unconnected (attention's ``bias``): the kernel reads them when given.
    optional_inputs: ClassVar[tuple[str, ...]] = ()

    # -- to implement -------------------------------------------------------------------
    def base_signature(self, ins: Mapping[str, TensorSpec], params: Mapping[str, Any]) -> Signature:
        raise NotImplementedError

    def compute(self, xp: Any, blocks: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def partial_compute(self, xp: Any, blocks: Mapping[str, Any], params: Mapping[str, Any], block: int) -> Any:
        """Compute for reduction block ``block`` of a split op (linear adds its bias once)."""
        return self.compute(xp, blocks, params)

    def batched_partials(self, xp: Any, blocks: Mapping[str, Any], params: Mapping[str, Any],
                         spans: Mapping[str, int], first: int, n: int, chunk: int) -> Any:
        """The partials of reduction blocks ``first .. first + n`` of a split op in one call,
        stacked on a new leading axis (what :meth:`run`'s loop over :meth:`partial_compute`
        returns), or None where the kernel has no such form. ``spans``: the tensor dim of each
        port that the split reduction runs along (``chunk`` cells a block)."""
        return None

    def value_range(self, port: str, ins: Mapping[str, TensorSpec],
                    params: Mapping[str, Any]) -> tuple[float, float] | None:
        """The half-open range ``[lo, hi)`` of values port ``port`` accepts, or None for any value.

        Index ports say which indices exist (embedding ids: ``[0, vocab)``); state ports of
        optimizers say which values are meaningful (AdamW's second moment is >= 0). The executor
        draws random inputs inside these ranges.
        """
        return None

    # -- shared machinery --------------------------------------------------------------
    def check_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        allowed = set(self.params_defaults) | {"split"}
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise SignatureError(
                f"kernel {self.name!r} has no parameter {unknown[0]!r}; its parameters are {sorted(allowed)}"
            )
        return {**self.params_defaults, **params}

    def signature(self, ins: Mapping[str, TensorSpec], params: Mapping[str, Any]) -> Signature:
        missing = [p for p in self.inputs if p not in ins and p not in self.optional_inputs]
        extra = [p for p in ins if p not in self.inputs]
        if missing or extra:
            raise SignatureError(
                f"kernel {self.name!r} takes inputs {list(self.inputs)}; "
                + (f"missing {missing}" if missing else f"unexpected {extra}")
            )
        dtypes = {s.dtype for p, s in ins.items() if p not in self.index_ports}
        for port, spec in ins.items():
            allowed = (INDEX_DTYPE,) if port in self.index_ports else FLOAT_DTYPES
            if spec.dtype not in allowed:
                raise SignatureError(f"kernel {self.name!r} input {port!r} has dtype {spec.dtype!r}; "
                                     f"allowed: {list(allowed)}")
            if len(spec.shape) == 0:
                raise SignatureError(f"input {port!r} is 0-dimensional; tensors have rank >= 1")
        if len(dtypes) > 1:
            raise SignatureError(f"kernel {self.name!r} needs one dtype for all inputs, got {sorted(dtypes)}")
        p = self.check_params(params)
        sig = self.base_signature(ins, p)
        sig = Signature(sig.dims, sig.extents, sig.inputs, sig.output, sig.out_spec, sig.flops_per_point,
                        sig.reductions, dict(ins))
        if p.get("split"):
            sig = split_signature(sig, p["split"])
        return sig

    def run(self, xp: Any, blocks: Mapping[str, Any], params: Mapping[str, Any], box: ZRange,
            sig: Signature) -> Any:
        """Compute the output block of index box ``box`` (handles split reductions)."""
        split = params.get("split")
        if not split:
            return self.compute(xp, blocks, params)
        red = sig.split_from
        chunk = red.extent // split["parts"]
        spans = dict(red.spans)
        n = box.end[0] - box.start[0]
        if n > 1:  # one batched call, not a kernel launch (and on a GPU ~0.1 ms of host time) a block
            stacked = self.batched_partials(xp, blocks, params, spans, int(box.start[0]), int(n), chunk)
            if stacked is not None:
                return stacked
        parts = []
        for j in range(box.start[0], box.end[0]):
            local = j - box.start[0]
            sub = {}
            for port, arr in blocks.items():
                if port in spans:
                    idx = [slice(None)] * arr.ndim
                    idx[spans[port]] = slice(local * chunk, (local + 1) * chunk)
                    arr = arr[tuple(idx)]
                sub[port] = arr
            parts.append(self.partial_compute(xp, sub, params, j))
        return xp.stack(parts, axis=0)


def split_signature(sig: Signature, split: Mapping[str, Any]) -> Signature:
    """The signature of the partial op: leading block dim ``kb``, inputs read one chunk each."""
    name, parts = split.get("reduction"), split.get("parts")
    red = next((r for r in sig.reductions if r.name == name), None)
    if red is None:
        raise SignatureError(f"no splittable reduction {name!r}; splittable: {[r.name for r in sig.reductions]}")
    if not isinstance(parts, int) or parts < 2 or red.extent % parts:
        raise SignatureError(f"reduction {name!r} of extent {red.extent} cannot be split into {parts} equal blocks")
    chunk = red.extent // parts
    spans = dict(red.spans)
    inputs = {}
    for port, p in sig.inputs.items():
        A = [(0,) + row for row in p.A]
        s = list(p.s)
        if port in spans:
            r = spans[port]
            A[r] = (chunk,) + p.A[r][:]
            s[r] = chunk
        inputs[port] = Projection(tuple(A), p.b, tuple(s))
    out = Projection(((1,) + (0,) * len(sig.dims),) + tuple((0,) + row for row in sig.output.A),
                     (0,) + sig.output.b, (1,) + sig.output.s)
    new = Signature(("kb",) + sig.dims, (parts,) + sig.extents, inputs, out,
                    TensorSpec((parts,) + sig.out_spec.shape, sig.out_spec.dtype),
                    sig.flops_per_point / parts, (), sig.in_specs, red)
    return new


def identity_rows(rank: int, n_index: int, offset: int = 0) -> tuple[tuple[int, ...], ...]:
    """Rows mapping tensor dim r to index column ``offset + r``."""
    return tuple(tuple(int(c == offset + r) for c in range(n_index)) for r in range(rank))


def zero_row(n_index: int) -> tuple[int, ...]:
    return (0,) * n_index


def unit_row(n_index: int, col: int) -> tuple[int, ...]:
    return tuple(int(c == col) for c in range(n_index))


def broadcast_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError as e:
        raise SignatureError(f"shapes {shapes} do not broadcast") from e


def gelu(xp: Any, x: Any) -> Any:
    # tanh approximation (Hendrycks & Gimpel 2016, eq. in §2), as in GPT-2 and most kernels.
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + xp.tanh(c * (x + 0.044715 * x * x * x)))
