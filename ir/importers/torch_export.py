"""PyTorch -> block graph, through ONNX: ``import_torch(module, example_inputs)``.

The module is exported with ``torch.onnx.export`` (the TorchScript exporter, ``dynamo=False``:
the torch.export-based exporter needs ``onnxscript``, which the ``[torch]`` extra does not pull
in) at the example inputs' shapes, then imported by ``ir.importers.onnx``: one mapping for both
front ends. The exporter names initializers after the module's ``state_dict`` keys
(``fc1.weight``), so the program's parameters carry those names; ``nn.Linear`` on 2-D inputs
exports as ``Gemm(transB=1)`` (an einsum on the stored ``[out, in]`` weight).

``torch.nn.RMSNorm`` has no ONNX symbolic at opsets 17-23 (``aten::rms_norm``): for the export,
each one in the module tree is swapped for ``_ElementaryRMSNorm``, the same arithmetic in
elementary ops holding the same ``weight`` Parameter (so its ``state_dict`` name is unchanged),
and put back afterwards. Over the last dim the importer's RMSNorm pattern makes it ``rmsnorm``;
over several dims it stays elementary ops (exact, unfused). On float16/bfloat16 inputs it is
refused (``_elementary_rms_norm`` says why). ``torch.diff``, which Hugging Face decoders call on
their position ids, gets a symbolic of its own for the export (``ir.importers.torch_symbolics``).

Hugging Face sparse mixture-of-experts blocks (Mixtral's, Qwen2-MoE's, Qwen3-MoE's, OLMoE's,
DeepSeek-V2's and -V3's) route tokens by a data-dependent top-k, which neither exports to ops the
importer maps nor has an affine projection. For the export each is swapped, like the norms, for a twin with *balanced
routing* (``ir.importers.torch_moe``): token ``s``'s ``j``-th expert is ``(s·top_k + j) mod E``,
as in ``workloads.llama(experts=...)``, with the block's gates and experts on the block's own
weights (same ``state_dict`` names). A plan of the program prices an even load over the experts;
the model's learned routing is not reproduced, so the imported forward equals the twin's, not
the original block's. ``seq·top_k`` must be a multiple of the experts (the twin refuses
otherwise). The experts' GEMMs are einsums on the stacked ``[E, ., .]`` weights with the
experts' dim leading, which the expert-parallel layout splits.

Batch norms export in eval mode (running statistics) unless ``batchnorm="train"``: then the
``torch.nn.BatchNorm*d`` submodules alone are put in train mode and the exporter keeps each
submodule's mode (``TrainingMode.PRESERVE``), so they export as ``BatchNormalization`` with
``training_mode=1`` (batch statistics, ``ir.importers.onnx_batchnorm``) while dropout stays off.

Needs the ``[torch]`` extra (``pip install 'tapestry[torch]'``, a CPU wheel is enough).
"""

from __future__ import annotations

import importlib.util
import io
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ir.graph import Graph
from ir.importers.errors import ImportFailure
from ir.importers.onnx import import_onnx
from ir.importers.torch_moe import balanced_moe_twin, moe_block_kind
from ir.importers.torch_symbolics import extra_symbolics

_TORCH_DTYPES = ("float32", "float16", "int64", "int32")
BATCHNORM_MODES = ("eval", "train")  # ``import_torch(batchnorm=...)``: running or batch statistics


def _torch() -> Any:
    try:
        import torch  # noqa: PLC0415  (optional heavy dependency)
    except ImportError:
        raise ImportFailure("importing a PyTorch model needs torch: pip install 'tapestry[torch]' "
                            "(or export the model to ONNX yourself and import the .onnx file)") from None
    return torch


