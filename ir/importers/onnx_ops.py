"""One handler per ONNX op type: a node -> kernels of the block graph.

A handler reads its inputs through the ``Context`` (``ctx.use(name)`` gives the graph tensor of
an ONNX value, turning a constant into a parameter), emits ops, and records each ONNX output's
graph tensor. It raises :class:`Unsupported` (with a reason) for attribute values it cannot map;
the importer collects those and reports them all at once.

Mapping choices (why):
- Scalar constants in ``Mul``/``Div`` become ``scale`` (alpha), in ``Pow`` the exponent of ``pow``,
  ``Clip``'s bounds the ``min``/``max`` of ``clip``: no one-cell parameter tensors for the search
  to shard or move (a bound the model computes is refused).
- ``MatMul`` with a 2-D right operand is ``matmul`` (2-D left) or ``einsum`` ``...f,fo->...o``; two
  activations of one rank >= 3 are ``bmm``; ``Gemm`` is an ``einsum`` with its transposes in the
  equation, so weights keep their ONNX names and layouts.
- ``Conv`` and pooling: ``ir.importers.onnx_conv``; ``BatchNormalization``:
  ``ir.importers.onnx_batchnorm``; comparisons and boolean ops (masks): ``ir.importers.onnx_masks``;
  ``Einsum``: ``ir.importers.onnx_einsum``. They register into ``HANDLERS`` here.
- ``Gather`` of an initializer table by runtime ids is ``embedding``; by constant contiguous
  indices it is ``slice`` (+ ``reshape`` for a scalar index).
- ``Where(cond, x, fill)``, ``Where(future, fill, x)`` (PyTorch's ``masked_fill``) and
  ``Add(x, mask)`` with a constant lower-triangular causal pattern and a fill at or below -1e30
  are ``causal_mask``; other ``Where`` conditions are float masks (computed ones from
  ``ir.importers.onnx_masks``, or ``index_to_float`` copies of integer tensors), and a ``Where``
  with a scalar constant branch is ``masked_fill`` (the fill a parameter of the op).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ir.importers.program import _BAD, Program


class Unsupported(Exception):
    """This node (with these attributes) has no mapping; the message says what is missing."""


_ONNX_FLOAT = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64"}


class Context:
    def __init__(self, prog: Program, const: dict[str, np.ndarray], dtype: str, opset: int,
                 initializers: frozenset[str] = frozenset()) -> None:
        self.prog, self.const, self.dtype, self.opset = prog, const, dtype, opset
        self.initializers = initializers  # keep their ONNX names; folded constants get tidy ones
        self.aliases: dict[str, str] = {}
        self._params: dict[str, str] = {}
        # Graph tensors that hold integers as floats: views of an int32 tensor run on its
        # ``index_to_float`` copy (the view kernels take floats), so a later Cast to float is a no-op.
        self.int_valued: set[str] = set()
        # Graph tensors that hold booleans as floats of 0 and 1 (``ir.importers.onnx_masks``); also int-valued.
        self.bool_valued: set[str] = set()
        self._floated: dict[str, str] = {}
        # Float copies of int32 ids, and their reshapes (``Reshape``, ``Flatten``, ``Squeeze``,
        # ``Unsqueeze``): graph tensor -> the int32 tensor whose cells it holds in row-major order.
        self.id_views: dict[str, str] = {}
        self.padding_rows: dict[str, int] = {}  # embedding table -> its padding row (``import_onnx``)
        # ONNX values with no cells (an empty Slice): (shape, node label); not graph tensors, Concat skips them
        self.empty: dict[str, tuple[tuple[int, ...], str]] = {}

    # -- values ---------------------------------------------------------------------------
    def is_const(self, name: str) -> bool:
        return name in self.const

    def resolve(self, name: str) -> str:
        while name in self.aliases:
            name = self.aliases[name]
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.const:
            return tuple(self.const[name].shape)
        if name in self.empty:
            return self.empty[name][0]
        return self.prog.tensors[self.resolve(name)].shape

    def value(self, name: str) -> np.ndarray:
        if name not in self.const:
            raise Unsupported(f"input {name!r} must be a constant")
        return self.const[name]

    def use(self, name: str) -> str:
        """The graph tensor holding ONNX value ``name`` (a constant becomes a parameter)."""
        if name not in self.const:
            if name in self.empty:
                raise Unsupported(f"it reads {name!r}, an empty slice {list(self.empty[name][0])}; only a Concat "
                                  f"may (the IR has no tensors without cells)")
            t = self.resolve(name)
            if t not in self.prog.tensors:
                raise Unsupported(f"value {name!r} has no producer")
            return t
        if name in self._params:
            return self._params[name]
        v = np.asarray(self.const[name])
        if v.dtype.kind in "iu":
            v = v.astype(np.int32)
            dt = "int32"
        else:
            # a weight stored in half precision is one in the program too, whatever the inputs'
            # dtype (a bf16 layer fed by a Cast of an fp32 input); scalars follow the program
            own = str(v.dtype)
            dt = own if own in ("float16", "bfloat16") and v.size > 1 else self.dtype
            v = v.astype(np.float32 if dt == "bfloat16" else dt)
        if v.ndim == 0:
            v = v.reshape(1)
        tidy = name if name in self.initializers else _BAD.sub("_", name).strip("_.+-") or "const"
        t = self.prog.tensor_name(tidy)
        self.prog.source(t, v.shape, dt, "parameter", v)
        self._params[name] = t
        return t

    def float_view(self, name: str) -> str:
        """An ONNX value name whose graph tensor is the ``index_to_float`` copy of the computed
        ``int32`` tensor of ``name`` (emitted once per tensor)."""
        t = self.resolve(name)
        if t not in self._floated:
            self._floated[t] = self.prog.emit("index_to_float", {"x": t}, {"dtype": self.dtype},
                                              name=f"{t}.as_float")
            self.int_valued.add(self._floated[t])
            self.id_views[self._floated[t]] = t
        alias = f"{name}#float"
        self.aliases[alias] = self._floated[t]
        return alias

    def note_id_view(self, src: str, out: str) -> None:
        """Record that graph tensor ``out`` holds the cells of ``src`` in row-major order, if ``src``
        holds int32 ids (itself, its float copy, or such a view of them)."""
        ids = self.id_views.get(src) or (
            src if src in self.prog.tensors and self.prog.spec(src).dtype == "int32" else None)
        if ids is not None and out != src and out in self.prog.tensors:
            self.id_views[out] = ids

    def set(self, onnx_name: str, tensor: str) -> None:
        """Record that ONNX value ``onnx_name`` is graph tensor ``tensor``."""
        if onnx_name != tensor:
            self.aliases[onnx_name] = tensor

    def emit(self, kernel: str, inputs: dict[str, str], params: dict[str, Any] | None = None,
             out: str | None = None, name: str | None = None) -> str:
        t = self.prog.emit(kernel, inputs, params, out=out, name=name)
        if out is not None:
            self.set(out, t)
        return t

    # -- constant folding --------------------------------------------------------------
    def fold(self, node: Any) -> None:
        """Evaluate a node on constants (or ``Shape``/``Size`` of a known tensor) with ONNX's
        reference implementation."""
        from onnx.reference import ReferenceEvaluator  # noqa: PLC0415

        if node.op_type in ("Shape", "Size") and node.input[0] not in self.const:
            shape = np.array(self.shape(node.input[0]), dtype=np.int64)
            if node.op_type == "Size":
                self.const[node.output[0]] = np.array(int(np.prod(shape)), dtype=np.int64)
                return
            start, end = attr(node, "start", 0), attr(node, "end", None)
            self.const[node.output[0]] = shape[start:end]
            return
        feeds = {x: self.const[x] for x in node.input if x}
        if node.op_type == "GatherElements":  # the reference's np.choose fails past 32-64 source rows
            data, idx = feeds[node.input[0]], feeds[node.input[1]]
            axis = attr(node, "axis", 0) % max(data.ndim, 1)
            if idx.size and (idx.min() < -data.shape[axis] or idx.max() >= data.shape[axis]):
                raise Unsupported(f"its indices fall outside axis {axis} of length {data.shape[axis]}")
            self.const[node.output[0]] = np.take_along_axis(data, np.where(idx < 0, idx + data.shape[axis], idx), axis)
            return
        try:
            outs = ReferenceEvaluator(node, opsets={"": self.opset}).run(None, feeds)
        except Exception as e:  # noqa: BLE001  (the reference raises assorted errors)
            raise Unsupported(f"cannot evaluate on constants: {type(e).__name__}: {str(e)[:120]}") from None
        for name, v in zip(node.output, outs):
            if name:
                self.const[name] = np.asarray(v)


def float_operand(ctx: Context, name: str) -> str:
    """The graph tensor of ONNX value ``name`` as floats: a constant (bool, int or float) becomes a
    float parameter, a computed ``int32`` tensor its ``index_to_float`` copy."""
    if ctx.is_const(name):
        v = ctx.const[name]
        if v.dtype.kind != "f":
            ctx.const[f"{name}.float"] = v.astype(np.float32)
            name = f"{name}.float"
        return ctx.use(name)
    t = ctx.use(name)
    if ctx.prog.spec(t).dtype == "int32":
        return ctx.use(ctx.float_view(name))
    return t


def attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper  # noqa: PLC0415

    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _is_float(v: np.ndarray) -> bool:
    """A float array, bfloat16 included (ONNX's bfloat16 arrays are ``ml_dtypes``', numpy kind V)."""
    return v.dtype.kind == "f" or str(v.dtype) == "bfloat16"


def _scalar(ctx: Context, name: str) -> float | None:
    if ctx.is_const(name) and ctx.const[name].size == 1 and _is_float(ctx.const[name]):
        return float(ctx.const[name].reshape(-1)[0])
    return None


def _axes(ctx: Context, node: Any, input_index: int) -> list[int] | None:
    """Axes given as an attribute (older opsets) or as a constant input (newer ones)."""
    a = attr(node, "axes", None)
    if a is None and len(node.input) > input_index and node.input[input_index]:
        a = ctx.value(node.input[input_index]).astype(np.int64).tolist()
    return None if a is None else [int(x) for x in np.atleast_1d(a)]


# ---------------------------------------------------------------------------------------------
# handlers
# ---------------------------------------------------------------------------------------------

Handler = Callable[[Context, Any, str], None]
HANDLERS: dict[str, Handler] = {}


def handles(*ops: str) -> Callable[[Handler], Handler]:
    def reg(f: Handler) -> Handler:
        for op in ops:
            HANDLERS[op] = f
        return f

    return reg


_UNARY = {"Relu": "relu", "Tanh": "tanh", "Sigmoid": "sigmoid", "Exp": "exp", "Sqrt": "sqrt",
          "Reciprocal": "reciprocal", "Erf": "erf", "Abs": "abs", "Log": "log", "Mish": "mish"}


@handles(*_UNARY)
def _unary(ctx, node, label):
    ctx.emit(_UNARY[node.op_type], {"x": ctx.use(node.input[0])}, out=node.output[0], name=label)


@handles("Softplus")
def _softplus(ctx, node, label):
    ctx.emit("softplus", {"x": ctx.use(node.input[0])}, out=node.output[0], name=label)


@handles("LeakyRelu")
def _leaky_relu(ctx, node, label):
    ctx.emit("leaky_relu", {"x": ctx.use(node.input[0])}, {"alpha": float(attr(node, "alpha", 0.01))},
             out=node.output[0], name=label)


@handles("Elu")
def _elu(ctx, node, label):
    ctx.emit("elu", {"x": ctx.use(node.input[0])}, {"alpha": float(attr(node, "alpha", 1.0))},
             out=node.output[0], name=label)


@handles("Clip")
def _clip(ctx, node, label):
    """``clip`` with constant bounds: attributes ``min``/``max`` before opset 11, optional
    constant scalar inputs from opset 11 on (``torch.clamp`` and ``ReLU6`` export Constant nodes).
    An absent bound, or an infinite one, is no bound; no bound at all is the input itself. A
    bound computed by the model has no ``clip`` parameter to become: refused."""
    bounds = {}
    for k, key in ((1, "min"), (2, "max")):
        if ctx.opset < 11:
            v = attr(node, key, None)
        elif len(node.input) > k and node.input[k]:
            name = node.input[k]
            if not ctx.is_const(name):
                raise Unsupported(f"its {key} bound {name!r} is not a constant (the model computes it, or it is "
                                  f"a graph input); only constant bounds (clip's parameters) are supported")
            c = ctx.const[name]
            if c.size != 1:
                raise Unsupported(f"its {key} bound {name!r} has shape {list(c.shape)}; ONNX Clip takes scalars")
            v = float(np.asarray(c, dtype=np.float64).reshape(-1)[0])
        else:
            v = None
        if v is not None and np.isnan(v):
            raise Unsupported(f"its {key} bound is NaN")
        if v is not None and np.isfinite(v):
            bounds[key] = float(v)
    x = ctx.use(node.input[0])
    if not bounds:
        ctx.set(node.output[0], x)
        return
    ctx.emit("clip", {"x": x}, bounds, out=node.output[0], name=label)


@handles("Neg")
def _neg(ctx, node, label):
    ctx.emit("scale", {"x": ctx.use(node.input[0])}, {"alpha": -1.0}, out=node.output[0], name=label)


@handles("Gelu")
def _gelu(ctx, node, label):
    kernel = "gelu" if attr(node, "approximate", "none") == "tanh" else "gelu_erf"
    ctx.emit(kernel, {"x": ctx.use(node.input[0])}, out=node.output[0], name=label)


@handles("Identity", "Dropout")
def _identity(ctx, node, label):
    if len(node.output) > 1 and node.output[1]:
        raise Unsupported("the dropout mask output is not supported (inference graphs only)")
    ctx.set(node.output[0], ctx.use(node.input[0]))


_ONNX_INT = {2, 3, 4, 5, 6, 7, 9, 12, 13}  # uint8, int8, uint16, int16, int32, int64, bool, uint32, uint64
_ONNX_BOOL = 9


@handles("Cast")
def _cast(ctx, node, label):
    """Float -> float is ``cast``; a computed integer tensor (an ``int32`` graph tensor, or one that
    ``Context.float_view`` already holds as floats) to a float is ``index_to_float``; integer ->
    integer keeps the tensor; anything to bool is ``compare_scalar(x, ne, 0)`` (a float 0/1 mask,
    kept as is when it already is one). Float -> integer would round, which no kernel does: refused."""
    code = attr(node, "to")
    src = ctx.use(node.input[0])
    dt = ctx.prog.spec(src).dtype
    is_int = dt == "int32" or src in ctx.int_valued
    if code == _ONNX_BOOL and src not in ctx.bool_valued:  # any number to 0/1: nonzero is true
        x = ctx.use(ctx.float_view(node.input[0])) if dt == "int32" else src
        ctx.bool_valued.add(ctx.emit("compare_scalar", {"x": x}, {"op": "ne", "value": 0.0}, out=node.output[0],
                                     name=label))
        ctx.int_valued.add(ctx.resolve(node.output[0]))
        return
    if code in _ONNX_INT:
        if not is_int:
            raise Unsupported(f"Cast of a computed float tensor to integer ONNX type {code} (only integer -> "
                              f"integer, integer -> float and float -> float)")
        ctx.set(node.output[0], src)
        return
    to = _ONNX_FLOAT.get(code)
    if to is None:
        raise Unsupported(f"Cast to ONNX type {code} (float16, bfloat16, float32, float64 and integers only)")
    if to == "float64":
        to = ctx.dtype
    if dt == "int32":
        ctx.emit("index_to_float", {"x": src}, {"dtype": to}, out=node.output[0], name=label)
    elif to == dt:
        ctx.set(node.output[0], src)
    else:
        ctx.emit("cast", {"x": src}, {"dtype": to}, out=node.output[0], name=label)


@handles("Add", "Sub", "Mul", "Div")
def _binary(ctx, node, label):
    a, b = node.input[0], node.input[1]
    op = node.op_type
    sa, sb = _scalar(ctx, a), _scalar(ctx, b)
    if op == "Add" and _causal_add(ctx, node, label):
        return
    if op == "Mul" and (sa is not None or sb is not None) and not (sa is not None and sb is not None):
        x, c = (b, sa) if sa is not None else (a, sb)
        ctx.emit("scale", {"x": ctx.use(x)}, {"alpha": c}, out=node.output[0], name=label)
        return
    if op == "Div" and sb is not None and sb != 0 and sa is None:
        ctx.emit("scale", {"x": ctx.use(a)}, {"alpha": 1.0 / sb}, out=node.output[0], name=label)
        return
    if op == "Div" and sa == 1.0:
        ctx.emit("reciprocal", {"x": ctx.use(b)}, out=node.output[0], name=label)
        return
    kernel = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}[op]
    if any(_is_integer(ctx, x) for x in (a, b)):  # integers (positions from ids) are computed as floats
        ctx.emit(kernel, {"a": float_operand(ctx, a), "b": float_operand(ctx, b)}, out=node.output[0], name=label)
        return
    ctx.emit(kernel, {"a": ctx.use(a), "b": ctx.use(b)}, out=node.output[0], name=label)


def _is_integer(ctx: Context, name: str) -> bool:
    """An integer constant or a computed ``int32`` tensor (not a float, nor a float holding integers)."""
    if ctx.is_const(name):
        return ctx.const[name].dtype.kind in "iub"
    return ctx.prog.spec(ctx.use(name)).dtype == "int32"


@handles("Pow")
def _pow(ctx, node, label):
    e = _scalar(ctx, node.input[1])
    if e is None and ctx.is_const(node.input[1]) and ctx.const[node.input[1]].size == 1:
        e = float(ctx.const[node.input[1]].reshape(-1)[0])
    if e is None:
        raise Unsupported("the exponent must be a constant scalar")
    x = ctx.use(node.input[0])
    if e == 0.5:
        ctx.emit("sqrt", {"x": x}, out=node.output[0], name=label)
    elif e == 1.0:
        ctx.set(node.output[0], x)
    else:
        ctx.emit("pow", {"x": x}, {"exponent": e}, out=node.output[0], name=label)


def _matmul_letters(sa: tuple[int, ...], sb: tuple[int, ...]) -> tuple[str, str, str, list[int], list[int]]:
    """ONNX's (NumPy's) MatMul of shapes ``sa`` and ``sb`` as an einsum with broadcast batch dims:
    ``(la, lb, lo, drop_a, drop_b)``, ``drop_*`` the dims of each operand to squeeze first.

    Batch dims align from the right (ONNX ``MatMul`` follows ``numpy.matmul``, multidirectional
    broadcasting); an output batch dim gets one letter, which an operand carries when it has that
    dim at full extent. A dim an operand lacks (fewer batch dims) or holds as 1 against a larger
    extent is no letter of it: the einsum reads that operand whole along the output's dim (a
    weight broadcast over the batch is read by every shard, never copied); its size-1 dims are
    squeezed by a ``reshape`` view. A 1-D operand gains a unit dim that the result drops.
    Raises ``Unsupported`` when the batch dims do not broadcast."""
    letters = "abcdefgh"
    va, vb = len(sa) == 1, len(sb) == 1
    ba, bb = (() if va else tuple(sa[:-2])), (() if vb else tuple(sb[:-2]))
    n = max(len(ba), len(bb))
    if n > len(letters):
        raise Unsupported(f"MatMul of shapes {list(sa)} and {list(sb)}: more than {len(letters)} batch dims")
    terms = {"a": "", "b": ""}
    drops: dict[str, list[int]] = {"a": [], "b": []}
    for p in range(n):
        dims = {}  # operand -> (its dim at output batch position p, its extent)
        for port, batch in (("a", ba), ("b", bb)):
            k = p - (n - len(batch))
            if k >= 0:
                dims[port] = (k, batch[k])
        ext = max(e for _, e in dims.values())
        if any(e not in (1, ext) for _, e in dims.values()):
            raise Unsupported(f"MatMul of shapes {list(sa)} and {list(sb)}: batch dims {list(ba)} and {list(bb)} "
                              f"do not broadcast")
        for port, (k, e) in dims.items():
            if e == ext:
                terms[port] += letters[p]
            else:  # a 1 against a larger extent: squeezed, read whole along the output's dim
                drops[port].append(k)
    la = terms["a"] + ("k" if va else "mk")
    lb = terms["b"] + ("k" if vb else "kn")
    lo = letters[:n] + ("" if va else "m") + ("" if vb else "n")
    return la, lb, lo, drops["a"], drops["b"]


@handles("MatMul")
def _matmul(ctx, node, label):
    """``matmul`` (2-D), ``bmm`` (equal batch dims) or ``einsum`` (a vector, a matrix or fewer
    batch dims on one side, size-1 batch dims broadcast: ``_matmul_letters``)."""
    a, b = ctx.use(node.input[0]), ctx.use(node.input[1])
    sa, sb = ctx.prog.spec(a).shape, ctx.prog.spec(b).shape
    if len(sa) == 2 and len(sb) == 2:
        ctx.emit("matmul", {"a": a, "b": b}, out=node.output[0], name=label)
        return
    if len(sa) == len(sb) and len(sa) >= 3 and sa[:-2] == sb[:-2]:
        ctx.emit("bmm", {"a": a, "b": b}, out=node.output[0], name=label)
        return
    if len(sa) == len(sb) == 1:
        raise Unsupported(f"MatMul of shapes {list(sa)} and {list(sb)}: a dot product of two vectors (a scalar)")
    la, lb, lo, drop_a, drop_b = _matmul_letters(sa, sb)
    for port, t, shape, drop in (("a", a, sa, drop_a), ("b", b, sb, drop_b)):
        if drop:
            kept = [d for k, d in enumerate(shape) if k not in drop]
            v = ctx.emit("reshape", {"x": t}, {"shape": kept, "from": list(shape)}, name=f"{label}.{port}_squeeze")
            a, b = (v, b) if port == "a" else (a, v)
    ctx.emit("einsum", {"a": a, "b": b}, {"equation": f"{la},{lb}->{lo}"}, out=node.output[0], name=label)


@handles("Gemm")
def _gemm(ctx, node, label):
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    ta, tb = attr(node, "transA", 0), attr(node, "transB", 0)
    a, b = ctx.use(node.input[0]), ctx.use(node.input[1])
    has_c = len(node.input) > 2 and node.input[2]
    if not ta and not tb and alpha == 1.0 and has_c and beta == 1.0 and len(ctx.shape(node.input[2])) == 1 \
            and ctx.shape(node.input[2])[0] == ctx.shape(node.input[1])[1]:
        ctx.emit("linear", {"x": a, "W": b, "b": ctx.use(node.input[2])}, out=node.output[0], name=label)
        return
    eq = ("km" if ta else "mk") + "," + ("nk" if tb else "kn") + "->mn"
    y = ctx.emit("einsum", {"a": a, "b": b}, {"equation": eq, "alpha": alpha},
                 out=None if has_c else node.output[0], name=label)
    if has_c:
        c = ctx.use(node.input[2])
        if beta != 1.0:
            c = ctx.emit("scale", {"x": c}, {"alpha": beta}, name=f"{label}.beta")
        ctx.emit("add", {"a": y, "b": c}, out=node.output[0], name=f"{label}.bias")


@handles("Softmax", "LogSoftmax")
def _softmax(ctx, node, label):
    """``softmax`` (``log_softmax``) over the last axis. Another axis (opset >= 13) is moved last
    by a ``permute`` and back; before opset 13 ``axis`` means the dims from ``axis`` on flattened
    into one row, a ``reshape`` to 2-D and back."""
    kernel = {"Softmax": "softmax", "LogSoftmax": "log_softmax"}[node.op_type]
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    rank = len(shape)
    axis = attr(node, "axis", -1 if ctx.opset >= 13 else 1) % rank
    if axis == rank - 1:
        ctx.emit(kernel, {"x": x}, out=node.output[0], name=label)
    elif ctx.opset < 13:
        rows = [int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64))]
        flat = ctx.emit("reshape", {"x": x}, {"shape": rows, "from": list(shape)}, name=f"{label}.rows")
        y = ctx.emit(kernel, {"x": flat}, name=label)
        ctx.emit("reshape", {"x": y}, {"shape": list(shape), "from": rows}, out=node.output[0], name=f"{label}.back")
    else:
        perm = [d for d in range(rank) if d != axis] + [axis]
        moved = ctx.emit("permute", {"x": x}, {"perm": perm}, name=f"{label}.to_last")
        y = ctx.emit(kernel, {"x": moved}, name=label)
        back = [perm.index(d) for d in range(rank)]
        ctx.emit("permute", {"x": y}, {"perm": back}, out=node.output[0], name=f"{label}.back")


@handles("Expand")
def _expand(ctx, node, label):
    """Broadcast a computed tensor to a constant shape: the size-1 dims it stretches are dropped
    by a ``reshape`` view, then each stretched or new leading dim is inserted by ``expand``
    (outermost first, so every insertion lands at its final position)."""
    x = ctx.use(node.input[0])
    xs = ctx.prog.spec(x).shape
    target = [int(v) for v in ctx.value(node.input[1]).reshape(-1)]
    n = max(len(xs), len(target))
    a = [1] * (n - len(xs)) + list(xs)
    b = [1] * (n - len(target)) + target
    out = []
    for da, db in zip(a, b):
        if da != db and 1 not in (da, db):
            raise Unsupported(f"shape {list(xs)} does not broadcast to {target}")
        out.append(max(da, db))
    lead = n - len(xs)
    stretched = [p for p in range(n) if p < lead or (a[p] == 1 and out[p] > 1)]
    if not stretched:
        ctx.set(node.output[0], x)
        return
    kept = [xs[p - lead] for p in range(lead, n) if p not in stretched]
    if len(kept) != len(xs):
        x = ctx.emit("reshape", {"x": x}, {"shape": kept or [1], "from": list(xs)}, name=f"{label}.squeeze")
    for k, p in enumerate(stretched):
        last = k == len(stretched) - 1
        if not kept and k == 0:  # x was all stretched ones: its [1] view takes the first dim's place
            x = ctx.emit("expand", {"x": x}, {"dim": 0, "size": out[p]}, name=f"{label}.{k}")
            x = ctx.emit("reshape", {"x": x}, {"shape": [out[p]], "from": [out[p], 1]}, name=f"{label}.{k}v",
                         out=node.output[0] if last else None)
            continue
        x = ctx.emit("expand", {"x": x}, {"dim": p, "size": out[p]}, out=node.output[0] if last else None,
                     name=label if k == 0 else f"{label}.{k}")


@handles("LayerNormalization")
def _layernorm(ctx, node, label):
    x = ctx.use(node.input[0])
    rank = len(ctx.prog.spec(x).shape)
    if attr(node, "axis", -1) % rank != rank - 1:
        raise Unsupported("LayerNormalization over more than the last axis")
    if any(o for o in node.output[1:]):
        raise Unsupported("the mean / inverse std-dev outputs (training only)")
    n = ctx.prog.spec(x).shape[-1]
    gamma = ctx.use(node.input[1])
    if len(node.input) > 2 and node.input[2]:
        beta = ctx.use(node.input[2])
    else:
        ctx.const[f"{label}.beta"] = np.zeros(n, np.float32)
        beta = ctx.use(f"{label}.beta")
    ctx.emit("layernorm", {"x": x, "gamma": gamma, "beta": beta}, {"eps": float(attr(node, "epsilon", 1e-5))},
             out=node.output[0], name=label)


@handles("ReduceMean", "ReduceSum", "ReduceMax")
def _reduce(ctx, node, label):
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    axes = _axes(ctx, node, 1)
    if not axes:  # none given, or an empty list: every axis, unless noop_with_empty_axes (opset 18)
        if attr(node, "noop_with_empty_axes", 0):
            ctx.set(node.output[0], x)
            return
        axes = list(range(len(shape)))
    axes = sorted({a % len(shape) for a in axes}, reverse=True)
    keep = attr(node, "keepdims", 1)
    kernel = {"ReduceMean": "reduce_mean", "ReduceSum": "reduce_sum", "ReduceMax": "reduce_max"}[node.op_type]
    if len(axes) == len(shape):
        if not keep:
            raise Unsupported("a reduction over every axis without keepdims (the result would be a scalar)")
        # every axis, kept: the cells in one row of a [1, N] view, reduced to [1], then [1, ..., 1]
        flat = ctx.emit("reshape", {"x": x}, {"shape": [1, int(np.prod(shape))], "from": list(shape)},
                        name=f"{label}.flat")
        y = ctx.emit(kernel, {"x": flat}, {"dim": 1}, name=label)
        _reshape_to(ctx, y, [1] * len(shape), node.output[0], f"{label}.keepdims")
        return
    y = x
    for k, ax in enumerate(axes):
        last = k == len(axes) - 1 and not keep
        y = ctx.emit(kernel, {"x": y}, {"dim": ax}, out=node.output[0] if last else None,
                     name=label if k == 0 else f"{label}.{k}")
    if keep:
        out_shape = [1 if i in axes else d for i, d in enumerate(shape)]
        _reshape_to(ctx, y, out_shape, node.output[0], f"{label}.keepdims")


def _reshape_to(ctx: Context, x: str, shape: list[int], out: str, label: str) -> None:
    src = ctx.prog.spec(x).shape
    if tuple(shape) == tuple(src):
        ctx.set(out, x)
        return
    ctx.emit("reshape", {"x": x}, {"shape": [int(d) for d in shape], "from": list(src)}, out=out, name=label)


@handles("Reshape")
def _reshape(ctx, node, label):
    x = ctx.use(node.input[0])
    src = ctx.prog.spec(x).shape
    want = ctx.value(node.input[1]).astype(np.int64).tolist()
    allow_zero = attr(node, "allowzero", 0)
    shape = [src[i] if (d == 0 and not allow_zero) else d for i, d in enumerate(want)]
    if shape.count(-1) == 1:
        rest = int(np.prod([d for d in shape if d != -1]))
        shape[shape.index(-1)] = int(np.prod(src)) // max(rest, 1)
    _reshape_to(ctx, x, shape, node.output[0], label)


@handles("Flatten")
def _flatten(ctx, node, label):
    x = ctx.use(node.input[0])
    src = ctx.prog.spec(x).shape
    ax = attr(node, "axis", 1)
    ax = ax + len(src) if ax < 0 else ax  # ONNX: a negative axis counts from the end, in [-r, r]
    _reshape_to(ctx, x, [int(np.prod(src[:ax])), int(np.prod(src[ax:]))], node.output[0], label)


@handles("Unsqueeze")
def _unsqueeze(ctx, node, label):
    x = ctx.use(node.input[0])
    shape = list(ctx.prog.spec(x).shape)
    axes = _axes(ctx, node, 1) or []
    rank = len(shape) + len(axes)
    for a in sorted(a % rank for a in axes):
        shape.insert(a, 1)
    _reshape_to(ctx, x, shape, node.output[0], label)


@handles("Squeeze")
def _squeeze(ctx, node, label):
    x = ctx.use(node.input[0])
    src = ctx.prog.spec(x).shape
    axes = _axes(ctx, node, 1)
    drop = {a % len(src) for a in axes} if axes is not None else {i for i, d in enumerate(src) if d == 1}
    shape = [d for i, d in enumerate(src) if i not in drop]
    if not shape:
        raise Unsupported("squeezing to a scalar")
    _reshape_to(ctx, x, shape, node.output[0], label)


@handles("Transpose")
def _transpose(ctx, node, label):
    x = ctx.use(node.input[0])
    rank = len(ctx.prog.spec(x).shape)
    perm = attr(node, "perm", None)
    perm = list(range(rank))[::-1] if perm is None else [int(p) for p in perm]
    if perm == list(range(rank)):
        ctx.set(node.output[0], x)
        return
    ctx.emit("permute", {"x": x}, {"perm": perm}, out=node.output[0], name=label)


@handles("Gather")
def _gather(ctx, node, label):
    data, idx = node.input[0], node.input[1]
    axis = attr(node, "axis", 0)
    if ctx.is_const(data) and not ctx.is_const(idx) and axis == 0 and len(ctx.shape(data)) == 2:
        table = ctx.use(data)
        ids = ctx.use(idx)
        pad = {"padding_idx": ctx.padding_rows[data]} if data in ctx.padding_rows else {}
        if ctx.prog.spec(ids).dtype == "int32":
            ctx.emit("embedding", {"table": table, "ids": ids}, pad, out=node.output[0], name=label)
            return
        if ids in ctx.id_views:  # reshaped ids: the lookup of the original ids, reshaped
            shape = list(ctx.prog.spec(ids).shape) + [ctx.shape(data)[1]]
            y = ctx.emit("embedding", {"table": table, "ids": ctx.id_views[ids]}, pad, name=label)
            _reshape_to(ctx, y, shape, node.output[0], f"{label}.reshape")
            return
        if ids in ctx.int_valued:  # ids the model computes (RoBERTa's positions), held as floats: made ids
            ids = ctx.emit("float_to_index", {"x": ids}, name=f"{label}.ids")
            ctx.emit("embedding", {"table": table, "ids": ids}, pad, out=node.output[0], name=label)
            return
        raise Unsupported("embedding ids must be integers (int32 or int64 graph inputs)")
    if ctx.is_const(idx):
        x = ctx.use(data)
        shape = ctx.prog.spec(x).shape
        ax = axis % len(shape)
        i = ctx.value(idx).astype(np.int64)
        flat = np.where(i < 0, i + shape[ax], i).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= shape[ax]):
            raise Unsupported(f"its constant indices fall outside axis {ax} of length {shape[ax]}")
        out_shape = list(shape[:ax]) + list(i.shape) + list(shape[ax + 1:])
        if not out_shape:
            raise Unsupported("gathering one cell (a scalar)")
        runs = _index_runs(flat)
        # a table with a padding row (``nn.Embedding(padding_idx=...)``) read at that row: slices would
        # send the row a gradient, the lookup gets none (position ids held as a buffer)
        pad = ctx.padding_rows.get(data) if ax == 0 and len(shape) == 2 else None
        if ax == 0 and len(shape) == 2 and (len(runs) > MAX_GATHER_RUNS or (pad is not None and pad in flat)):
            # a lookup of constant ids (T5's relative-position buckets): an embedding whose ids are
            # an int32 constant of the program
            ids = ctx.use(_constant(ctx, f"{label}.ids", np.where(i < 0, i + shape[0], i)))
            y = ctx.emit("embedding", {"table": x, "ids": ids}, {"padding_idx": pad} if pad is not None else {},
                         name=label)
            _reshape_to(ctx, y, out_shape, node.output[0], f"{label}.reshape")  # (a scalar index: ids [1])
            return
        if not runs or len(runs) > MAX_GATHER_RUNS:
            raise Unsupported(f"its {flat.size} constant indices form {len(runs)} runs of consecutive or repeated "
                              f"indices; up to {MAX_GATHER_RUNS} are supported (each is a slice) unless it "
                              f"gathers rows of a 2-D table (an embedding lookup of constant ids)")
        y = None
        for k, (start, length, repeat) in enumerate(runs):
            tag = label if len(runs) == 1 else f"{label}.{k}"
            stop = start + (1 if repeat else length)
            piece = ctx.emit("slice", {"x": x}, {"axis": ax, "start": start, "stop": stop}, name=tag)
            if repeat and length > 1:  # one row, read ``length`` times: a new dim beside it, then merged
                piece = ctx.emit("expand", {"x": piece}, {"dim": ax, "size": length}, name=f"{tag}.repeat")
                wide = list(shape[:ax]) + [length, 1] + list(shape[ax + 1:])
                piece = ctx.emit("reshape", {"x": piece}, {"shape": wide[:ax + 1] + wide[ax + 2:], "from": wide},
                                 name=f"{tag}.rows")
            y = piece if y is None else ctx.emit("concat", {"a": y, "b": piece}, {"axis": ax}, name=f"{tag}.concat")
        _reshape_to(ctx, y, out_shape, node.output[0], f"{label}.reshape")
        return
    raise Unsupported("Gather other than an embedding lookup (initializer table, runtime ids, axis 0) or "
                      "constant indices")


@handles("GatherElements")
def _gather_elements(ctx, node, label):
    """Computed indices into a constant whose cells are all equal (RoBERTa's buffered token types,
    all zero, gathered at its computed positions): that value at every index, folded."""
    data = node.input[0]
    if not ctx.is_const(data):
        raise Unsupported("GatherElements of a computed tensor (only of a constant, on constants or into equal cells)")
    v = np.asarray(ctx.const[data])
    if v.size == 0 or not np.all(v == v.reshape(-1)[0]):
        raise Unsupported("GatherElements into a constant whose cells differ, at computed indices")
    ctx.const[node.output[0]] = np.full(ctx.shape(node.input[1]), v.reshape(-1)[0], dtype=v.dtype)


MAX_GATHER_RUNS = 32  # a constant-index Gather becomes one slice per run: beyond this, a table lookup


def _constant(ctx: Context, name: str, value: np.ndarray) -> str:
    """Register ``value`` as a new constant under a fresh ONNX-side name; returns the name."""
    while name in ctx.const:
        name += "_"
    ctx.const[name] = value
    return name


def _index_runs(flat: np.ndarray) -> list[tuple[int, int, bool]]:
    """``(start, length, repeated)`` runs covering ``flat`` in order: consecutive indices
    ``start, start + 1, ...`` or one index repeated (BERT's all-zero token types)."""
    runs: list[tuple[int, int, bool]] = []
    k, n = 0, flat.size
    while k < n:
        j = k + 1
        repeated = j < n and flat[j] == flat[k]
        while j < n and flat[j] == (flat[k] if repeated else flat[j - 1] + 1):
            j += 1
        runs.append((int(flat[k]), j - k, bool(repeated)))
        k = j
    return runs


def _causal_offset(mask: np.ndarray) -> int | None:
    """``k`` when a 0/1 mask over its last two dims is ``t <= s + k`` (broadcast over the rest)."""
    if mask.ndim < 2:
        return None
    m = mask.reshape(-1, mask.shape[-2], mask.shape[-1]).astype(bool)
    if not (m == m[0]).all():
        return None
    s, t = m.shape[1:]
    rows = np.flatnonzero(m[0].any(axis=1))
    if rows.size == 0:
        return None
    # the first row with a kept key fixes k (row r keeps keys 0..r+k); then one comparison checks all
    r0 = int(rows[0])
    k = int(np.count_nonzero(m[0][r0])) - 1 - r0
    return k if np.array_equal(m[0], np.tril(np.ones((s, t), bool), k)) else None


def _causal_fill(ctx: Context, name: str) -> tuple[bool, Any]:
    v = _scalar(ctx, name)
    if v is None or not (v == -np.inf or v <= -1e30):
        return False, None
    return True, (None if v == -np.inf else v)


def _causal_emit(ctx, x: str, offset: int, fill: Any, out: str, label: str) -> bool:
    xs = ctx.prog.spec(x).shape
    ctx.emit("causal_mask", {"x": x}, {"offset": offset, "fill": fill}, out=out, name=label)
    return len(xs) >= 2


@handles("Where")
def _where(ctx, node, label):
    c, a, b = node.input
    if ctx.is_const(c) and not ctx.is_const(a):
        k = _causal_offset(ctx.const[c])
        ok, fill = _causal_fill(ctx, b)
        if k is not None and ok and _mask_fits(ctx.const[c].shape, ctx.shape(a)):
            _causal_emit(ctx, ctx.use(a), k, fill, node.output[0], label)
            return
    if ctx.is_const(c) and ctx.is_const(a) and not ctx.is_const(b):  # masked_fill(future, -inf): Where(~tril, fill, x)
        k = _causal_offset(~ctx.const[c].astype(bool))
        ok, fill = _causal_fill(ctx, a)
        if k is not None and ok and _mask_fits(ctx.const[c].shape, ctx.shape(b)):
            _causal_emit(ctx, ctx.use(b), k, fill, node.output[0], label)
            return
    cond = c
    if ctx.is_const(c):
        ctx.const[f"{c}.float"] = ctx.const[c].astype(np.float32)
        cond = f"{c}.float"
    elif ctx.prog.spec(ctx.use(c)).dtype == "int32":  # an integer tensor kept by a Cast to bool: nonzero is true
        cond = ctx.float_view(c)
    for x, fill, where in ((a, b, "zero"), (b, a, "nonzero")):  # Where(c, x, -inf) and Where(c, -inf, x)
        v = _scalar(ctx, fill)
        if v is not None and not ctx.is_const(x) and (np.isfinite(v) or v == -np.inf):
            ctx.emit("masked_fill", {"x": ctx.use(x), "c": ctx.use(cond)},
                     {"value": None if v == -np.inf else v, "fill_where": where}, out=node.output[0], name=label)
            return
    ctx.emit("where", {"c": ctx.use(cond), "a": ctx.use(a), "b": ctx.use(b)}, out=node.output[0], name=label)


def _mask_fits(mask: tuple[int, ...], x: tuple[int, ...]) -> bool:
    """Whether a mask of shape ``mask`` broadcasts onto ``x`` without enlarging it (the causal
    kernel keeps ``x``'s shape): the same last two dims, and leading dims of 1 or ``x``'s."""
    return (len(mask) >= 2 and len(mask) <= len(x) and tuple(mask[-2:]) == tuple(x[-2:])
            and all(d in (1, e) for d, e in zip(mask[::-1], x[::-1])))


def _causal_add(ctx, node, label) -> bool:
    """``Add(x, M)`` with ``M`` 0 on the causal triangle and <= -1e30 (or -inf) above it."""
    for x, m in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        if not ctx.is_const(m) or ctx.is_const(x):
            continue
        mv = ctx.const[m]
        if mv.ndim < 2 or mv.dtype.kind != "f" or not _mask_fits(mv.shape, ctx.shape(x)):
            continue
        zero = mv == 0
        k = _causal_offset(zero)
        low = mv[~zero]
        if k is None or low.size == 0 or not (np.all(low == low.reshape(-1)[0]) and low.reshape(-1)[0] <= -1e30):
            continue
        fill = float(low.reshape(-1)[0])
        return _causal_emit(ctx, ctx.use(x), k, None if fill == -np.inf else fill, node.output[0], label)
    return False


@handles("Concat")
def _concat(ctx, node, label):
    ins = [x for x in node.input if x and x not in ctx.empty]  # empty slices add nothing
    if not ins:
        raise Unsupported("every input is empty")
    axis = attr(node, "axis", 0)
    y = ctx.use(ins[0])
    if len(ins) == 1:
        ctx.set(node.output[0], y)
        return
    for k, x in enumerate(ins[1:], start=1):
        last = k == len(ins) - 1
        y = ctx.emit("concat", {"a": y, "b": ctx.use(x)}, {"axis": axis}, out=node.output[0] if last else None,
                     name=label if k == 1 else f"{label}.{k}")


def _slice_chain(ctx, x: str, cuts: list[tuple[int, int, int, int]], out: str, label: str) -> None:
    """Slice ``x`` by ``(axis, start, stop, step)`` per axis (normalised; a negative step walks down
    from ``start`` to ``stop`` exclusive, -1 past the first cell)."""
    shape = ctx.prog.spec(x).shape
    cuts = [(a, s, e, st) for a, s, e, st in cuts if not (s == 0 and e == shape[a] and st == 1)]
    if not cuts:
        ctx.set(out, x)
        return
    for k, (a, s, e, st) in enumerate(cuts):
        last = k == len(cuts) - 1
        x = ctx.emit("slice", {"x": x}, {"axis": a, "start": s, "stop": e, "step": st}, out=out if last else None,
                     name=label if k == 0 else f"{label}.{k}")


@handles("Slice")
def _slice(ctx, node, label):
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    if ctx.opset < 10:
        starts, ends = attr(node, "starts"), attr(node, "ends")
        axes, steps = attr(node, "axes", list(range(len(starts)))), [1] * len(starts)
    else:
        starts = ctx.value(node.input[1]).tolist()
        ends = ctx.value(node.input[2]).tolist()
        axes = ctx.value(node.input[3]).tolist() if len(node.input) > 3 and node.input[3] else \
            list(range(len(starts)))
        steps = ctx.value(node.input[4]).tolist() if len(node.input) > 4 and node.input[4] else [1] * len(starts)
    cuts = []
    for s, e, a, st in zip(starts, ends, axes, steps):
        a %= len(shape)
        n = shape[a]
        if st == 0:
            raise Unsupported("a slice step of 0")
        s, e = s + n if s < 0 else s, e + n if e < 0 else e
        if st > 0:  # clamped as ONNX Slice-13 says: starts to [0, n], ends to [0, n] (steps > 0) ...
            s, e = max(0, min(n, s)), max(0, min(n, e))
        else:  # ... or starts to [0, n - 1] and ends to [-1, n - 1] (steps < 0: walking down)
            s, e = max(0, min(n - 1, s)), max(-1, min(n - 1, e))
        if (e - s) * st <= 0:  # nothing: only a Concat may read it (Phi-3's rotary pass-through of no dims)
            out_shape = list(shape)
            out_shape[a] = 0
            ctx.empty[node.output[0]] = (tuple(out_shape), label)
            return
        cuts.append((a, s, e, st))
    _slice_chain(ctx, x, cuts, node.output[0], label)


@handles("Split")
def _split(ctx, node, label):
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    axis = attr(node, "axis", 0) % len(shape)
    sizes = attr(node, "split", None)
    if sizes is None and len(node.input) > 1 and node.input[1]:
        sizes = ctx.value(node.input[1]).tolist()
    if sizes is None:
        n = len(node.output)
        step = -(-shape[axis] // n)
        sizes = [min(step, shape[axis] - k * step) for k in range(n)]
    start = 0
    for k, (out, size) in enumerate(zip(node.output, sizes)):
        if out:
            _slice_chain(ctx, x, [(axis, start, start + int(size), 1)], out, f"{label}.{k}")
        start += int(size)
