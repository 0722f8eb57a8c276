"""``tapestry run | resume | status | export``: the campaign lifecycle."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from optimizer.cli.common import console
from optimizer.cli.errors import UserError

DB_HELP = "archive URL: a SQLite file path (default tapestry.db or $TAPESTRY_DB) or postgresql+psycopg://..."


def run_cmd(
    config: Annotated[str, typer.Argument(help="campaign YAML file, e.g. configs/quickstart.yaml")],
    db: Annotated[Optional[str], typer.Option(help=DB_HELP)] = None,
    scheduler: Annotated[Optional[str], typer.Option(help="address of an existing Dask scheduler")] = None,
    workers: Annotated[Optional[int], typer.Option(help="local Dask workers (default: one per core)")] = None,
    evaluations: Annotated[Optional[int], typer.Option(help="evaluation budget (overrides budget.evaluations)")] = None,
    wall_time: Annotated[Optional[float], typer.Option(help="wall-time budget in seconds (overrides "
                                                            "budget.wall_time)")] = None,
    stall_evaluations: Annotated[Optional[int], typer.Option(help="stop after this many evaluations without "
                                                                  "progress (overrides budget.stall_evaluations)")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress display")] = False,
) -> None:
    """Start a campaign and search until its budget is spent (Ctrl-C pauses; resume continues)."""
    from optimizer.campaign.config import load_config, with_budget
    from optimizer.campaign.lifecycle import run_campaign

    cfg = with_budget(load_config(config), evaluations=evaluations, wall_time=wall_time,
                      stall_evaluations=stall_evaluations)
    res = run_campaign(cfg, db, scheduler, workers, quiet)
    _report(res)
    if res.get("restart"):
        _replace_with_resume(res, _options(scheduler=scheduler, workers=workers, quiet=quiet))


def _options(**given: object) -> list[str]:
    """``tapestry resume`` options for the values given (None and False: left out)."""
    out: list[str] = []
    for k, v in given.items():
        if v is None or v is False:
            continue
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


def _replace_with_resume(res: dict, options: list[str]) -> None:
    """Replace this process with ``tapestry resume`` of the campaign (the driver's lifetime,
    ``cluster.driver_lifetime``): the same pid, a fresh interpreter and heap. The archive goes
    through the environment, not the command line (a PostgreSQL URL may hold a password)."""
    import os
    import sys

    argv = [sys.executable, "-m", "optimizer.cli", "resume", res["campaign"], *options]
    console.print(f"restarting the driver: tapestry resume {res['campaign']} {' '.join(options)}".rstrip())
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, {**os.environ, "TAPESTRY_DB": res["url"]})
    except OSError as e:  # the campaign is paused and checkpointed: nothing is lost
        sys.stderr.write(f"error: the driver could not replace itself ({e}); continue the campaign with "
                         f"'tapestry resume {res['campaign']}' and the same --db\n")
        raise typer.Exit(1) from None


def _report(res: dict) -> None:
    """Print the run's outcome (and notes); a failed run exits with status 1."""
    for note in res.get("notes", []):
        console.print(f"note: {note}")
    gap = f"{res['best_gap']:.2f}×" if res["best_gap"] < float("inf") else "-"
    console.print(f"campaign {res['campaign']}: {res['status']} ({res['reason']}); {res['evaluations']} evaluations, "
                  f"front {res['front']}, hypervolume {res['hypervolume']:.4g}, best gap to bound {gap}")
    if res["status"] == "failed":
        raise typer.Exit(1)


