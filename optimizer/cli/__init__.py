"""The ``tapestry`` command line. Commands import numba, Dask and CuPy lazily."""

from __future__ import annotations

import sys

import typer


try:  # typer >= 0.22 vendors click; older versions use the click package
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

from optimizer.cli.errors import print_error, user_error_types
from optimizer.cli.graph_cmds import graph_app, verify_cmd

app = typer.Typer(help="Tapestry farm: search sharding, fusion and placement plans for tensor programs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.add_typer(graph_app, name="graph")
app.command("verify")(verify_cmd)


def _register_optional() -> None:
    """Commands whose modules exist (added by later parts of the project)."""
    import importlib

    for mod in ("optimizer.cli.eval_cmd", "optimizer.cli.campaign_cmds", "optimizer.cli.sql_cmd",
                "optimizer.cli.gpu_cmds"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        m.register(app)


_register_optional()


def main(argv: list[str] | None = None) -> None:
    """Entry point: bad input → one paragraph on stderr and exit status 2, never a traceback."""
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="tapestry")
    except ClickException as e:
        e.show()
        sys.exit(2 if e.exit_code in (1, 2) else e.exit_code)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, user_error_types()):
            print_error(e)
            sys.exit(2)
        raise
    sys.exit(rv if isinstance(rv, int) else 0)
