"""``scripts/bench_fidelity.py``'s command line. ``--records`` / ``--replay``: a run's
measurements scored again offline (a GPU's, with later code) give the run's own figures when
nothing changed, and the recorded plans' shard work stands in for plans this code no longer
draws. Bad input is refused with one line."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_fidelity.py"


def _run(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return e.value.code


def test_replay_gives_the_runs_own_figures(tmp_path, monkeypatch, capsys):
    live, rec, rep, bad, rep2 = (tmp_path / n for n in ("live.json", "rec.json", "rep.json", "bad.json", "rep2.json"))
    assert _run(monkeypatch, "--quick", "--plans", "6", "--rounds", "1", "--repeats", "1", "--cal-plans", "1",
                "--every", "2", "--json", str(live), "--records", str(rec)) == 0
    assert _run(monkeypatch, "--replay", str(rec), "--every", "2", "--json", str(rep)) == 0
    a, b = json.loads(live.read_text()), json.loads(rep.read_text())
    assert b["replayed"] == str(rec) and a["replayed"] is None
    assert a["rows"] == b["rows"] and a["models"] == b["models"]
    assert a["offline_calibration"] == b["offline_calibration"]
    # plans this code would not draw: predicted from their recorded shards, the same serial model
    doc = json.loads(rec.read_text())
    doc["test"][0]["digest"] = "0" * 64
    bad.write_text(json.dumps(doc))
    capsys.readouterr()
    assert _run(monkeypatch, "--replay", str(bad), "--every", "2", "--json", str(rep2)) == 0
    assert "differ from the recorded ones" in capsys.readouterr().err
    c = json.loads(rep2.read_text())
    assert "calibrated + transfers" not in c["models"] and c["residuals"] == []
    for ra, rc in zip(a["rows"], c["rows"]):
        for key in ("measured_s", "online_s"):
            assert rc[key] == ra[key]
        for key in ("calibrated_s", "preset_s"):
            assert rc[key] == pytest.approx(ra[key], rel=1e-9)


def test_replay_of_a_file_that_is_no_records_is_refused(tmp_path, monkeypatch, capsys):
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"bench": "fidelity"}))
    assert _run(monkeypatch, "--replay", str(junk)) == 2
    err = capsys.readouterr().err
    assert "--replay" in err and "not the records of a run" in err and "Traceback" not in err
    assert _run(monkeypatch, "--replay", str(tmp_path / "missing.json")) == 2


def test_an_unknown_hardware_is_refused(monkeypatch, capsys):
    """A typo in ``--hardware`` is one clear line and exit status 2, before anything is timed."""
    assert _run(monkeypatch, "--hardware", "h100-sxm-9", "--quick") == 2
    err = capsys.readouterr().err
    assert "--hardware 'h100-sxm-9'" in err and "known presets" in err and "Traceback" not in err