def import_torch(module: Any, example_inputs: Mapping[str, Any], params: Mapping[str, Any] | None = None,
                 opset: int = 17, dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
                 batchnorm: str = "eval", check: Mapping[str, int] | None = None,
                 run: Callable[[Graph, Mapping[str, np.ndarray]], Mapping[str, Any]] | None = None
                 ) -> tuple[Graph, dict[str, np.ndarray]]:
    """Import ``module`` (a ``torch.nn.Module``) called on ``example_inputs`` (name -> tensor, in
    the order of its forward arguments). Returns the graph and its parameter values.

    ``dynamic_axes`` (``{"x": {0: "batch", 1: "seq"}}``) exports those dims as symbolic; ``params``
    then binds them, so one export serves any batch and sequence length. Tracing records Python
    control flow on sizes as taken at the example's sizes: ``check`` (a second binding of the
    symbolic dims, small) imports the export at those sizes too, runs it with ``run`` (the
    executor's ``execute(graph, feed) -> {tensor: array}``, which ``ir`` does not import) and
    compares it with the module's forward on the same random inputs, refusing the import when
    they differ.

    The module is exported in eval mode (dropout off). ``batchnorm`` says how its batch norms
    (``torch.nn.BatchNorm1d/2d/3d``) normalise: ``"eval"`` on their running statistics,
    ``"train"`` on the batch's, as they train (``BatchNormalization`` with ``training_mode=1``,
    opset 14 or later: ``ir.importers.onnx_batchnorm``); their running statistics, which the
    export's forward passes update, are put back. The caller's modes are restored either way."""
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise ImportFailure(f"expected a torch.nn.Module, got {type(module).__name__}")
    if check and run is None:
        raise ImportFailure("check needs run, the function that executes a graph (executor.run.execute)")
    if batchnorm not in BATCHNORM_MODES:
        raise ImportFailure(f"batchnorm={batchnorm!r}: give one of {list(BATCHNORM_MODES)}")
    if batchnorm == "train" and opset < 14:
        raise ImportFailure(f"batchnorm='train' needs opset 14 or later (ONNX BatchNormalization's "
                            f"training_mode), got opset {opset}")
    modes = {m: m.training for m in module.modules()}
    buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    module.eval()  # (dropout off, norms on running statistics) for the export; the caller's mode is restored
    if batchnorm == "train":
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.train()
    root, slots = _swap_for_export(torch, module)  # the caller's tree is restored below
    try:
        buf = _export(torch, root, example_inputs, opset, dynamic_axes, batchnorm == "train", warn_traced=not check)
        if check:
            feed, want = _check_forward(torch, root, example_inputs, dynamic_axes or {}, check)
    finally:
        _restore(slots)
        for m, was in modes.items():
            m.training = was
        with torch.no_grad():  # train-mode batch norms updated their running statistics
            for k, b in module.named_buffers():
                b.copy_(buffers[k])
    trainable = {n for n, p in module.named_parameters() if p.dtype.is_floating_point}
    model, trainable = _name_folded_weights(buf.getvalue(), module.state_dict(), trainable)
    kw = {"what": "imported PyTorch model", "trainable": frozenset(trainable),
          "padding_rows": _padding_rows(torch, module)}
    g, values = import_onnx(model, params, **kw)
    if check:
        _check_sizes(import_onnx(model, {**(params or {}), **check}, **kw), run, feed, want, check)
    return g, values


def _check_forward(torch: Any, module: Any, example_inputs: Mapping[str, Any],
                   dynamic_axes: Mapping[str, Mapping[int, str]], check: Mapping[str, int]
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Random inputs with the symbolic dims at ``check``'s sizes, and the module's outputs on them."""
    gen = torch.Generator().manual_seed(1)
    feed = {}
    for name, x in example_inputs.items():
        shape = [check.get(dynamic_axes.get(name, {}).get(i), d) for i, d in enumerate(x.shape)]
        if x.is_floating_point():
            feed[name] = torch.randn(shape, generator=gen, dtype=x.dtype)
        else:  # ids in the range the example's own ids use
            feed[name] = torch.randint(int(x.min()), int(x.max()) + 1, shape, generator=gen, dtype=x.dtype)
    try:
        with torch.no_grad():
            out = module(*feed.values())
    except Exception as e:  # noqa: BLE001  (user code)
        sizes = ", ".join(f"{k}={v}" for k, v in check.items())
        raise ImportFailure(f"the module's forward fails at other sizes of its named dims ({sizes}), where the "
                            f"export is checked: {type(e).__name__}: {str(e)[:200]}; give fixed sizes "
                            f"(x:int64[8,128], not x:int64[batch=8,seq=128])") from None
    return {k: v.numpy() for k, v in feed.items()}, dict(zip(_output_names(out), _leaf_values(out)))


def _output_names(out: Any) -> list[str]:
    """The graph output names the export gives a forward's result ``out`` (``_leaf_paths``)."""
    leaves = _leaf_paths(out)
    return ["output"] if len(leaves) == 1 else [f"output_{'_'.join(p)}" for p in leaves]


def _leaf_values(out: Any) -> list[np.ndarray]:
    """The tensors of ``out`` in ``_leaf_paths``' order, as float arrays."""
    if isinstance(out, dict):
        return [x for v in out.values() for x in _leaf_values(v)]
    if isinstance(out, (tuple, list)):
        return [x for v in out for x in _leaf_values(v)]
    return [out.float().numpy()] if out is not None else []


def _check_sizes(graph_and_values: tuple[Graph, dict[str, np.ndarray]], run: Callable,
                 feed: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], check: Mapping[str, int]) -> None:
    """The export bound at ``check``'s sizes computes what the module does at them."""
    g, values = graph_and_values
    ints = {n: v.astype(np.int32) if v.dtype.kind in "iu" else v for n, v in feed.items()}
    env = run(g, {**values, **ints})
    sizes = ", ".join(f"{k}={v}" for k, v in check.items())
    for name, w in want.items():
        got = np.asarray(env[name], dtype=np.float64)
        scale = float(np.abs(w).max()) or 1.0
        if got.shape != w.shape or not np.allclose(got, w, rtol=1e-3, atol=1e-3 * scale):
            raise ImportFailure(
                f"the export traced at the example's sizes does not compute the module at other sizes ({sizes}: "
                f"output {name!r} differs): the model's Python code branches on a size or turns one into a "
                f"constant, which tracing records as taken; give fixed sizes (x:int64[8,128], not "
                f"x:int64[batch=8,seq=128]) to import it at exactly those sizes")


