"""PyTorch -> block graph, through ONNX: ``import_torch(module, example_inputs)``.

The module is exported with ``torch.onnx.export`` (the TorchScript exporter, ``dynamo=False``:
the torch.export-based exporter needs ``onnxscript``, which the ``[torch]`` extra does not pull
in) at the example inputs' shapes, then imported by ``ir.importers.onnx``: one mapping for both
front ends. The exporter names initializers after the module's ``state_dict`` keys
(``fc1.weight``), so the program's parameters carry those names; ``nn.Linear`` on 2-D inputs
exports as ``Gemm(transB=1)`` (an einsum on the stored ``[out, in]`` weight).

Needs the ``[torch]`` extra (``pip install 'tapestry[torch]'``, a CPU wheel is enough).
"""

from __future__ import annotations

import importlib.util
import io
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ir.graph import Graph
from ir.importers.errors import ImportFailure
from ir.importers.onnx import import_onnx

_TORCH_DTYPES = ("float32", "float16", "int64", "int32")


def _torch() -> Any:
    try:
        import torch  # noqa: PLC0415  (optional heavy dependency)
    except ImportError:
        raise ImportFailure("importing a PyTorch model needs torch: pip install 'tapestry[torch]' "
                            "(or export the model to ONNX yourself and import the .onnx file)") from None
    return torch


def import_torch(module: Any, example_inputs: Mapping[str, Any], params: Mapping[str, Any] | None = None,
                 opset: int = 17, dynamic_axes: Mapping[str, Mapping[int, str]] | None = None
                 ) -> tuple[Graph, dict[str, np.ndarray]]:
    """Import ``module`` (a ``torch.nn.Module``) called on ``example_inputs`` (name -> tensor, in
    the order of its forward arguments). Returns the graph and its parameter values.

    ``dynamic_axes`` (``{"x": {0: "batch", 1: "seq"}}``) exports those dims as symbolic; ``params``
    then binds them, so one export serves any batch and sequence length."""
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise ImportFailure(f"expected a torch.nn.Module, got {type(module).__name__}")
    module = module.eval()
    names = list(example_inputs)
    args = tuple(example_inputs[n] for n in names)
    with torch.no_grad():
        out = module(*args)
    n_out = len(out) if isinstance(out, (tuple, list)) else 1
    out_names = ["output"] if n_out == 1 else [f"output_{i}" for i in range(n_out)]
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, buf, dynamo=False, input_names=names, output_names=out_names,
                              opset_version=opset, do_constant_folding=True,
                              dynamic_axes={k: dict(v) for k, v in (dynamic_axes or {}).items()} or None)
    except Exception as e:  # noqa: BLE001  (the exporter raises many types)
        raise ImportFailure(f"torch.onnx.export could not export the module: {type(e).__name__}: "
                            f"{str(e)[:300]}") from None
    model = _name_folded_weights(buf.getvalue(), module.state_dict())
    return import_onnx(model, params, what="imported PyTorch model")


def _name_folded_weights(onnx_bytes: bytes, state: Mapping[str, Any]) -> Any:
    """The exporter folds ``weight.T`` of 3-D ``nn.Linear`` calls into new initializers named like
    ``onnx::MatMul_109``; name each after the ``state_dict`` entry it holds (``q.weight.T``), so
    parameters say what they are and names stay legal in op names (a training step names its
    update ops after them). Initializers matching no entry get the exporter's name made legal."""
    import onnx  # noqa: PLC0415
    from onnx import numpy_helper  # noqa: PLC0415

    from ir.importers.program import _BAD

    m = onnx.load_from_string(onnx_bytes)
    arrays = {k: v.detach().cpu().numpy() for k, v in state.items() if v.dtype.is_floating_point}
    taken = {t.name for t in m.graph.initializer}
    rename = {}
    for t in m.graph.initializer:
        if not _BAD.search(t.name):
            continue
        a = numpy_helper.to_array(t)
        new = next((k for k, v in arrays.items() if v.shape == a.shape and np.array_equal(v, a)), None)
        if new is None:
            new = next((f"{k}.T" for k, v in arrays.items() if v.ndim == 2 and v.T.shape == a.shape
                        and np.array_equal(v.T, a)), None)
        new = new if new is not None and new not in taken else _BAD.sub("_", t.name).strip("_.+-")
        while new in taken:
            new += "_"
        taken.add(new)
        rename[t.name] = new
        t.name = new
    for node in m.graph.node:
        for i, x in enumerate(node.input):
            if x in rename:
                node.input[i] = rename[x]
    return m


def import_torch_factory(spec: str, example_inputs: Sequence[tuple[str, str, Sequence[int]]],
                         params: Mapping[str, Any] | None = None) -> tuple[Graph, dict[str, np.ndarray]]:
    """``"path/module.py:make_model"``: call the factory, import the module it returns on random
    example inputs ``[(name, dtype, shape), ...]`` (ids drawn in ``[0, 2)`` for integer inputs)."""
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
    g = torch.Generator().manual_seed(0)
    ex = {}
    for name, dtype, shape in example_inputs:
        if dtype not in _TORCH_DTYPES:
            raise ImportFailure(f"example input {name!r} has dtype {dtype!r}; use one of {list(_TORCH_DTYPES)}")
        if dtype.startswith("int"):
            ex[name] = torch.randint(0, 2, tuple(shape), generator=g, dtype=getattr(torch, dtype))
        else:
            ex[name] = torch.randn(tuple(shape), generator=g, dtype=getattr(torch, dtype))
    return import_torch(make(), ex, params)
