"""Validation of the records the archive stores: results, front changes, measurements.

Everything here is plain Python, checked before a transaction starts (so a bad record changes
nothing and the write lock is held briefly). Each function raises
:class:`~storage.errors.InvalidRecord` naming the item and the field; none touches the database.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from storage.errors import InvalidRecord
from storage.models import MEASUREMENT_BACKENDS, MEASUREMENT_KINDS, utcnow

__all__ = [
    "OBJECTIVE_COLUMNS",
    "FrontChange",
    "PreparedResults",
    "as_digest",
    "as_float",
    "as_int",
    "as_objective",
    "as_optional_float",
    "as_timestamp",
    "check_keys",
    "dumps_json",
    "prepare_front",
    "prepare_measurement",
    "prepare_result",
    "prepare_results",
]

#: Objective keys of a result's ``objectives`` dict, one column each in ``evaluations``.
OBJECTIVE_COLUMNS = ("makespan", "energy", "peak_memory", "devices", "bytes_moved")

RESULT_REQUIRED = frozenset({"digest", "graph_json", "objectives", "feasible", "seq"})
RESULT_OPTIONAL = frozenset(
    {"parent_digest", "rewrite", "lower_bound", "gap", "worker", "eval_seconds", "evaluated_at"}
)
MEASUREMENT_REQUIRED = frozenset(
    {"plan_digest", "kind", "backend", "device_name", "measured_seconds"}
)
MEASUREMENT_OPTIONAL = frozenset(
    {
        "campaign",
        "op",
        "shard",
        "predicted_seconds",
        "verified",
        "max_rel_error",
        "details",
        "measured_at",
    }
)
DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def dumps_json(value: Any, what: str, *, allow_nan: bool = True) -> str:
    try:
        return json.dumps(value, allow_nan=allow_nan, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidRecord(
            f"{what} must be plain JSON data (dict, list, str, numbers): {exc}"
        ) from exc


def as_float(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise InvalidRecord(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRecord(f"{what} must be a number, got {value!r}") from exc


def as_objective(value: Any, what: str) -> float:
    number = as_float(value, what)
    if math.isnan(number):
        raise InvalidRecord(f"{what} is NaN; objectives must be numbers (inf is allowed)")
    return number


def as_optional_float(value: Any, what: str) -> float | None:
    if value is None:
        return None
    number = as_float(value, what)
    return None if math.isnan(number) else number  # NaN = unknown


def as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise InvalidRecord(f"{what} must be an integer, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRecord(f"{what} must be an integer, got {value!r}") from exc
    if number != value:
        raise InvalidRecord(f"{what} must be an integer, got {value!r}")
    return number


def as_digest(value: Any, what: str) -> str:
    if not isinstance(value, str) or not DIGEST_RE.fullmatch(value):
        raise InvalidRecord(
            f"{what} must be a SHA-256 digest (64 lowercase hex digits), got {value!r}"
        )
    return value


def as_timestamp(value: Any, what: str, default: datetime) -> datetime:
    if value is None:
        return default
    if not isinstance(value, datetime):
        raise InvalidRecord(f"{what} must be a datetime, got {value!r}")
    return value


def check_keys(
    item: Mapping[str, Any], required: frozenset[str], optional: frozenset[str], where: str
) -> None:
    if not isinstance(item, Mapping):
        raise InvalidRecord(f"{where} must be a dict, got {type(item).__name__}")
    missing = sorted(required - item.keys())
    unknown = sorted(set(item.keys()) - required - optional)
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {', '.join(map(str, unknown))}")
        raise InvalidRecord(
            f"{where}: {'; '.join(parts)}. Expected keys: {', '.join(sorted(required))}, "
            f"optional: {', '.join(sorted(optional))}"
        )


@dataclass(frozen=True)
class PreparedResults:
    """A validated add_results batch: new-candidate rows by digest, evaluation rows in order."""

    candidates: dict[str, dict[str, Any]]
    evaluations: list[tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class FrontChange:
    entered: list[str]
    left: list[str]
    seq: int


def prepare_results(campaign: str, batch: Iterable[Mapping[str, Any]]) -> PreparedResults:
    # Validate and compress before the transaction, so the write lock is held briefly.
    candidates: dict[str, dict[str, Any]] = {}
    evaluations: list[tuple[str, dict[str, Any]]] = []
    now = utcnow()
    for index, item in enumerate(batch):
        where = f"add_results item {index} of campaign {campaign!r}"
        digest, candidate, evaluation = prepare_result(item, where, now)
        candidates.setdefault(digest, candidate)
        evaluations.append((digest, evaluation))
    return PreparedResults(candidates, evaluations)


def prepare_front(
    campaign: str, entered: Sequence[str], left: Sequence[str], seq: int
) -> FrontChange:
    entered_list, left_list = list(dict.fromkeys(entered)), list(dict.fromkeys(left))
    both = set(entered_list) & set(left_list)
    if both:
        raise InvalidRecord(
            f"update_front for campaign {campaign!r}: digests both enter and leave the front: "
            f"{', '.join(sorted(both)[:3])}"
        )
    return FrontChange(entered_list, left_list, as_int(seq, "update_front seq"))


def prepare_result(
    item: Mapping[str, Any], where: str, now: datetime
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    check_keys(item, RESULT_REQUIRED, RESULT_OPTIONAL, where)
    digest = as_digest(item["digest"], f"{where}: digest")
    parent = item.get("parent_digest")
    if parent is not None:
        as_digest(parent, f"{where}: parent_digest")
    graph_json = item["graph_json"]
    if not isinstance(graph_json, str):
        raise InvalidRecord(f"{where}: graph_json must be the graph's JSON text (str)")
    rewrite = item.get("rewrite")
    objectives = item["objectives"]
    if not isinstance(objectives, Mapping) or set(objectives) != set(OBJECTIVE_COLUMNS):
        got = sorted(objectives) if isinstance(objectives, Mapping) else objectives
        raise InvalidRecord(
            f"{where}: objectives must be a dict with exactly {', '.join(OBJECTIVE_COLUMNS)}; "
            f"got {got!r}"
        )
    candidate = {
        "digest": digest,
        "graph_zlib": zlib.compress(graph_json.encode("utf-8"), 6),
        "parent_digest": parent,
        "rewrite": None if rewrite is None else str(rewrite),
        "created_at": now,
    }
    evaluation: dict[str, Any] = {
        key: as_objective(objectives[key], f"{where}: objectives.{key}")
        for key in OBJECTIVE_COLUMNS
        if key != "devices"
    }
    evaluation["devices"] = as_int(objectives["devices"], f"{where}: objectives.devices")
    worker = item.get("worker")
    evaluation.update(
        feasible=bool(item["feasible"]),
        lower_bound=as_optional_float(item.get("lower_bound"), f"{where}: lower_bound"),
        gap=as_optional_float(item.get("gap"), f"{where}: gap"),
        worker=None if worker is None else str(worker),
        eval_seconds=as_optional_float(item.get("eval_seconds"), f"{where}: eval_seconds"),
        evaluated_at=as_timestamp(item.get("evaluated_at"), f"{where}: evaluated_at", now),
        seq=as_int(item["seq"], f"{where}: seq"),
    )
    return digest, candidate, evaluation


def prepare_measurement(
    record: Mapping[str, Any], where: str, now: datetime
) -> tuple[str | None, dict[str, Any]]:
    check_keys(record, MEASUREMENT_REQUIRED, MEASUREMENT_OPTIONAL, where)
    kind, backend = record["kind"], record["backend"]
    if kind not in MEASUREMENT_KINDS:
        raise InvalidRecord(f"{where}: kind {kind!r} is not one of {', '.join(MEASUREMENT_KINDS)}")
    if backend not in MEASUREMENT_BACKENDS:
        raise InvalidRecord(
            f"{where}: backend {backend!r} is not one of {', '.join(MEASUREMENT_BACKENDS)}"
        )
    plan_digest = record["plan_digest"]
    if not isinstance(plan_digest, str) or not 0 < len(plan_digest) <= 64:
        raise InvalidRecord(f"{where}: plan_digest must be a digest string, got {plan_digest!r}")
    campaign = record.get("campaign")
    shard = record.get("shard")
    verified = record.get("verified")
    op = record.get("op")
    row = {
        "plan_digest": plan_digest,
        "kind": kind,
        "backend": backend,
        "device_name": str(record["device_name"]),
        "op": None if op is None else str(op),
        "shard": None if shard is None else as_int(shard, f"{where}: shard"),
        "measured_seconds": as_objective(record["measured_seconds"], f"{where}: measured_seconds"),
        "predicted_seconds": as_optional_float(
            record.get("predicted_seconds"), f"{where}: predicted_seconds"
        ),
        "verified": None if verified is None else bool(verified),
        "max_rel_error": as_optional_float(record.get("max_rel_error"), f"{where}: max_rel_error"),
        "details_json": dumps_json(dict(record.get("details") or {}), f"{where}: details"),
        "measured_at": as_timestamp(record.get("measured_at"), f"{where}: measured_at", now),
    }
    return (None if campaign is None else str(campaign)), row