def _padding_rows(torch: Any, module: Any) -> dict[str, int]:
    """``{state_dict key: padding_idx}`` of every ``nn.Embedding`` with a padding row, under each
    name its weight has (a tied weight is one Parameter with several keys)."""
    pads = {id(m.weight): m.padding_idx for m in module.modules()
            if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None}
    return {k: pads[id(v)] for k, v in module.state_dict(keep_vars=True).items() if id(v) in pads}


def _elementary_rms_norm(torch: Any) -> type:
    """``_ElementaryRMSNorm``: ``x · rsqrt(mean(x², last dims) + eps) · weight``, as
    ``torch.nn.RMSNorm`` computes it on float32 and float64 inputs (``eps=None``:
    ``torch.finfo(x.dtype).eps``), in ops the exporter knows.

    float16 and bfloat16 inputs it refuses: torch normalises those in float32, with float32's eps
    (not the input dtype's, which its docs suggest; for rows of small values the two differ by
    whole units) and the weight cast to float32 (checked on torch 2.13), and the import of that
    mix fails: scalar constants take the program's dtype, and the exporter's float32 copy of the
    weight is matched back to the float16 entry. Computing in the input dtype instead would import,
    but would not be torch's numbers."""

    class _ElementaryRMSNorm(torch.nn.Module):
        def __init__(self, norm: Any) -> None:
            super().__init__()
            self.normalized_shape = tuple(norm.normalized_shape)
            self.eps = norm.eps
            self.weight = norm.weight  # the same Parameter (or None: elementwise_affine=False)
            self.train(norm.training)

        def forward(self, x: Any) -> Any:
            if x.dtype in (torch.float16, torch.bfloat16):
                raise ImportFailure(f"torch.nn.RMSNorm on {str(x.dtype).removeprefix('torch.')} inputs is not "
                                    f"supported: torch computes it in float32, which this importer cannot map "
                                    f"yet; import the model in float32 (model.float())")
            dims = tuple(range(-len(self.normalized_shape), 0))
            eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # torch's default eps
            y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
            return y if self.weight is None else y * self.weight

    return _ElementaryRMSNorm


def _swap_for_export(torch: Any, module: Any) -> tuple[Any, list[tuple[Any, str, Any]]]:
    """Replace, in place, every ``torch.nn.RMSNorm`` under ``module`` by its elementary twin and
    every known sparse mixture-of-experts block (``ir.importers.torch_moe``) by its balanced-routing
    twin (a module reached twice gets one twin). Returns the module to export (the twin when
    ``module`` is itself swapped) and the ``(parent, child name, original)`` slots ``_restore``
    puts back."""
    norm_cls = getattr(torch.nn, "RMSNorm", None)
    twins: dict[int, Any] = {}

    def twin(m: Any) -> Any | None:
        if id(m) not in twins:
            if norm_cls is not None and isinstance(m, norm_cls):
                twins[id(m)] = _elementary_rms_norm(torch)(m)
            else:
                twins[id(m)] = balanced_moe_twin(torch, m) if moe_block_kind(m) else None
        return twins[id(m)]

    # every twin made before the tree changes: a refused block leaves the caller's tree as it was
    slots = [(parent, name, child) for parent in list(module.modules())
             for name, child in list(parent._modules.items()) if child is not None and twin(child) is not None]
    root = twin(module) or module
    for parent, name, child in slots:
        parent._modules[name] = twins[id(child)]
    return root, slots


