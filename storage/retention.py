"""Retention: what a campaign archive keeps over days of search, and compaction that applies it.

A farm stores tens of results a second; kept whole, a node's archive grows by gigabytes a day.
The policy (:class:`RetentionPolicy`) keeps:

* **plans** (full, or as a delta: the rewrite text from a stored parent) for the *plan set*:
  the current front; every candidate a checkpoint mentions (``resume`` refetches the strategy's
  populations by digest); baselines (``rewrite`` starting with ``baseline:``); sampled plans
  (a measurement links to them); digests the caller names; and the lineage of all of these
  (``parent_digest`` chains back to the program, as far as the parents are stored);
* **rows** (candidate digest, parent, rewrite and every evaluation's objectives) for the plan set
  and every candidate that was ever on the front, so ``front_history`` and SQL over it still work;
* **the rest**: with ``history="objectives"`` the candidate row and its evaluations stay, the plan
  is dropped (``plan_kind = 'dropped'``); with ``history="intervals"`` (default) the candidate
  and its evaluations are deleted and the evaluations are added to ``evaluation_intervals``
  buckets (count, feasible count, seq range, best objectives), so counts and best-so-far curves
  over the whole history stay answerable.

Candidates created in the last ``grace_seconds`` are not touched (recent history stays whole).

**Deltas.** A plan-set candidate whose parent is in the plan set, was stored before it, and whose
``rewrite`` replays on the parent to exactly its digest (checked here, by the caller's ``replay``
function: storage knows no graphs) is stored as the rewrite text alone when that is shorter than
its compressed JSON, up to ``max_delta_depth`` deltas in a row (reading a plan replays at most
that many rewrites). A parent in the plan set stays in it as long as its child does (lineage),
so a delta never loses its base.

**Crash safety.** Compaction is a sequence of small transactions, each over a chunk of candidate
ids, each idempotent: a chunk's aggregation into intervals and the deletion of its rows commit
together; a plan becomes a delta or dropped in the same transaction that checks it. A ``kill -9``
anywhere leaves every chunk done or untouched; running compaction again finishes the work. Nothing
in the plan or row sets is ever deleted.

**Space.** SQLite reuses the pages of deleted rows (its freelist) without help. PostgreSQL
keeps deleted rows as dead tuples until a vacuum marks their space reusable; autovacuum at
default settings (20 % of a table dead, checked each minute) lags a compaction that deletes
most of a table's rows every two minutes, so the table and its TOAST grow with the peaks.
:func:`reclaim_space` therefore runs a plain ``VACUUM`` of Tapestry's tables after each
compaction that changed rows (no lock beyond what ordinary writes take; the space is reused,
not returned to the operating system, so the archive's size plateaus at its peak working set).

**Concurrency.** Compaction assumes it is the archive's only writer for the campaign (the driver
runs it between merges; ``tapestry archive compact`` refuses while a driver is alive).
"""

from __future__ import annotations

import math
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, func, insert, select, update
from sqlalchemy.orm import Session

from storage.errors import CandidateNotFound, InvalidRecord, PlanNotKept, StorageError
from storage.models import (
    Candidate,
    Checkpoint,
    Evaluation,
    EvaluationInterval,
    FrontEntry,
    Measurement,
    utcnow,
)
from storage.records import OBJECTIVE_COLUMNS

__all__ = [
    "HISTORY_MODES",
    "CompactionReport",
    "NotReplayable",
    "Replay",
    "RetentionPolicy",
    "compact_campaign",
    "load_plan",
    "reclaim_space",
]

#: ``replay(parent_json, rewrite) -> (child_json, child_digest)``: applies a stored rewrite text
#: to a plan (the optimizer supplies it; storage imports no graph code). ``NotReplayable`` means
#: the text records lineage only (the plan stays whole, not a failure); any other exception means
#: "cannot replay" (counted in ``CompactionReport.delta_failures``).
Replay = Callable[[str, str], tuple[str, str]]


class NotReplayable(Exception):
    """Raised by a ``Replay`` for rewrite text that records lineage but cannot rebuild the plan
    from its parent alone (a crossover needs its mate too): such plans are kept whole."""


Scope = Callable[[str], AbstractContextManager[Session]]

HISTORY_MODES = ("intervals", "objectives")
_DIGEST_IN_TEXT = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
# Candidate ids per compaction transaction: short write locks (the driver shares the archive).
_CHUNK = 2000
# A delta chain longer than this is corrupt (a cycle): the policy caps chains far below it.
_MAX_CHAIN = 10_000