def resume_cmd(
    campaign: Annotated[str, typer.Argument(help="campaign name")],
    db: Annotated[Optional[str], typer.Option(help=DB_HELP)] = None,
    config: Annotated[Optional[str], typer.Option(help="updated config (only budget, cluster, sampling, storage may change)")] = None,
    evaluations: Annotated[Optional[int], typer.Option(help="new total evaluation budget (more than those done); "
                                                            "a spent wall-time budget is then lifted")] = None,
    wall_time: Annotated[Optional[float], typer.Option(help="new total wall-time budget in seconds (more than "
                                                            "already searched)")] = None,
    scheduler: Annotated[Optional[str], typer.Option(help="address of an existing Dask scheduler")] = None,
    workers: Annotated[Optional[int], typer.Option(help="local Dask workers")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress display")] = False,
) -> None:
    """Continue a campaign where it stopped, with the same random streams."""
    from optimizer.campaign.lifecycle import resume_campaign

    res = resume_campaign(campaign, db, config, evaluations, wall_time, scheduler, workers, quiet)
    _report(res)
    if res.get("restart"):
        _replace_with_resume(res, _options(config=config, evaluations=evaluations, wall_time=wall_time,
                                           scheduler=scheduler, workers=workers, quiet=quiet))


def status_cmd(
    campaign: Annotated[Optional[str], typer.Argument(help="campaign name (omit to list all)")] = None,
    db: Annotated[Optional[str], typer.Option(help=DB_HELP)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Progress, front, hypervolume and best gap of a campaign (or a list of all campaigns)."""
    from rich.table import Table

    from optimizer.campaign.lifecycle import campaign_status
    from optimizer.campaign.progress import fmt_bytes, fmt_seconds

    st = campaign_status(db, campaign)
    if json_out:
        print(json.dumps(st, indent=1, default=str))
        return
    if campaign is None:
        t = Table(title="campaigns")
        for col in ("name", "status", "evaluations", "updated"):
            t.add_column(col)
        for c in st["campaigns"]:
            t.add_row(c["name"], c["status"], str(c["counters"].get("evaluations", 0)), str(c["updated_at"])[:19])
        console.print(t)
        return
    row, front = st["campaign"], st["front"]
    c = row["counters"]
    budget = st["budget"]
    if row.get("driver_note") and row["status"] == "interrupted":
        console.print(f"campaign {row['name']} is interrupted: {row['driver_note']}; continue it with "
                      f"'tapestry resume {row['name']}'")
    console.print(f"campaign {row['name']}: {row['status']}; {c.get('evaluations', 0)} evaluations"
                  + (f" of {budget['evaluations']}" if budget.get("evaluations") else "")
                  + f"; {c.get('tasks_done', 0)} tasks ({c.get('tasks_failed', 0)} failed); "
                  f"{c.get('wall_seconds', 0):.0f} s searched")
    gap = f"{st['best_gap']:.2f}×" if st["best_gap"] is not None else "-"
    console.print(f"front: {len(front)} plans; hypervolume {st['hypervolume']:.4g}; best gap to lower bound {gap}")
    if st.get("progress"):
        from optimizer.campaign.history import progress_lines

        for line in progress_lines(st["progress"]):
            console.print(line)
    if st.get("sampling"):
        s = st["sampling"]
        rho = f"{s['spearman']:.3f}" if s.get("spearman") is not None else "n/a"
        console.print(f"sampled executions: {s['n']} plans, Spearman(predicted, measured) = {rho}")
    from optimizer.campaign.fidelity import status_lines

    for line in status_lines(st.get("calibration"), st.get("best_mfu") or [], st.get("hardware_name", "")):
        console.print(line, markup=False)
    t = Table()
    for col in ("digest", "makespan", "energy", "peak memory", "devices", "gap", "rewrite"):
        t.add_column(col)
    for r in sorted(front, key=lambda r: r["objectives"]["makespan"])[:20]:
        o = r["objectives"]
        t.add_row(r["digest"][:12], fmt_seconds(o["makespan"]), f"{o['energy']:.3g} J", fmt_bytes(o["peak_memory"]),
                  str(int(o["devices"])), f"{r['gap']:.2f}×" if r.get("gap") else "-", (r.get("rewrite") or "")[:40])
    console.print(t)


def export_cmd(
    campaign: Annotated[str, typer.Argument(help="campaign name")],
    out: Annotated[str, typer.Option("--out", "-o", help="output folder")],
    db: Annotated[Optional[str], typer.Option(help=DB_HELP)] = None,
    program: Annotated[bool, typer.Option("--program", help="also write each plan's generated program (.py) "
                                          "and DTensor placements")] = False,
) -> None:
    """Write the front's plans (JSON + SVG), front.parquet, pareto.png and summary.md."""
    from pathlib import Path

    from optimizer.campaign.export import export_campaign

    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out!r} is a file; export writes a folder (plans/, summary.md, ...): name a folder")
    res = export_campaign(campaign, out, db)
    console.print(f"exported {res['plans']} plans to {res['out']}")
    if program:
        from optimizer.cli.import_cmds import export_programs

        n = export_programs(campaign, out, db)
        console.print(f"wrote {n} generated programs beside the plans (run one: python PLAN.py --check)")


def sql_cmd(
    query: Annotated[str, typer.Argument(help="one read-only query: SELECT or WITH ... SELECT")],
    db: Annotated[Optional[str], typer.Option(help=DB_HELP)] = None,
    format: Annotated[str, typer.Option(help="table, csv or json")] = "table",
    limit: Annotated[int, typer.Option(help="at most this many rows (0: no limit)")] = 1000,
    timeout: Annotated[float, typer.Option(help="stop the query after this many seconds")] = 30.0,
) -> None:
    """Query the archive read-only: one SELECT, checked by a SQL parser, run in a read-only
    transaction with a time limit (writes, COPY, locks and server functions are refused and change
    nothing). On PostgreSQL, give it a read-only role (see the README)."""
    import sys

    from optimizer.campaign.lifecycle import existing_archive
    from optimizer.cli.errors import UserError
    from storage import format_rows, run_readonly_query

    if format not in ("table", "csv", "json"):
        raise UserError(f"--format {format!r} must be table, csv or json")
    if limit < 0:
        raise UserError(f"--limit must be >= 0 (0: no limit), got {limit}")
    if limit >= 2**31 - 1:  # beyond what a driver fetches in one call; no archive holds that many rows
        limit = 0
    if not 0 < timeout <= 86_400:
        raise UserError(f"--timeout must be between 0 and 86400 seconds, got {timeout}")
    cols, rows = run_readonly_query(existing_archive(db), query, limit=(limit + 1) if limit else None,
                                    timeout_s=timeout)
    cut = bool(limit) and len(rows) > limit
    print(format_rows(cols, rows[:limit] if cut else rows, format))
    if cut:
        sys.stderr.write(f"note: showing the first {limit} rows; --limit N shows more (--limit 0: all)\n")