def _restore(slots: list[tuple[Any, str, Any]]) -> None:
    """Put the original modules back where ``_swap_for_export`` took them from."""
    for parent, name, original in reversed(slots):
        parent._modules[name] = original


def _export(torch: Any, module: Any, example_inputs: Mapping[str, Any], opset: int,
            dynamic_axes: Mapping[str, Mapping[int, str]] | None, preserve: bool = False,
            warn_traced: bool = True) -> io.BytesIO:
    """The ONNX bytes of ``module`` on ``example_inputs``; ``preserve``: export each submodule in
    its own mode (train-mode batch norms in an eval-mode module) rather than all in eval mode."""
    names = list(example_inputs)
    args = tuple(example_inputs[n] for n in names)
    try:
        with torch.no_grad():
            out = module(*args)
    except ImportFailure:  # ours (an RMSNorm twin's refusal): already says what to do
        raise
    except Exception as e:  # noqa: BLE001  (user code)
        shapes = ", ".join(f"{n}: {getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', []))}"
                           for n, a in zip(names, args))
        raise ImportFailure(f"the module's forward failed on the example inputs ({shapes}): {type(e).__name__}: "
                            f"{str(e)[:300]}; give inputs of the names, dtypes and shapes its forward "
                            f"takes, in its argument order") from None
    out_names = _output_names(out)
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if dynamic_axes and warn_traced:  # a size traced into a constant is wrong at other sizes: say so
                # (under ``check`` the comparison at other sizes decides instead)
                warnings.simplefilter("default", torch.jit.TracerWarning)
            # (not under no_grad: nn.TransformerEncoderLayer would take its fast path, which cannot export)
            with extra_symbolics(torch, opset):
                torch.onnx.export(module, args, buf, dynamo=False, input_names=names, output_names=out_names,
                                  opset_version=opset, do_constant_folding=True,
                                  training=(torch.onnx.TrainingMode.PRESERVE if preserve
                                            else torch.onnx.TrainingMode.EVAL),
                                  dynamic_axes={k: dict(v) for k, v in (dynamic_axes or {}).items()} or None)
    except Exception as e:  # noqa: BLE001  (the exporter raises many types)
        hint = ""
        if "is_causal" in str(e):  # torch traces a bare nn.TransformerEncoderLayer's fast path with a tensor flag
            hint = ("; torch's exporter fails on a bare nn.TransformerEncoderLayer: return a module whose "
                    "forward calls the layer")
        raise ImportFailure(f"torch.onnx.export could not export the module: {type(e).__name__}: "
                            f"{str(e)[:300]}{hint}") from None
    return buf


