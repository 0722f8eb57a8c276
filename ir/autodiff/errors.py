"""The error autodiff raises for programs it cannot differentiate, and op naming."""

import re


class AutodiffError(ValueError):
    """The program cannot be differentiated as asked; the message names the op or tensor and why."""


def op_name(tensor: str, suffix: str) -> str:
    """An op name derived from a tensor name: characters that op names may not hold (``/``, ``:``,
    as ONNX initializers have) become ``_`` (``ir.validate.OP_NAME``)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", tensor).lstrip(".+-") + suffix
