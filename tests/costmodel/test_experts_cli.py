"""``tapestry experts``: a program's expert plans on several fleets, side by side."""

from __future__ import annotations

import json

import pytest

from costmodel import Evaluator
from ir import workloads
from ir.serialize import load_document, save
from optimizer.cli import main
from optimizer.search.baselines import baselines


@pytest.fixture(scope="module")
def step():
    return workloads.build("llama", layers=2, d_model=64, heads=4, d_ff=128, vocab=128, seq=32, batch=8,
                           mode="train", experts=4, top_k=2)


def run(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    out, err = capsys.readouterr()
    return ei.value.code, out, err


def test_two_fleets_side_by_side_as_the_evaluator_prices_them(step, tmp_path, capsys):
    p = tmp_path / "step.json"
    save(step, p)
    code, out, err = run(["experts", str(p), "--hardware", "a100-sxm-8,b200-8", "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)
    assert [r["hardware"] for r in rows] == ["a100-sxm-8"] * 9 + ["b200-8"] * 9
    plans = baselines(step, 8, 8)
    names = set(plans)
    for fleet in ("a100-sxm-8", "b200-8"):
        mine = [r for r in rows if r["hardware"] == fleet]
        assert {r["expert"] for r in mine} == names and "dp1-ep8" in names
        assert [r["makespan"] for r in mine] == sorted(r["makespan"] for r in mine)  # all fit: fastest first
        r = mine[0]  # a row is the evaluator's price of that expert on that fleet
        assert r["makespan"] == Evaluator(fleet)(plans[r["expert"]]).makespan
    by = {(r["hardware"], r["expert"]): r for r in rows}
    for name in names - {"single-device"}:  # B200 (2,250 TFLOP/s, NVLink 5) against A100 (312, NVLink 3)
        assert by["b200-8", name]["makespan"] < by["a100-sxm-8", name]["makespan"], name
    # the table: the fastest plan that fits on each fleet is starred
    from optimizer.cli.experts_cmd import print_experts

    print_experts(rows)
    out = capsys.readouterr().out
    assert out.count("★ ") == 2 and f"★ {rows[0]['expert']}" in out and f"★ {rows[9]['expert']}" in out


def test_fleets_repeat_or_comma_separate(step, tmp_path, capsys, monkeypatch):
    import optimizer.cli.experts_cmd as cmd

    seen = []
    monkeypatch.setattr(cmd, "experts_report", lambda plan, hw, layers, out: seen.append(hw) or [])
    monkeypatch.setattr(cmd, "print_experts", lambda rows: None)
    code, _, err = run(["experts", "x.json", "-H", "a100-sxm-8, b200-8", "-H", "h100-sxm-8"], capsys)
    assert code == 0, err
    assert seen == [["a100-sxm-8", "b200-8", "h100-sxm-8"]]


def test_written_plans_name_the_program_and_verify(step, tmp_path, capsys):
    from executor import verify

    p = tmp_path / "step.json"
    save(step, p)
    code, out, err = run(["experts", str(p), "--hardware", "h100-sxm-8", "--out", str(tmp_path / "plans")], capsys)
    assert code == 0, err
    files = sorted((tmp_path / "plans" / "h100-sxm-8").glob("*.json"))
    assert {f.stem for f in files} == set(baselines(step, 8, 8))
    g, prov = load_document(tmp_path / "plans" / "h100-sxm-8" / "dp1-ep8.json")
    assert prov.program_digest == step.digest and prov.program.digest == step.digest
    assert verify(g, reference=prov.program).ok
    code, _, err = run(["verify", str(tmp_path / "plans" / "h100-sxm-8" / "megatron-tp8-dp1.json")], capsys)
    assert code == 0, err


def test_an_unknown_fleet_is_refused_before_any_work(step, tmp_path, capsys):
    p = tmp_path / "step.json"
    save(step, p)
    code, out, err = run(["experts", str(p), "--hardware", "h100-sxm-8,b300-8", "--out", str(tmp_path / "o")],
                         capsys)
    assert code == 2 and "unknown hardware preset 'b300-8'" in err and "b200-8" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
