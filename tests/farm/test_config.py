"""Bad campaign configs are refused with a clear error naming the field, exit 2, archive unchanged."""

from __future__ import annotations

import pytest
import yaml

from optimizer.campaign.config import ConfigError, load_config, parse_config
from tests.farm.conftest import cli, small_config, write_config


def test_valid_config_parses(db):
    cfg = parse_config(small_config("ok", db))
    assert cfg.search.islands == 2 and cfg.objectives == ["makespan", "peak_memory"]
    assert cfg.identity_hash() == parse_config(small_config("ok", db, budget={"evaluations": 99})).identity_hash()
    assert cfg.identity_hash() != parse_config(small_config("ok", db, hardware="h200-sxm-8")).identity_hash()


@pytest.mark.parametrize("mutate, fragment", [
    (lambda c: c.update(serach={}), "unknown key 'serach'"),
    (lambda c: c["search"].update(islnds=2), "unknown key 'search.islnds'"),
    (lambda c: c["search"].update(islands="many"), "'search.islands'"),
    (lambda c: c["budget"].update(evaluations=-5), "'budget.evaluations'"),
    (lambda c: c.update(objectives=["speed"]), "'objectives.0'"),
    (lambda c: c.update(hardware="h900-sxm-8"), "h900-sxm-8"),
    (lambda c: c["workload"].update(name="resnet"), "workload.name 'resnet' is unknown"),
    (lambda c: c["workload"]["params"].update(depth=3), "workload.params.depth"),
    (lambda c: c.update(workload={"file": "/nonexistent/plan.json"}), "does not exist"),
    (lambda c: c.pop("hardware"), "missing key 'hardware'"),
    (lambda c: c["search"].update(mutation_weights={"teleport": 1.0}), "unknown mutation operator"),
])
def test_bad_configs_name_the_field(db, mutate, fragment):
    cfg = small_config("bad", db)
    mutate(cfg)
    with pytest.raises(ConfigError) as e:
        parse_config(cfg, "test.yaml")
    assert fragment in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "broken.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


@pytest.mark.slow
def test_cli_refuses_bad_config_and_leaves_archive_unchanged(tmp_path, db):
    from storage import Archive

    with Archive.open(db) as a:
        a.create_campaign("existing", {"x": 1}, "h", ["makespan"], [1.0])
        a.add_results("existing", [{"digest": "a" * 64, "graph_json": "{}", "objectives": {
            "makespan": 1.0, "energy": 1.0, "peak_memory": 1.0, "devices": 1, "bytes_moved": 0.0},
            "feasible": True, "seq": 1}])
    before = cli("sql", "SELECT name, status, counters_json FROM campaigns", "--db", db, "--format", "json",
                 check=True).stdout
    bad = small_config("bad", db)
    bad["search"]["stratgy"] = "native"
    res = cli("run", str(write_config(tmp_path, bad)), "--db", db)
    assert res.returncode == 2
    assert "unknown key 'search.stratgy'" in " ".join(res.stderr.split()) and "Traceback" not in res.stderr
    # a campaign name that exists is refused too, without touching it
    dup = small_config("existing", db)
    res = cli("run", str(write_config(tmp_path, dup)), "--db", db)
    assert res.returncode == 2 and "already exists" in " ".join(res.stderr.split()) and "Traceback" not in res.stderr
    after = cli("sql", "SELECT name, status, counters_json FROM campaigns", "--db", db, "--format", "json",
                check=True).stdout
    assert before == after
    n = cli("sql", "SELECT count(*) AS n FROM evaluations", "--db", db, "--format", "csv", check=True).stdout
    assert n.split()[-1] == "1"


@pytest.mark.slow
def test_cli_unknown_campaign_and_sql_writes(db):
    from storage import Archive

    with Archive.open(db) as a:
        a.create_campaign("c1", {"x": 1}, "h", ["makespan"], [1.0])
    for args in (("status", "ghost"), ("resume", "ghost"), ("export", "ghost", "--out", "/tmp/ghost-out")):
        res = cli(*args, "--db", db)
        assert res.returncode == 2, args
        assert "ghost" in res.stderr and "Traceback" not in res.stderr
    for stmt in ("DELETE FROM campaigns", "UPDATE campaigns SET status='x'", "DROP TABLE campaigns",
                 "INSERT INTO campaigns (name) VALUES ('y')", "SELECT 1; DELETE FROM campaigns"):
        res = cli("sql", stmt, "--db", db)
        assert res.returncode == 2 and "Traceback" not in res.stderr, stmt
    out = cli("sql", "SELECT name, status FROM campaigns", "--db", db, "--format", "csv", check=True).stdout
    assert "c1" in out and "x" not in out.split("\n", 1)[1]
