"""Parameter values beside a program: ``program.json`` -> ``program.npz`` (arrays by tensor name).

An imported program's initializers are its parameters' values; they travel as one ``.npz``
file with the program's stem, so any plan file keeps finding them by name.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Mapping

import numpy as np

from ir.importers.errors import ImportFailure


def values_file(program: str | Path) -> Path:
    """The ``.npz`` beside a program or plan file (same folder, same stem)."""
    return Path(program).with_suffix(".npz")


def save_values(values: Mapping[str, np.ndarray], path: str | Path) -> None:
    # savez keys must be identifiers-ish; tensor names like "/h.0/attn.W" are fine as zip entries.
    with open(path, "wb") as f:
        np.savez(f, **{k: np.asarray(v) for k, v in values.items()})


def load_values(path: str | Path) -> dict[str, np.ndarray]:
    """Arrays by tensor name; an unreadable file is an :class:`ImportFailure`."""
    if Path(path).is_file() and not zipfile.is_zipfile(path):
        raise ImportFailure(f"cannot read parameter values from {str(path)!r}: it is not an .npz archive; it must "
                            f"be the .npz written by 'tapestry import'")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ImportFailure(f"cannot read parameter values from {str(path)!r}: {e}; it must be the .npz "
                            f"written by 'tapestry import'") from None
