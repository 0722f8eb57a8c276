"""Lifetimes: the config of ``cluster.driver_lifetime`` and ``worker_lifetime``; past its
lifetime the driver drains its tasks, checkpoints, and the command line replaces the process with
``tapestry resume``."""

from __future__ import annotations

import json

import pytest

from optimizer.campaign.config import ConfigError, parse_config
from optimizer.cli.campaign_cmds import _options
from tests.farm.conftest import cli, popen_cli, small_config, write_config


@pytest.mark.parametrize("field,too_short", [("driver_lifetime", 1), ("worker_lifetime", 5)])
def test_lifetime_config(field: str, too_short: float) -> None:
    base = {"name": "x", "workload": {"name": "mlp"}, "hardware": "h100-sxm-8"}
    assert getattr(parse_config(base).cluster, field) == 21600.0  # on by default: 6 hours
    assert getattr(parse_config({**base, "cluster": {field: None}}).cluster, field) is None
    with pytest.raises(ConfigError, match=field):
        parse_config({**base, "cluster": {field: too_short}})
    with pytest.raises(ConfigError, match=f"cluster.{field[:-1]}"):
        parse_config({**base, "cluster": {field[:-1]: 100}})  # a typo is named, not ignored


def test_resume_options_repeat_what_was_given() -> None:
    assert _options(config=None, evaluations=None, wall_time=None, scheduler=None, workers=None, quiet=False) == []
    assert _options(config="c.yaml", evaluations=5000, wall_time=60.5, scheduler="tcp://h:8786", workers=2,
                    quiet=True) == ["--config", "c.yaml", "--evaluations", "5000", "--wall-time", "60.5",
                                    "--scheduler", "tcp://h:8786", "--workers", "2", "--quiet"]


@pytest.mark.slow
def test_campaign_pauses_at_the_driver_lifetime_and_resumes(tmp_path) -> None:
    """In-process (no exec): the run drains and pauses with the restart reason; the checkpoint
    lets ``resume`` go on to the budget."""
    from optimizer.campaign.farm import DRIVER_RESTART
    from optimizer.campaign.lifecycle import resume_campaign, run_campaign

    db = str(tmp_path / "life.db")
    cfg = parse_config(small_config("dl", db, budget={"evaluations": None, "wall_time": 60},
                                    retention={"enabled": True, "every_seconds": 3600}))
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"driver_lifetime": 10.0})})
    res = run_campaign(cfg, quiet=True)
    assert res["restart"] and res["status"] == "paused" and res["reason"] == DRIVER_RESTART
    assert res["url"] == db and res["evaluations"] > 0
    from storage import Archive

    with Archive.open(db, readonly=True) as a:
        c = a.get_campaign("dl")["counters"]
        assert c["driver_restarts"] == 1 and 10.0 <= c["wall_seconds"] < 60.0
        assert c["retention"]["runs"] == 1  # compacted on the way out (the hour had not come)
        assert a.latest_checkpoint("dl") is not None
    res2 = resume_campaign("dl", db, quiet=True)  # the stored config: 10 s again
    assert res2["restart"] and res2["evaluations"] > res["evaluations"]


@pytest.mark.slow
def test_cli_driver_replaces_itself_until_the_budget_is_spent(tmp_path) -> None:
    """``tapestry run`` with a 10-second driver lifetime and a 35-second budget: the same process
    (pid) runs the campaign, resumed at least twice, to a finished campaign with every
    evaluation's sequence number unique."""
    db = str(tmp_path / "exec.db")
    cfg = small_config("ex", db, budget={"evaluations": None, "wall_time": 35},
                       cluster={"workers": 1, "driver_lifetime": 10})
    proc = popen_cli("run", str(write_config(tmp_path, cfg)), "--db", db, "--quiet")
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("restarting the driver: tapestry resume ex --quiet") >= 2, out
    assert "finished (wall-time budget spent)" in out
    st = json.loads(cli("status", "ex", "--db", db, "--json", check=True).stdout)
    c = st["campaign"]["counters"]
    assert st["campaign"]["status"] == "finished" and c["driver_restarts"] >= 2
    assert c["driver"]["pid"] == proc.pid  # replaced in place, not a child
    assert 35.0 <= c["wall_seconds"] < 60.0  # searching time only, summed over the restarts
    seq = json.loads(cli("sql", "SELECT count(*) AS n, count(DISTINCT seq) AS d FROM evaluations", "--db", db,
                         "--format", "json", check=True).stdout)[0]
    assert seq["n"] == seq["d"] > 0


def test_a_failed_replacement_says_how_to_resume(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import os

    import typer

    from optimizer.cli.campaign_cmds import _replace_with_resume

    def refuse(*_a, **_k):
        raise OSError("exec format error")

    monkeypatch.setattr(os, "execve", refuse)
    with pytest.raises(typer.Exit) as e:
        _replace_with_resume({"campaign": "c9", "url": "x.db"}, ["--quiet"])
    assert e.value.exit_code == 1
    err = capsys.readouterr().err
    assert "could not replace itself (exec format error)" in err and "tapestry resume c9" in err
