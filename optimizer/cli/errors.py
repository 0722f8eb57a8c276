"""User-facing errors: printed as one paragraph, exit status 2, never a traceback.

Each package raises its own error types; the CLI treats these (by dotted name, so nothing heavy
is imported just to catch it) as bad input. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

USER_ERRORS = (
    "optimizer.cli.errors.UserError",
    "ir.validate.InvalidGraph",
    "ir.kernels.base.SignatureError",
    "ir.rewrites.errors.RewriteError",
    "ir.workloads.WorkloadError",
    "ir.dot.RenderError",
    "executor.backend.BackendError",
    "costmodel.hardware.HardwareError",
    "storage.errors.StorageError",
    "optimizer.campaign.config.ConfigError",
    "optimizer.campaign.cluster.ClusterError",
    "costmodel.lowering.PlanSizeError",
    "executor.verify.ExecutionTooLarge",
    "ir.importers.errors.ImportFailure",
    "executor.codegen.program.CodegenError",
)


class UserError(Exception):
    """Bad input detected by the CLI itself (missing file, bad option value, ...)."""


def user_error_types() -> tuple[type, ...]:
    out = []
    for dotted in USER_ERRORS:
        mod, _, name = dotted.rpartition(".")
        if mod in sys.modules or mod == __name__:
            try:
                out.append(getattr(importlib.import_module(mod), name))
            except (ImportError, AttributeError):
                pass
    return tuple(out)


def print_error(e: BaseException) -> None:
    text = str(e).strip() or e.__class__.__name__
    head, *rest = text.split("\n")
    sys.stderr.write("error: " + textwrap.fill(head, 100, subsequent_indent="  ") + "\n")
    for line in rest:
        sys.stderr.write(line + "\n")
