"""The ``tapestry`` command line. Commands import numba, Dask and CuPy lazily."""

from __future__ import annotations

import sys
from typing import Callable

import typer


try:  # typer >= 0.22 vendors click; older versions use the click package
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

from optimizer.cli import archive_cmds, campaign_cmds, eval_cmd, experts_cmd, gpu_cmds, graph_cmds, import_cmds
from optimizer.cli.errors import print_error, user_error_types

#: every ``tapestry`` command (in the order ``--help`` lists them); a new command is one row here
COMMANDS: dict[str, Callable[..., None]] = {
    "verify": graph_cmds.verify_cmd,
    "eval": eval_cmd.eval_cmd,
    "experts": experts_cmd.experts_cmd,
    "run": campaign_cmds.run_cmd,
    "resume": campaign_cmds.resume_cmd,
    "status": campaign_cmds.status_cmd,
    "export": campaign_cmds.export_cmd,
    "sql": campaign_cmds.sql_cmd,
    "calibrate": gpu_cmds.calibrate_cmd,
    "execute": gpu_cmds.execute_cmd,
    "import": import_cmds.import_cmd,
    "codegen": import_cmds.codegen_cmd,
}
#: command groups (``tapestry graph build|rewrite|show|validate|render``)
GROUPS: dict[str, typer.Typer] = {"archive": archive_cmds.archive_app, "graph": graph_cmds.graph_app}

app = typer.Typer(help="Tapestry farm: search sharding, fusion and placement plans for tensor programs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
for _name, _group in GROUPS.items():
    app.add_typer(_group, name=_name)
for _name, _fn in COMMANDS.items():
    app.command(_name)(_fn)


def main(argv: list[str] | None = None) -> None:
    """Entry point: bad input → one paragraph on stderr and exit status 2, never a traceback."""
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="tapestry")
    except ClickException as e:
        e.show()
        sys.exit(2 if e.exit_code in (1, 2) else e.exit_code)
    except (typer.Abort, KeyboardInterrupt):  # Ctrl-C: a campaign's driver leaves it paused (resume goes on)
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, user_error_types()):
            print_error(e)
            sys.exit(2)
        raise
    sys.exit(rv if isinstance(rv, int) else 0)