def _leaf_paths(out: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of the tensors in a forward's result, in the order the exporter flattens them
    (tuples and lists by position, dicts by key): ``output_1_0``, ``output_logits``."""
    from ir.importers.program import _BAD

    if isinstance(out, dict):
        return [p for k, v in out.items() for p in _leaf_paths(v, (*path, _BAD.sub("_", str(k)) or "_"))]
    if isinstance(out, (tuple, list)):
        return [p for i, v in enumerate(out) for p in _leaf_paths(v, (*path, str(i)))]
    return [path] if out is not None else []


def _name_folded_weights(onnx_bytes: bytes, state: Mapping[str, Any], trainable: set[str]
                         ) -> tuple[Any, set[str]]:
    """The exporter folds ``weight.T`` of 3-D ``nn.Linear`` calls (and of a weight used
    transposed, as a tied output embedding) into new initializers named like ``onnx::MatMul_109``,
    one per use. Name each after the ``state_dict`` entry it holds (``q.weight.T``), so parameters
    say what they are and names stay legal in op names (a training step names its update ops
    after them); and keep one parameter per entry, so a weight used twice gets both uses'
    gradients: a second copy reads the first, and a transposed copy of an entry the graph also
    reads whole becomes a ``Transpose`` of it, and a copy with unit dims added (``nn.GroupNorm``'s
    weight as ``[C, 1, 1]``) a ``Reshape`` of the entry (``weight.view``). Only arrays of more than
    one value are matched (a zero bias and a zero constant are not the same parameter).
    Initializers matching no entry get the exporter's name made legal. Returns the model and the
    names of the initializers that hold ``trainable`` parameters (the module's, by ``state_dict``
    name)."""
    import onnx  # noqa: PLC0415
    from onnx import helper, numpy_helper  # noqa: PLC0415

    from ir.importers.program import _BAD

    m = onnx.load_from_string(onnx_bytes)
    _untie_equal_values(m, state)
    # (float(): numpy has no bfloat16; equality of the values is all that is asked)
    arrays = {k: v.detach().float().cpu().numpy() for k, v in state.items() if v.dtype.is_floating_point}
    present = {t.name for t in m.graph.initializer}  # names of initializers and of the transposes added
    out = trainable & present
    rename, drop, transposes, views = {}, set(), [], []
    for t in list(m.graph.initializer):
        if not _BAD.search(t.name):
            continue
        k, transposed = _state_entry(arrays, numpy_helper.to_array(t))
        if k is None:
            k = _viewed_entry(arrays, numpy_helper.to_array(t))
            if k is not None:  # a reshaped copy (GroupNorm's weight[C, 1, 1]): a Reshape of the entry
                views.append(_view_of(helper, numpy_helper, t, k, arrays[k].shape, present, m.graph.initializer))
                if k in trainable:
                    out.add(k)
                rename[t.name] = f"{k}.view"
                drop.add(t.name)
                continue
        target = None if k is None else f"{k}.T" if transposed else k
        if target is not None and target in present:  # the entry, or its transpose, is in the graph already
            rename[t.name] = target
            drop.add(t.name)
            continue
        if target is not None and transposed and k in present:  # the entry is read whole too: one parameter
            transposes.append(helper.make_node("Transpose", [k], [target], name=f"{k}.transpose", perm=[1, 0]))
            present.add(target)
            rename[t.name] = target
            drop.add(t.name)
            continue
        new = target if target is not None else _BAD.sub("_", t.name).strip("_.+-")  # (target: not present)
        while new in present:
            new += "_"
        present.add(new)
        if new == target and k in trainable:
            out.add(new)
        rename[t.name] = new
        t.name = new
    kept = [t for t in m.graph.initializer if t.name not in drop]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    for node in m.graph.node:
        for i, x in enumerate(node.input):
            if x in rename:
                node.input[i] = rename[x]
    nodes = transposes + [v for v in views if v is not None] + list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m, out


def _untie_equal_values(m: Any, state: Mapping[str, Any]) -> None:
    """The exporter keeps one initializer of entries with equal values and makes the others
    ``Identity`` nodes of it: two zero-initialised biases would train as one parameter. Each
    entry that is a tensor of its own (not the same storage: a tie the module made) gets its
    initializer back."""
    inits = {t.name: t for t in m.graph.initializer}
    keep = []
    for node in m.graph.node:
        src, out = (node.input[0], node.output[0]) if node.op_type == "Identity" else (None, None)
        if src in inits and out in state and src in state and out not in inits and \
                state[out].data_ptr() != state[src].data_ptr():
            t = type(inits[src])()
            t.CopyFrom(inits[src])
            t.name = out
            m.graph.initializer.append(t)
            inits[out] = t
            continue
        keep.append(node)
    if len(keep) < len(m.graph.node):
        del m.graph.node[:]
        m.graph.node.extend(keep)


def _viewed_entry(arrays: Mapping[str, np.ndarray], a: np.ndarray) -> str | None:
    """The ``state_dict`` entry ``a`` holds with unit dims added or removed, or None."""
    if a.size < 2 or np.all(a == a.reshape(-1)[0]):
        return None
    squeezed = tuple(d for d in a.shape if d != 1)
    for k, v in arrays.items():
        if v.size == a.size and tuple(d for d in v.shape if d != 1) == squeezed and \
                np.array_equal(v.reshape(a.shape), a):
            return k
    return None


def _view_of(helper: Any, numpy_helper: Any, t: Any, k: str, shape: tuple[int, ...], present: set[str],
             initializers: Any) -> Any:
    """The ``Reshape`` node ``k -> k.view`` giving initializer ``t``'s shape (None when one exists
    already); adds initializer ``k`` (``t``'s values in the entry's shape) if the graph lacks it."""
    if f"{k}.view" in present:
        return None
    if k not in present:
        initializers.append(numpy_helper.from_array(numpy_helper.to_array(t).reshape(shape), k))
        present.add(k)
    dims = f"{k}.view_shape"
    initializers.append(numpy_helper.from_array(np.array(t.dims, dtype=np.int64), dims))
    present.update((dims, f"{k}.view"))
    return helper.make_node("Reshape", [k, dims], [f"{k}.view"], name=f"{k}.reshape")


def _state_entry(arrays: Mapping[str, np.ndarray], a: np.ndarray) -> tuple[str | None, bool]:
    """The ``state_dict`` entry ``a`` holds (and whether transposed), or (None, False)."""
    if a.size < 2 or np.all(a == a.reshape(-1)[0]):
        return None, False
    for k, v in arrays.items():
        if v.shape == a.shape and np.array_equal(v, a):
            return k, False
    for k, v in arrays.items():
        if v.ndim == 2 and v.T.shape == a.shape and np.array_equal(v.T, a):
            return k, True
    return None, False


TRACE_SIZES = (2, 3, 5, 7, 11, 13)  # named dims are traced at these (distinct, none 1: no size-1 special case) ...
CHECK_SIZES = (3, 4, 6, 8, 12, 14)  # ... and checked at these (``import_torch``'s ``check``)


def import_torch_factory(spec: str, example_inputs: Sequence[tuple[str, str, Sequence[int | tuple[str, int]]]],
                         params: Mapping[str, Any] | None = None, batchnorm: str = "eval",
                         run: Callable | None = None) -> tuple[Graph, dict[str, np.ndarray]]:
    """``"path/module.py:make_model"``: call the factory, import the module it returns on random
    example inputs ``[(name, dtype, shape), ...]`` (ids drawn in ``[0, 2)`` for integer inputs);
    ``batchnorm`` as for ``import_torch``.

    A dim given as ``(name, size)`` (``x:int64[batch=8,seq=4096]`` on the command line) is
    symbolic: the module is traced at a small size (``TRACE_SIZES``, the k-th named dim at the
    k-th) and the program bound at ``size``, so the import costs what a tiny forward does,
    whatever the batch and sequence; the export is checked at other small sizes (``CHECK_SIZES``)
    against the module with ``run`` (``executor.run.execute``)."""
    torch = _torch()
    path, _, factory = spec.rpartition(":")
    p = Path(path)
    if not p.is_file():
        raise ImportFailure(f"PyTorch model file {path!r} does not exist; give module.py:factory")
    loader = importlib.util.spec_from_file_location(p.stem, p)
    mod = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001  (user code)
        raise ImportFailure(f"{path} failed to import: {type(e).__name__}: {e}") from None
    make = getattr(mod, factory, None)
    if not callable(make):
        raise ImportFailure(f"{path} has no function {factory!r}; give module.py:factory where factory() "
                            f"returns a torch.nn.Module")
    named: dict[str, int] = {}  # symbolic dim -> the size the program is bound at
    axes: dict[str, dict[int, str]] = {}
    for name, _dtype, shape in example_inputs:
        for i, d in enumerate(shape):
            if isinstance(d, tuple):
                dim, size = d
                if named.setdefault(dim, size) != size:
                    raise ImportFailure(f"dim {dim!r} is given two sizes, {named[dim]} and {size}; give it one")
                axes.setdefault(name, {})[i] = dim
    if len(named) > len(TRACE_SIZES):
        raise ImportFailure(f"{len(named)} named dims; up to {len(TRACE_SIZES)} are supported")
    trace = {dim: min(size, TRACE_SIZES[k]) for k, (dim, size) in enumerate(named.items())}
    check = {dim: min(size, CHECK_SIZES[k]) for k, (dim, size) in enumerate(named.items())}
    g = torch.Generator().manual_seed(0)
    ex = {}
    for name, dtype, shape in example_inputs:
        if dtype not in _TORCH_DTYPES:
            raise ImportFailure(f"example input {name!r} has dtype {dtype!r}; use one of {list(_TORCH_DTYPES)}")
        dims = tuple(trace[d[0]] if isinstance(d, tuple) else d for d in shape)
        if dtype.startswith("int"):
            ex[name] = torch.randint(0, 2, dims, generator=g, dtype=getattr(torch, dtype))
        else:
            ex[name] = torch.randn(dims, generator=g, dtype=getattr(torch, dtype))
    try:
        module = make()
    except Exception as e:  # noqa: BLE001  (user code)
        raise ImportFailure(f"{path}:{factory}() failed: {type(e).__name__}: {str(e)[:300]}") from None
    if not named:
        return import_torch(module, ex, params, batchnorm=batchnorm)
    return import_torch(module, ex, {**(params or {}), **named}, dynamic_axes=axes, batchnorm=batchnorm,
                        check=check, run=run)
