"""``tapestry archive compact``: apply the retention policy to an existing archive."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from optimizer.cli.common import console
from optimizer.cli.errors import UserError

DB_HELP = "archive URL: a SQLite file path (default tapestry.db or $TAPESTRY_DB) or postgresql+psycopg://..."

archive_app = typer.Typer(help="Maintain a campaign archive (retention).", no_args_is_help=True)


@archive_app.command("compact")
def compact_cmd(
    campaign: Annotated[str, typer.Argument(help="campaign name")],
    db: Annotated[Optional[str], typer.Option(help=DB_HELP)] = None,
    history: Annotated[Optional[str], typer.Option(
        help="what stays of plans the policy does not keep: 'intervals' (rows folded into per-interval "
             "counts) or 'objectives' (rows kept without plans); default: the campaign's retention.history")] = None,
    grace_seconds: Annotated[Optional[float], typer.Option(
        help="leave candidates younger than this alone (default: the campaign's retention.grace_seconds)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Thin a campaign's archive by its retention policy: plans kept for the front, its lineage,
    baselines, sampled and checkpointed plans (as deltas where smaller); the rest kept as
    objectives or per-interval counts. Refuses while the campaign's driver runs; safe to
    interrupt (run it again to finish)."""
    from optimizer.campaign.config import ConfigError, RetentionConfig
    from optimizer.campaign.lifecycle import check_not_running, existing_archive
    from optimizer.campaign.plans import replay_rewrite
    from optimizer.campaign.retention import policy_of
    from storage import Archive

    if history is not None and history not in ("intervals", "objectives"):
        raise UserError(f"--history {history!r} is not one of intervals, objectives")
    if grace_seconds is not None and not grace_seconds >= 0:
        raise UserError(f"--grace-seconds must be a number >= 0, got {grace_seconds!r}")
    with Archive.open(existing_archive(db)) as archive:  # never creates an archive
        row = archive.get_campaign(campaign)
        ckpt = archive.latest_checkpoint(campaign)
        try:  # the campaign code's driver liveness: its pid on this host, else its heartbeat
            check_not_running(row, ckpt and ckpt["created_at"])
        except ConfigError as e:
            raise UserError(f"cannot compact campaign {campaign!r} while its driver runs; a running driver "
                            f"compacts its own archive every retention.every_seconds. {e}") from None
        stored = (row["config"].get("config") or {}).get("retention") or {}
        retention = RetentionConfig.model_validate(stored)
        overrides = {k: v for k, v in (("history", history), ("grace_seconds", grace_seconds)) if v is not None}
        policy = policy_of(retention.model_copy(update=overrides))
        before = archive.storage_stats(campaign)
        report = archive.compact(campaign, policy, replay=replay_rewrite)
        after = archive.storage_stats(campaign)
    report.update(bytes_before=before["bytes"], bytes_after=after["bytes"], rows_before=before["rows"],
                  rows_after=after["rows"])
    if json_out:
        print(json.dumps(report, indent=1, default=str))
        return
    rb, ra = before["rows"], after["rows"]
    console.print(
        f"campaign {campaign}: kept plans of {report['plan_set']} candidates ({report['deltas']} newly stored as "
        f"deltas), rows of {report['row_set']}; dropped {report['dropped_plans']} plans; folded "
        f"{report['aggregated_evaluations']} evaluations of {report['deleted_candidates']} candidates into "
        f"intervals; candidates {rb['candidates']} -> {ra['candidates']}, evaluations {rb['evaluations']} -> "
        f"{ra['evaluations']} ({report['seconds']:.1f} s). Freed space is reused by new rows.")
