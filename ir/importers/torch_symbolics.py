"""ONNX symbolics that torch's TorchScript exporter lacks, registered only while we export.

Hugging Face decoders (Llama, Mistral, Qwen2, GPT-2, Gemma, Phi, GPT-NeoX; ``transformers`` 4.5x
and later) call ``torch.diff`` on the position ids when no attention mask is given (a training
setup: ``masking_utils.find_packed_sequence_indices`` looks for packed sequences), and the
exporter has no ``aten::diff`` at any opset. Its symbolic here is the definition
(``torch.diff``: ``out[i] = x[i + 1] - x[i]`` along ``dim``, ``n`` times, after concatenating
``prepend`` and ``append``) in Concat, Slice and Sub, which the importer folds when the
positions are constants, as they are in such exports.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_OPSET = 9  # the lowest opset each symbolic below is valid from (Slice with inputs needs 10: see ``_diff``)
_END = 2**62  # "to the end" for Slice


def _diff(g: Any, x: Any, n: Any, dim: Any, prepend: Any, append: Any) -> Any:
    import torch  # noqa: PLC0415
    from torch.onnx import symbolic_helper as sh  # noqa: PLC0415

    n, dim = sh._get_const(n, "i", "n"), sh._get_const(dim, "i", "dim")
    parts = [v for v in (prepend, x, append) if v is not None and not sh._is_none(v)]
    if len(parts) > 1:
        x = g.op("Concat", *parts, axis_i=dim)

    def const(v: int) -> Any:
        return g.op("Constant", value_t=torch.tensor([v], dtype=torch.int64))

    for _ in range(n):
        later = g.op("Slice", x, const(1), const(_END), const(dim))
        earlier = g.op("Slice", x, const(0), const(-1), const(dim))
        x = g.op("Sub", later, earlier)
    return x


SYMBOLICS = {"aten::diff": _diff}


@contextlib.contextmanager
def extra_symbolics(torch: Any, opset: int) -> Iterator[None]:
    """Register :data:`SYMBOLICS` for one export at ``opset`` (10 or later: ``Slice`` takes its
    bounds as inputs from opset 10) and unregister them afterwards, so torch's registry is as
    the caller left it."""
    # a symbolic already there (the caller's own, or torch's) is left alone: registering ours would
    # replace it for this export and unregistering would delete it
    names = [n for n in SYMBOLICS if not _registered(n, opset)] if opset >= 10 else []
    for name in names:
        torch.onnx.register_custom_op_symbolic(name, SYMBOLICS[name], _OPSET)
    try:
        yield
    finally:
        for name in names:
            torch.onnx.unregister_custom_op_symbolic(name, _OPSET)
            _drop_empty_group(name)


def _drop_empty_group(name: str) -> None:
    """torch 2.13 leaves an unregistered op's group behind with no function in it, and its exporter
    then fails on ``min()`` of nothing instead of saying the op is unsupported: drop the group."""
    try:
        from torch.onnx._internal.torchscript_exporter.registration import registry  # noqa: PLC0415

        group = registry.get_function_group(name)
    except (ImportError, AttributeError):  # another torch: its own behaviour stands
        return
    try:
        if group is not None:
            group.get_min_supported()
    except ValueError:  # (min() of no opsets)
        registry._registry.pop(name, None)


def _registered(name: str, opset: int) -> bool:
    """Whether torch's exporter already has a symbolic for ``name`` at ``opset``."""
    try:
        from torch.onnx._internal.torchscript_exporter.registration import registry  # noqa: PLC0415

        return bool(registry.is_registered_op(name, opset))
    except (ImportError, AttributeError, ValueError):  # another torch (or an emptied group): register ours
        return False
