"""The one error type of the importers (the CLI prints it as one paragraph, exit status 2)."""

from __future__ import annotations


class ImportFailure(ValueError):
    """The model cannot be imported: unreadable file, unsupported ops, dims that cannot be bound."""
