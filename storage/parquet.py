"""Parquet export of a campaign's front (``tapestry export`` writes ``front.parquet``).

pyarrow is imported inside the function: it is heavy, and only exports need it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from storage.errors import StorageError
from storage.records import OBJECTIVE_COLUMNS

__all__ = ["write_front_parquet"]


def write_front_parquet(
    path: str | Path,
    campaign: str,
    objectives: Sequence[str],
    reference_point: Sequence[float],
    front: Sequence[Mapping[str, Any]],
) -> int:
    """Write ``front`` (rows as :meth:`storage.Archive.current_front` returns them) to a
    Parquet file; return the number of rows.

    Columns: campaign, digest, rewrite, parent_digest, the five objectives, feasible,
    lower_bound, gap, entered_seq, entered_at. The file's metadata holds the campaign's
    objectives and reference point (keys ``tapestry.objectives``, ``tapestry.reference_point``).

    Raises ``StorageError`` if the file cannot be written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("campaign", pa.string()),
            ("digest", pa.string()),
            ("rewrite", pa.string()),
            ("parent_digest", pa.string()),
            ("makespan", pa.float64()),
            ("energy", pa.float64()),
            ("peak_memory", pa.float64()),
            ("devices", pa.int64()),
            ("bytes_moved", pa.float64()),
            ("feasible", pa.bool_()),
            ("lower_bound", pa.float64()),
            ("gap", pa.float64()),
            ("entered_seq", pa.int64()),
            ("entered_at", pa.timestamp("us", tz="UTC")),
        ],
        metadata={
            "tapestry.campaign": campaign,
            "tapestry.objectives": json.dumps(list(objectives)),
            "tapestry.reference_point": json.dumps(list(reference_point)),
        },
    )
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    for row in front:
        columns["campaign"].append(campaign)
        for key in ("digest", "rewrite", "parent_digest", "feasible", "lower_bound", "gap"):
            columns[key].append(row[key])
        for key in OBJECTIVE_COLUMNS:
            columns[key].append(row["objectives"][key])
        columns["entered_seq"].append(row["entered_seq"])
        columns["entered_at"].append(row["entered_at"])
    table = pa.Table.from_pydict(columns, schema=schema)
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, target)
    except OSError as exc:
        raise StorageError(f"cannot write the front of {campaign!r} to {target}: {exc}") from exc
    return int(table.num_rows)
