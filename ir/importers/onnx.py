"""ONNX -> block graph: ``import_onnx(model, params) -> (Graph, {initializer name: values})``.

How a model becomes a graph:

1. **Load** a path, bytes or ``onnx.ModelProto``; anything else, or a file that is not an ONNX
   model, is an :class:`ImportFailure`.
2. **Bind dims.** Every graph input's symbolic dim (``batch``, ``seq``) takes its value from
   ``params``; a dim without a value, or a value for a dim the model does not have, is an error
   naming the dims and the ``--set name=N`` that fixes it.
3. **Fold constants.** A node whose inputs are all constants (initializers, ``Constant`` nodes,
   ``Shape`` of a tensor whose shape is now known) is evaluated once with ONNX's reference
   implementation: the shape arithmetic of exports (``Shape -> Gather -> Unsqueeze -> Concat ->
   Reshape``), position ids (``Range``), causal masks (``Trilu``) all become plain constants.
4. **Map ops** one node at a time to kernels (``ir.importers.onnx_ops``; convolutions and
   pooling in ``onnx_conv``, batch normalisation (inference and training mode) in
   ``onnx_batchnorm``, comparisons and boolean masks in ``onnx_masks``, Einsum in
   ``onnx_einsum``, group and instance normalisation in ``onnx_norm``, Pad, Tile, CumSum and
   nearest Resize/Upsample in ``onnx_pad_tile``, slice assignment (``ScatterND`` of a box) in
   ``onnx_scatter``). Inputs and outputs keep their ONNX names;
   initializers read by an op become ``parameter`` tensors of the same name, their values
   returned beside the graph (``program.npz``). Folded constants read by an op become parameters
   named after the ONNX value that holds them.
5. **Patterns** (``ir.importers.patterns``) turn the op sequences exports produce into the
   kernels the search knows how to shard: ``matmul/einsum + add(bias)`` -> ``linear``, the Erf
   GELU -> ``gelu_erf``, the RMSNorm sequence -> ``rmsnorm``, ``x · sigmoid(x)`` -> ``silu``,
   ``x · tanh(softplus(x))`` -> ``mish``; the
   causal-mask ``Where``/``Add`` of a constant lower-triangular mask maps to ``causal_mask`` as the
   node is converted.
6. Every node that cannot be mapped is collected; if there is any, one error lists each op type
   with its node names. Otherwise the graph is validated and returned.

Reshape, Flatten, Squeeze and Unsqueeze become ``reshape`` ops whose projections are exact
(``ir.kernels.shape``): a reshape that splits ``D`` into heads shards along the heads.

Integer tensors (int64 inputs become int32) feed index ports (embedding ids). A ``Cast`` of one
to a float is ``index_to_float``; layout ops on the way (BERT's ``mask[:, None, None, :]``) run
on that float copy, since the layout kernels take floats (``_view``).

Booleans are float tensors of 0 and 1: comparisons, ``Not``/``And``/``Or`` and a ``Cast`` to bool
of computed tensors are the mask kernels (``ir.kernels.masks``); on constants they fold. A
``Where`` reads its condition as ``c != 0``; a ``Cast`` of a mask to float is the mask itself.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ir.graph import Graph
from ir.importers.errors import ImportFailure
# (imported to register their handlers in HANDLERS)
from ir.importers import (onnx_argreduce, onnx_batchnorm, onnx_conv, onnx_einsum, onnx_masks,  # noqa: F401
                          onnx_norm, onnx_pad_tile, onnx_scatter)  # noqa: F401
from ir.importers.onnx_ops import HANDLERS, Context, Unsupported
from ir.importers.patterns import apply_patterns
from ir.importers.program import Program
from ir.zspace import MAX_DIM
from ir.kernels import SignatureError

# ONNX TensorProto element types the graph can hold (others: an error naming the input).
_FLOATS = {1: "float32", 10: "float16", 16: "bfloat16"}
_INTS = {6: "int32", 7: "int32"}  # int64 ids become int32 (token ids and labels fit)


def load_model(model: Any) -> Any:
    """An ``onnx.ModelProto`` from a path, bytes or a ModelProto."""
    import onnx  # noqa: PLC0415  (optional dependency, imported when used)

    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        try:
            return onnx.load_from_string(bytes(model))
        except Exception as e:  # noqa: BLE001  (protobuf raises assorted decode errors)
            raise ImportFailure(f"the bytes given are not an ONNX model ({type(e).__name__}: {e})") from None
    path = Path(model)
    if not path.is_file():
        raise ImportFailure(f"ONNX file {str(path)!r} does not exist; give the path of a .onnx model")
    try:
        m = onnx.load(str(path))
    except Exception as e:  # noqa: BLE001
        raise ImportFailure(f"{str(path)!r} is not an ONNX model: {type(e).__name__}: {str(e)[:200]}; "
                            f"export one with torch.onnx.export or onnx.save") from None
    if not m.graph.node and not m.graph.output:
        raise ImportFailure(f"{str(path)!r} holds no ONNX graph (no nodes, no outputs); is it an ONNX model?")
    return m


def _bind_inputs(m: Any, params: Mapping[str, Any], inits: set[str]) -> list[tuple[str, tuple[int, ...], str]]:
    symbolic: dict[str, list[str]] = {}
    out, problems = [], []
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        elem = tt.elem_type
        dtype = _FLOATS.get(elem) or _INTS.get(elem)
        if dtype is None:
            problems.append(f"input {vi.name!r} has ONNX element type {elem}, which the graph cannot hold "
                            f"(float32, float16, bfloat16, int32, int64)")
            continue
        shape = []
        for k, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                shape.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param:
                symbolic.setdefault(d.dim_param, []).append(f"{vi.name}[{k}]")
                v = params.get(d.dim_param)
                shape.append(v)
            else:
                symbolic.setdefault(f"{vi.name}[{k}]", []).append(f"{vi.name}[{k}]")
                shape.append(params.get(f"{vi.name}[{k}]"))
        if not shape:
            problems.append(f"input {vi.name!r} is a scalar; graph tensors have rank >= 1")
        out.append((vi.name, shape, dtype))
    unbound = sorted(n for n in symbolic if params.get(n) is None)
    bad = sorted(n for n in symbolic if params.get(n) is not None and
                 (not isinstance(params[n], int) or isinstance(params[n], bool) or not 1 <= params[n] <= MAX_DIM))
    unknown = sorted(set(params) - set(symbolic))
    if unbound:
        where = "; ".join(f"{n} (at {', '.join(symbolic[n])})" for n in unbound)
        problems.append(f"symbolic dims without a value: {where}; bind each with --set NAME=N "
                        f"(in a campaign: workload.params)")
    if bad:
        problems.append(f"dims {bad} must be positive integers (at most 2**40), got {[params[n] for n in bad]}")
    if unknown:
        problems.append(f"params {unknown} name no symbolic dim of the model; its symbolic dims are "
                        f"{sorted(symbolic) or 'none'}")
    if problems:
        raise ImportFailure("cannot import the ONNX model: " + "; ".join(problems))
    return [(n, tuple(int(d) for d in s), dt) for n, s, dt in out]


# Layout ops whose data inputs (the rest are constant shapes and axes) may be integer tensors.
_VIEWS = {"Unsqueeze": 1, "Squeeze": 1, "Reshape": 1, "Flatten": 1, "Transpose": 1, "Expand": 1, "Slice": 1,
          "Identity": 1, "Concat": None}


def _view(ctx: Context, handler: Any, node: Any, label: str) -> None:
    """Run a layout op; on ``int32`` tensors (an attention mask on its way to a Cast), whose views
    the float-only layout kernels refuse, run it on their ``index_to_float`` copies instead. A view
    the handler maps without a kernel (a no-op reshape of token ids) keeps the integers."""
    data = [x for x in (node.input[:_VIEWS[node.op_type]] if _VIEWS[node.op_type] else node.input) if x]
    ints = [x for x in data if not ctx.is_const(x) and ctx.resolve(x) in ctx.prog.tensors
            and ctx.prog.spec(ctx.resolve(x)).dtype == "int32"]
    if ints:
        saved = [dict(d) for d in (ctx.prog.ops, ctx.prog.tensors, ctx.prog.values, ctx.aliases, ctx._params)]
        try:
            handler(ctx, node, label)
            return
        except SignatureError:  # a layout kernel on integers: undo what it emitted, go through floats
            ctx.prog.ops, ctx.prog.tensors, ctx.prog.values, ctx.aliases, ctx._params = saved
        import onnx  # noqa: PLC0415

        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for i, x in enumerate(copy.input):
            if x in ints:
                copy.input[i] = ctx.float_view(x)
        node = copy
    handler(ctx, node, label)
    computed = [ctx.resolve(x) for x in node.input[:len(data)] if x and not ctx.is_const(x)]
    for kind in (ctx.int_valued, ctx.bool_valued):  # a view of integers (booleans) holds integers (booleans)
        if computed and all(t in kind for t in computed):
            kind.update(ctx.resolve(o) for o in node.output if o)
    if node.op_type in _ORDER_KEEPING and len(computed) == 1:
        ctx.note_id_view(computed[0], ctx.resolve(node.output[0]))


#: views that keep the row-major order of the cells (an embedding of their ids is the embedding
#: of the original ids, reshaped)
_ORDER_KEEPING = frozenset({"Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity"})


#: elementwise ops whose output takes the broadcast shape of all their inputs (ONNX's
#: multidirectional broadcasting), which may have more dims than the tensor operand
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Less", "Greater", "LessOrEqual",
                           "GreaterOrEqual", "And", "Or", "Xor"})


#: ops whose result holds integers when every data input does (a computed integer tensor is held
#: as floats: ``Context.int_valued``), so a later Cast to an integer type or an embedding lookup is
#: exact; by op, its data inputs (the others are axes, or Where's condition)
_INTEGER_CLOSED = {"Add": slice(None), "Sub": slice(None), "Mul": slice(None), "Neg": slice(None),
                   "Abs": slice(None), "Max": slice(None), "Min": slice(None), "CumSum": slice(0, 1),
                   "ReduceSum": slice(0, 1), "ReduceMax": slice(0, 1), "Where": slice(1, None)}


def _note_integers(ctx: Context, node: Any) -> None:
    for x in (x for x in node.input[_INTEGER_CLOSED[node.op_type]] if x):
        if ctx.is_const(x):
            v = np.asarray(ctx.const[x])
            if v.dtype.kind == "f" and not np.all(v == np.round(v)):
                return
        elif ctx.resolve(x) not in ctx.int_valued and ctx.prog.spec(ctx.resolve(x)).dtype != "int32":
            return
    ctx.int_valued.update(ctx.resolve(o) for o in node.output if o)


def _broadcast_rank(ctx: Context, node: Any, label: str) -> None:
    """A one-element constant of higher rank than the tensor it meets (``x[2, 3] * c[1, 1, 1]``)
    raises the output's rank in ONNX; the handlers that make it an op's parameter (``scale``,
    ``pow``, ``compare_scalar``, ``masked_fill``, ``causal_mask``) keep the tensor's shape, so the
    output gets the leading unit dims it lacks here (a reshape: no data moves)."""
    out = node.output[0]
    if not out or ctx.is_const(out) or ctx.resolve(out) not in ctx.prog.tensors:
        return
    want = np.broadcast_shapes(*(ctx.shape(x) for x in node.input if x))
    have = ctx.shape(out)
    if len(have) < len(want) and tuple(want[len(want) - len(have):]) == tuple(have) and \
            all(d == 1 for d in want[: len(want) - len(have)]):
        ctx.emit("reshape", {"x": ctx.resolve(out)}, {"shape": list(want), "from": list(have)}, out=out,
                 name=f"{label}.broadcast")


def _rename(prog: Program, ctx: Context, old: str, new: str) -> None:
    prog.rename(old, new)
    ctx.aliases = {k: (new if v == old else v) for k, v in ctx.aliases.items() if k != new}


def _check_declared_shape(vi: Any, shape: tuple[int, ...], params: Mapping[str, Any]) -> None:
    """An output whose computed rank differs from the rank the model declares is an import error,
    never a silently different program. Differing sizes only warn: exporters' shape inference
    and the framework can disagree (PyTorch's ceil-mode pools drop a last window that starts in
    the padding; the importer follows PyTorch)."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return
    dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else
            params.get(d.dim_param) if d.HasField("dim_param") else None for d in tt.shape.dim]
    declared = [d if d is not None else "?" for d in dims]
    if len(dims) != len(shape):
        raise ImportFailure(f"graph output {vi.name!r} would have shape {list(shape)} in the block graph, but the "
                            f"model declares {declared}; the importer maps some op of this model wrongly "
                            f"(please report it with the model), so it refuses rather than import a different program")
    if any(d is not None and d != s for d, s in zip(dims, shape)):
        warnings.warn(f"graph output {vi.name!r} has shape {list(shape)} in the block graph; the model declares "
                      f"{declared} (its exporter's shape inference)", stacklevel=3)


