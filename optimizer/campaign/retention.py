"""Campaign-side retention: the config's ``retention`` section, applied while the driver runs
and by ``tapestry archive compact``.

What is kept and why compaction is crash-safe is the archive's contract
(:mod:`storage.retention`); this module builds the policy from the config, supplies the replay
function for deltas (:mod:`optimizer.campaign.plans`), and decides when the driver compacts:
every ``retention.every_seconds``, right after a checkpoint, so the strategy's populations are
named by the newest checkpoint and kept.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from optimizer.campaign.plans import replay_rewrite
from storage import RetentionPolicy

__all__ = ["Compactor", "policy_of"]

log = logging.getLogger("tapestry.retention")


def policy_of(retention: Any) -> RetentionPolicy:
    """The storage policy for a config's ``retention`` section (a ``RetentionConfig``)."""
    return RetentionPolicy(
        history=retention.history,
        interval_seconds=float(retention.interval_seconds),
        grace_seconds=float(retention.grace_seconds),
        deltas=bool(retention.deltas),
        max_delta_depth=int(retention.max_delta_depth),
    )


class Compactor:
    """Runs the retention policy from the driver loop, at most every ``every_seconds``.

    ``due()`` says whether it is time; ``run(archive, campaign, keep)`` compacts (the caller
    checkpoints first) and keeps the last report and the total time spent for ``status``.
    """

    def __init__(self, retention: Any) -> None:
        self.enabled = bool(retention.enabled)
        self.every = float(retention.every_seconds)
        self.policy = policy_of(retention)
        self._last = time.monotonic()
        self.last_report: dict[str, Any] | None = None
        self.seconds = 0.0
        self.runs = 0

    def due(self) -> bool:
        return self.enabled and time.monotonic() - self._last >= self.every

    def run(self, archive: Any, campaign: str, keep: list[str]) -> dict[str, Any]:
        """Compact now; ``keep``: digests the driver still holds (front, populations)."""
        report = archive.compact(campaign, self.policy, replay=replay_rewrite, keep=keep)
        self._last = time.monotonic()
        self.last_report = report
        self.seconds += report["seconds"]
        self.runs += 1
        log.info("compacted %s: %s", campaign, report)
        return report

    def counters(self) -> dict[str, Any]:
        """What the driver stores in its counters (``status`` shows it)."""
        last = self.last_report or {}
        return {"runs": self.runs, "seconds": round(self.seconds, 3),
                "last": {k: last.get(k) for k in ("plan_set", "row_set", "deleted_candidates",
                                                   "aggregated_evaluations", "dropped_plans", "deltas")}}
