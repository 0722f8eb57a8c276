"""Importers: programs from other frameworks into the block graph.

- ``ir.importers.onnx.import_onnx(model, params)``: an ONNX model (a path, bytes or a
  ``ModelProto``) with its symbolic dims bound -> ``(Graph, initializer values)``.
- ``ir.importers.torch_export.import_torch(module, example_inputs)``: a ``torch.nn.Module``
  through ``torch.onnx.export`` and the ONNX importer (needs the ``[torch]`` extra).

Both raise :class:`ImportFailure` (bad file, unsupported ops, unbindable dims) with one
paragraph saying what is wrong and how to fix it.
"""

from ir.importers.errors import ImportFailure

__all__ = ["ImportFailure"]