@dataclass(frozen=True)
class RetentionPolicy:
    """What compaction keeps; see the module docstring. Plain data (the config builds it)."""

    history: str = "intervals"
    interval_seconds: float = 60.0
    grace_seconds: float = 120.0
    deltas: bool = True
    max_delta_depth: int = 16

    def __post_init__(self) -> None:
        if self.history not in HISTORY_MODES:
            raise InvalidRecord(
                f"retention history {self.history!r} is not one of {', '.join(HISTORY_MODES)}"
            )
        for name in ("interval_seconds", "grace_seconds"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "interval_seconds" and value == 0):
                raise InvalidRecord(f"retention {name} must be a positive number, got {value!r}")
        if self.max_delta_depth < 0:
            raise InvalidRecord(
                f"retention max_delta_depth must be >= 0, got {self.max_delta_depth!r}"
            )


@dataclass
class CompactionReport:
    """What one compaction did (counts of candidates unless named otherwise)."""

    plan_set: int = 0
    row_set: int = 0
    dropped_plans: int = 0
    deleted_candidates: int = 0
    aggregated_evaluations: int = 0
    deltas: int = 0
    #: replays that failed or gave another digest (a bug in the replay function or the archive)
    delta_failures: int = 0
    #: plans whose rewrite records lineage only (``NotReplayable``), kept whole as expected
    not_replayable: int = 0
    seconds: float = 0.0
    steps: int = 0
    #: seconds spent in ``VACUUM`` afterwards (PostgreSQL; 0.0 when none ran)
    vacuum_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def changed_rows(self) -> bool:
        """Whether the compaction deleted or rewrote rows (so there is dead space to reclaim)."""
        return bool(self.dropped_plans or self.deleted_candidates or self.deltas)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for JSON and the CLI)."""
        return dict(self.__dict__)


def compact_campaign(
    write: Scope,
    read: Scope,
    cid: int,
    policy: RetentionPolicy,
    *,
    replay: Replay | None = None,
    keep: Iterable[str] = (),
    now: datetime | None = None,
    after_step: Callable[[int], None] | None = None,
) -> CompactionReport:
    """Apply ``policy`` to campaign ``cid``; see the module docstring.

    ``write``/``read`` open one transaction each (the archive's session scopes). ``replay``
    enables delta encoding (skipped without it). ``keep`` names extra digests to keep with
    their plans. ``after_step(n)`` is called after each committed transaction (tests use it to
    kill the process halfway).
    """
    t0 = time.perf_counter()
    report = CompactionReport()
    now = now or utcnow()
    horizon_time = now - timedelta(seconds=policy.grace_seconds)

    def step() -> None:
        report.steps += 1
        if after_step is not None:
            after_step(report.steps)

    with read("computing what the retention policy keeps") as s:
        horizon = s.scalar(
            select(func.max(Candidate.id)).where(
                Candidate.campaign_id == cid, Candidate.created_at <= horizon_time
            )
        )
        plan_ids, parents = _plan_set(s, cid, keep)
        row_ids = plan_ids | set(
            s.scalars(select(FrontEntry.candidate_id).where(FrontEntry.campaign_id == cid))
        )
    report.plan_set, report.row_set = len(plan_ids), len(row_ids)
    if horizon is not None:
        for chunk in _id_chunks(read, cid, int(horizon)):
            thin = policy.history == "intervals"
            gone = [i for i, _ in chunk if i not in row_ids] if thin else []
            doomed = set(gone)
            drop = [
                i
                for i, kind in chunk
                if i not in plan_ids and kind != "dropped" and i not in doomed
            ]
            if not drop and not gone:
                continue
            with write("compacting the archive") as s:
                if drop:
                    s.execute(
                        update(Candidate)
                        .where(Candidate.id.in_(drop))
                        .values(graph_zlib=b"", plan_kind="dropped")
                    )
                if gone:
                    report.aggregated_evaluations += _aggregate_and_delete(
                        s, cid, gone, policy.interval_seconds
                    )
            report.dropped_plans += len(drop)
            report.deleted_candidates += len(gone)
            step()
    if policy.deltas and replay is not None:
        _encode_deltas(write, read, cid, plan_ids, parents, policy, replay, report, step)
    elif policy.deltas:
        report.notes.append("deltas skipped: no replay function given")
    report.seconds = time.perf_counter() - t0
    return report


def reclaim_space(engine: Engine, tables: Iterable[str]) -> float:
    """Make the space of deleted rows reusable; returns the seconds spent (0.0: nothing to do).

    PostgreSQL: ``VACUUM (ANALYZE)`` of ``tables`` (outside a transaction, as ``VACUUM``
    requires; it takes only a SHARE UPDATE EXCLUSIVE lock, so readers and writers go on).
    SQLite needs nothing (see the module docstring) and other backends are left alone.
    """
    if engine.dialect.name != "postgresql":
        return 0.0
    names = [str(t) for t in tables]
    if not names:
        return 0.0
    t0 = time.perf_counter()
    preparer = engine.dialect.identifier_preparer
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM (ANALYZE) " + ", ".join(preparer.quote(n) for n in names))
    return time.perf_counter() - t0


def load_plan(s: Session, cid: int, campaign: str, digest: str, replay: Replay | None) -> str:
    """The plan JSON of candidate ``digest``, replaying deltas from the nearest full ancestor.

    Raises ``CandidateNotFound`` (no such candidate), ``PlanNotKept`` (the policy dropped it),
    ``StorageError`` (a delta without ``replay``, or a replay that does not give the digest).
    """
    chain: list[tuple[str, str]] = []
    current = digest
    while True:
        row = s.execute(
            select(
                Candidate.plan_kind,
                Candidate.graph_zlib,
                Candidate.parent_digest,
                Candidate.rewrite,
            ).where(Candidate.campaign_id == cid, Candidate.digest == current)
        ).first()
        if row is None:
            what = "candidate" if not chain else "the stored parent of delta candidate"
            raise CandidateNotFound(
                f"campaign {campaign!r} has no {what} {current}; store candidates with "
                "add_results before referring to them"
            )
        if row.plan_kind == "full":
            text = _decompress(row.graph_zlib, f"of campaign {campaign!r}", current)
            break
        if row.plan_kind == "dropped" or row.parent_digest is None or row.rewrite is None:
            raise PlanNotKept(
                f"candidate {current} of campaign {campaign!r} is stored without its plan: the "
                "retention policy kept only its digest, lineage and objectives. Plans are kept "
                "for front members, their lineage, baselines, sampled and checkpointed plans."
            )
        chain.append((current, row.rewrite))
        current = row.parent_digest
        if len(chain) > _MAX_CHAIN:
            raise StorageError(f"candidate {digest} of campaign {campaign!r}: delta chain loops")
    if chain and replay is None:
        raise StorageError(
            f"candidate {digest} of campaign {campaign!r} is stored as a delta (a rewrite of its "
            "parent); read it with a replay function (optimizer.campaign.plans.fetch_plan)"
        )
    for child, rewrite in reversed(chain):
        where = f"of campaign {campaign!r}"
        text = _replay_checked(replay, text, rewrite, child, where)  # type: ignore[arg-type]
    return text


# ---------------------------------------------------------------------- the plan set


def _plan_set(s: Session, cid: int, keep: Iterable[str]) -> tuple[set[int], dict[int, int]]:
    """Ids of the candidates whose plans are kept, and parent id by child id within the set."""
    seeds: set[str] = {str(d) for d in keep}
    for state in s.scalars(select(Checkpoint.state_json).where(Checkpoint.campaign_id == cid)):
        seeds.update(_DIGEST_IN_TEXT.findall(state))
    ids: set[int] = set(
        s.scalars(
            select(FrontEntry.candidate_id).where(
                FrontEntry.campaign_id == cid, FrontEntry.left_at.is_(None)
            )
        )
    )
    ids.update(
        s.scalars(
            select(Candidate.id).where(
                Candidate.campaign_id == cid, Candidate.rewrite.like("baseline:%")
            )
        )
    )
    ids.update(
        s.scalars(
            select(Measurement.candidate_id).where(
                Measurement.campaign_id == cid, Measurement.candidate_id.is_not(None)
            )
        )
    )
    frontier: dict[int, str | None] = {}
    for chunk in _chunked(sorted(ids)):
        stmt = select(Candidate.id, Candidate.parent_digest).where(Candidate.id.in_(chunk))
        frontier.update((int(i), p) for i, p in s.execute(stmt))
    for chunk in _chunked(sorted(seeds)):
        stmt = select(Candidate.id, Candidate.parent_digest).where(
            Candidate.campaign_id == cid, Candidate.digest.in_(chunk)
        )
        frontier.update((int(i), p) for i, p in s.execute(stmt))
    kept: set[int] = set()
    parents: dict[int, int] = {}
    # Walk lineage one generation per round: each round looks up the parents not seen yet.
    while frontier:
        kept.update(frontier)
        wanted: dict[str, list[int]] = {}
        for child, parent in frontier.items():
            if parent is not None:
                wanted.setdefault(parent, []).append(child)
        frontier = {}
        for chunk in _chunked(sorted(wanted)):
            rows = s.execute(
                select(Candidate.id, Candidate.digest, Candidate.parent_digest).where(
                    Candidate.campaign_id == cid, Candidate.digest.in_(chunk)
                )
            )
            for pid, digest, grandparent in rows:
                for child in wanted[digest]:
                    parents[child] = int(pid)
                if pid not in kept:
                    frontier[int(pid)] = grandparent
    return kept, parents


def _id_chunks(read: Scope, cid: int, horizon: int) -> Iterator[list[tuple[int, str]]]:
    last = 0
    while True:
        with read("listing candidates to compact") as s:
            chunk = [
                (int(i), str(kind))
                for i, kind in s.execute(
                    select(Candidate.id, Candidate.plan_kind)
                    .where(
                        Candidate.campaign_id == cid, Candidate.id > last, Candidate.id <= horizon
                    )
                    .order_by(Candidate.id)
                    .limit(_CHUNK)
                )
            ]
        if not chunk:
            return
        last = chunk[-1][0]
        yield chunk


# ---------------------------------------------------------------------- intervals


def _bucket(when: datetime, seconds: float) -> datetime:
    epoch = when.astimezone(UTC).timestamp()
    return datetime.fromtimestamp(math.floor(epoch / seconds) * seconds, UTC)


def _aggregate_and_delete(s: Session, cid: int, ids: list[int], seconds: float) -> int:
    """Fold the evaluations of candidates ``ids`` into interval buckets, then delete both."""
    columns = [getattr(Evaluation, c) for c in OBJECTIVE_COLUMNS]
    buckets: dict[datetime, dict[str, Any]] = {}
    count = 0
    for chunk in _chunked(ids):
        stmt = select(
            Evaluation.evaluated_at, Evaluation.seq, Evaluation.feasible,
            Evaluation.eval_seconds, *columns,
        ).where(Evaluation.candidate_id.in_(chunk))
        for row in s.execute(stmt):
            count += 1
            b = buckets.setdefault(_bucket(row.evaluated_at, seconds), _empty_bucket())
            b["evaluations"] += 1
            b["min_seq"] = min(b["min_seq"], row.seq)
            b["max_seq"] = max(b["max_seq"], row.seq)
            b["eval_seconds"] += row.eval_seconds or 0.0
            if row.feasible:
                b["feasible"] += 1
                for c in OBJECTIVE_COLUMNS:
                    key, value = f"min_{c}", getattr(row, c)
                    b[key] = value if b[key] is None else min(b[key], value)
    for start, b in buckets.items():
        existing = s.scalar(
            select(EvaluationInterval).where(
                EvaluationInterval.campaign_id == cid, EvaluationInterval.bucket_start == start
            )
        )
        if existing is None:
            s.execute(
                insert(EvaluationInterval),
                [{**b, "campaign_id": cid, "bucket_start": start, "bucket_seconds": seconds}],
            )
            continue
        existing.evaluations += b["evaluations"]
        existing.feasible += b["feasible"]
        existing.min_seq = min(existing.min_seq, b["min_seq"])
        existing.max_seq = max(existing.max_seq, b["max_seq"])
        existing.eval_seconds += b["eval_seconds"]
        for c in OBJECTIVE_COLUMNS:
            key = f"min_{c}"
            old, new = getattr(existing, key), b[key]
            setattr(existing, key, new if old is None else old if new is None else min(old, new))
    s.flush()
    for chunk in _chunked(ids):
        s.execute(delete(Evaluation).where(Evaluation.candidate_id.in_(chunk)))
        s.execute(delete(Candidate).where(Candidate.id.in_(chunk)))
    return count


def _empty_bucket() -> dict[str, Any]:
    return {
        "evaluations": 0,
        "feasible": 0,
        "min_seq": math.inf,
        "max_seq": -math.inf,
        "eval_seconds": 0.0,
        **{f"min_{c}": None for c in OBJECTIVE_COLUMNS},
    }


# ---------------------------------------------------------------------- deltas


def _encode_deltas(
    write: Scope,
    read: Scope,
    cid: int,
    plan_ids: set[int],
    parents: dict[int, int],
    policy: RetentionPolicy,
    replay: Replay,
    report: CompactionReport,
    step: Callable[[], None],
) -> None:
    """Store plan-set candidates as rewrites of their (plan-set) parents where that is smaller."""
    info: dict[int, tuple[str, str, str | None]] = {}  # id -> (digest, kind, rewrite)
    with read("reading the plan set") as s:
        for chunk in _chunked(sorted(plan_ids)):
            rows = s.execute(
                select(
                    Candidate.id, Candidate.digest, Candidate.plan_kind, Candidate.rewrite
                ).where(Candidate.id.in_(chunk))
            )
            info.update({int(i): (d, k, r) for i, d, k, r in rows})
    depth: dict[int, int] = {}
    texts: OrderedDict[int, str] = OrderedDict()  # recently built plans (parents come first)

    def plan_of(s: Session, cand: int) -> str:
        if cand in texts:
            texts.move_to_end(cand)
            return texts[cand]
        digest, kind, rewrite = info[cand]
        if kind == "full":
            blob = s.scalar(select(Candidate.graph_zlib).where(Candidate.id == cand))
            text = _decompress(blob, f"(campaign id {cid})", digest)
        else:
            text = _replay_checked(
                replay, plan_of(s, parents[cand]), rewrite or "", digest, f"(campaign id {cid})"
            )
        texts[cand] = text
        if len(texts) > 256:
            texts.popitem(last=False)
        return text

    todo = sorted(plan_ids)
    for start in range(0, len(todo), 200):
        chunk = todo[start : start + 200]
        changed = 0
        with write("storing plans as deltas") as s:
            for cand in chunk:
                digest, kind, rewrite = info[cand]
                parent = parents.get(cand)
                parent_ok = (
                    parent is not None and parent < cand and info[parent][1] in ("full", "delta")
                )
                if kind == "delta":
                    depth[cand] = depth.get(parent, 0) + 1 if parent is not None else 0
                    continue
                depth[cand] = 0
                if kind != "full" or not parent_ok or rewrite is None or rewrite.startswith(
                    "baseline:"
                ):
                    continue
                if depth.get(parent, 0) + 1 > policy.max_delta_depth:  # type: ignore[arg-type]
                    continue
                blob = s.scalar(select(Candidate.graph_zlib).where(Candidate.id == cand))
                if not blob or len(rewrite.encode("utf-8")) >= len(blob):
                    continue
                try:
                    base = plan_of(s, parent)  # type: ignore[arg-type]
                    made, made_digest = replay(base, rewrite)
                except NotReplayable:
                    report.not_replayable += 1
                    continue
                except Exception:  # noqa: BLE001 - any failure means "keep the full plan"
                    report.delta_failures += 1
                    continue
                if made_digest != digest:
                    report.delta_failures += 1
                    continue
                s.execute(
                    update(Candidate)
                    .where(Candidate.id == cand, Candidate.plan_kind == "full")
                    .values(graph_zlib=b"", plan_kind="delta")
                )
                info[cand] = (digest, "delta", rewrite)
                texts[cand] = made
                depth[cand] = depth.get(parent, 0) + 1  # type: ignore[arg-type]
                changed += 1
        report.deltas += changed
        if changed:
            step()


# ---------------------------------------------------------------------- helpers


def _replay_checked(replay: Replay, parent: str, rewrite: str, digest: str, where: str) -> str:
    try:
        text, made = replay(parent, rewrite)
    except Exception as exc:  # noqa: BLE001 - report any replay failure as corruption
        raise StorageError(
            f"candidate {digest} {where}: replaying its stored rewrite {rewrite!r} failed: {exc}"
        ) from exc
    if made != digest:
        raise StorageError(
            f"candidate {digest} {where}: replaying its stored rewrite gives plan {made}, "
            "not the stored digest; the archive is corrupt"
        )
    return text


def _decompress(blob: bytes | None, where: str, digest: str) -> str:
    try:
        return zlib.decompress(blob or b"").decode("utf-8")
    except (zlib.error, UnicodeDecodeError) as exc:
        raise StorageError(f"candidate {digest} {where} is corrupt: {exc}") from exc


def _chunked(values: list[Any], size: int = 500) -> Iterator[list[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]
