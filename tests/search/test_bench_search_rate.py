"""``scripts/bench_search_rate.py``: a short run reports the search's evaluations; a bad case name
is refused with exit status 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_search_rate.py"


def _main():
    spec = importlib.util.spec_from_file_location("bench_search_rate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_a_short_run_counts_evaluations(tmp_path, capsys):
    out = tmp_path / "rate.json"
    main = _main()
    # a first run loads the compiled kernels (about a second on a slow core, more than a short budget)
    assert main(["--budget", "0.2", "--cases", "mlp-8"]) == 0
    assert main(["--budget", "1.0", "--cases", "mlp-8", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (r,) = doc["results"]
    assert doc["reference_ms"] > 0 and "core" in doc["machine"]
    assert r["case"] == "mlp-8" and r["ops"] == 3 and r["evaluations"] > 1
    assert r["eval_per_s"] == r["evaluations"] / r["seconds"] and r["best_ms"] > 0
    assert "mlp-8" in capsys.readouterr().out


def test_an_unknown_case_is_refused(capsys):
    assert _main()(["--cases", "mlp-8,nope"]) == 2
    assert "nope" in capsys.readouterr().err