def import_onnx(model: Any, params: Mapping[str, Any] | None = None,
                what: str = "imported ONNX model", trainable: frozenset[str] = frozenset(),
                padding_rows: Mapping[str, int] | None = None) -> tuple[Graph, dict[str, np.ndarray]]:
    """Import an ONNX model; ``params`` binds its symbolic dims (``{"batch": 8, "seq": 128}``).

    Returns the validated graph (every op on one shard of device 0) and the values of its
    parameter tensors (initializers under their ONNX names, folded constants under theirs).
    Nodes on constants alone are folded, except those reading a ``trainable`` initializer: they
    become ops on that parameter, so a training step's gradient reaches it (a folded copy would
    be a parameter of its own). Raises :class:`ImportFailure` for a bad file, unbindable dims,
    unsupported ops, or outputs whose ranks differ from those the model declares.
    ``padding_rows`` maps an embedding table (initializer name) to its padding row, which gets
    no gradient (``torch.nn.Embedding(padding_idx=...)``: ONNX does not record it).
    """
    from onnx import numpy_helper  # noqa: PLC0415

    m = load_model(model)
    params = dict(params or {})
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    inputs = _bind_inputs(m, params, set(inits))
    floats = [dt for _, _, dt in inputs if dt != "int32"]
    dtype = floats[0] if floats else "float32"
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 17)
    prog = Program()
    for name, shape, dt in inputs:
        prog.source(name, shape, dt, "input")
    ctx = Context(prog, dict(inits), dtype, opset, frozenset(inits))
    ctx.padding_rows = dict(padding_rows or {})
    unsupported: dict[str, list[str]] = {}
    unknown: set[str] = set()
    for i, node in enumerate(m.graph.node):
        label = node.name or f"{node.op_type}_{i}"
        ins = [x for x in node.input if x]
        if any(x in unknown for x in ins):  # downstream of an unsupported node: report only its own type
            if node.op_type not in HANDLERS:
                unsupported.setdefault(node.op_type, []).append(label)
            unknown.update(node.output)
            continue
        try:
            if node.op_type == "Constant" or (ins and all(ctx.is_const(x) for x in ins) and not trainable.intersection(ins)
                                              and node.op_type not in ("RandomNormalLike", "RandomUniformLike")):
                ctx.fold(node)
            elif node.op_type in ("Shape", "Size"):
                ctx.fold(node)
            else:
                handler = HANDLERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
                if handler is None:
                    raise Unsupported("")
                if node.op_type in _VIEWS:
                    _view(ctx, handler, node, label)
                else:
                    handler(ctx, node, label)
                if node.op_type in _BROADCASTING:
                    _broadcast_rank(ctx, node, label)
                if node.op_type in _INTEGER_CLOSED:
                    _note_integers(ctx, node)
        except Unsupported as e:
            key = node.op_type + (f" ({e})" if str(e) else "")
            unsupported.setdefault(key, []).append(label)
            unknown.update(node.output)
        except SignatureError as e:
            unsupported.setdefault(f"{node.op_type} (cannot map: {e})", []).append(label)
            unknown.update(node.output)
    for vi in m.graph.output:  # an output with no cells: the IR has no such tensor
        if vi.name in ctx.empty:
            unsupported.setdefault("Slice (an empty slice)", []).append(ctx.empty[vi.name][1])
    if unsupported:
        rows = "; ".join(f"{op}: {', '.join(names[:8])}{' …' if len(names) > 8 else ''}"
                         for op, names in sorted(unsupported.items()))
        raise ImportFailure(f"the ONNX model uses ops the importer does not support — {rows}. Supported op "
                            f"types: {', '.join(sorted(HANDLERS))} (and any node on constants, which is folded)")
    outputs = []
    output_names = {vi.name for vi in m.graph.output}
    for vi in m.graph.output:
        t = ctx.resolve(vi.name)
        if t not in prog.tensors or prog.producer(t) is None:
            raise ImportFailure(f"graph output {vi.name!r} is a constant or a graph input, not computed by the "
                                f"model; the block graph has no operation to produce it")
        if t != vi.name and t in output_names:
            # one value returned under two names (an Identity of another output): renaming it would
            # take it from that output, so the second name gets a copy
            t = ctx.emit("scale", {"x": t}, {"alpha": 1.0}, name=f"{vi.name}.copy")
        if t != vi.name:
            held = prog.tensors.get(vi.name)
            if held is not None and (held.role != "intermediate" or vi.name in outputs):
                raise ImportFailure(f"graph output {vi.name!r} aliases {t!r} under a name already in use")
            if held is not None:  # an earlier value under the output's name (a reshape appended to it): renamed
                _rename(prog, ctx, vi.name, prog.tensor_name(f"{vi.name}.pre"))
            _rename(prog, ctx, t, vi.name)
        _check_declared_shape(vi, prog.tensors[vi.name].shape, params)
        outputs.append(vi.name)
    apply_patterns(prog, set(outputs))
    return prog.build(outputs, what), dict(prog.values)
