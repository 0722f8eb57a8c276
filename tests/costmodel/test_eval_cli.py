"""``tapestry eval``: tables, JSON, and clear exit-2 errors for bad presets, files and plans."""

from __future__ import annotations

import json

import pytest

from costmodel import evaluate
from costmodel.presets import PRESETS
from ir import workloads
from ir.rewrites import retile
from ir.serialize import save
from optimizer.cli import main


@pytest.fixture
def plan(tmp_path):
    g = workloads.build("mlp", batch=64, widths=[256, 1024, 256])
    g = retile(g, "fc1", [1, 4], [0, 1, 2, 3])
    p = tmp_path / "plan.json"
    save(g, p)
    return p, g


def run(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    out, err = capsys.readouterr()
    return ei.value.code, out, err


def test_eval_prints_tables(plan, capsys):
    p, g = plan
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8"], capsys)
    assert code == 0, err
    for word in ("makespan", "lower bound", "gap", "energy", "peak memory", "feasible", "bytes moved",
                 "per operation", "fc1", "act1", "fc2", "per device"):
        assert word in out
    assert "Traceback" not in out + err


def test_eval_json_matches_evaluate(plan, capsys):
    p, g = plan
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8", "--json"], capsys)
    assert code == 0, err
    r = json.loads(out)
    e = evaluate(g, PRESETS["h100-sxm-8"])
    assert r["makespan"] == e.makespan and r["energy"] == e.energy and r["lower_bound"] == e.lower_bound
    assert r["gap"] == e.gap and r["feasible"] is True and r["devices"] == 4
    assert [o["op"] for o in r["breakdown"]["ops"]] == ["fc1", "act1", "fc2"]
    assert r["breakdown"]["ops"][0]["shards"] == 4 and len(r["breakdown"]["devices"]) == 8


def test_eval_hardware_yaml_file(plan, capsys, tmp_path):
    p, g = plan
    hw = tmp_path / "hw.yaml"
    hw.write_text("base: h100-sxm-8\nname: slow\nefficiency:\n  matmul: {compute: 0.5, memory: 0.5}\n")
    code, out, err = run(["eval", str(p), "--hardware", str(hw), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["hardware"] == "slow"
    assert json.loads(out)["makespan"] > evaluate(g, "h100-sxm-8", curves=None).makespan  # flat factors 1 vs 0.5


@pytest.mark.parametrize("case", ["preset", "yaml", "field", "missing-yaml", "plan", "plan-json", "no-plan",
                                  "device"])
def test_errors_exit_2_without_traceback(case, plan, capsys, tmp_path):
    p, g = plan
    hw = "h100-sxm-8"
    if case == "preset":
        hw, want = "h100-sxm-9", "known presets"
    elif case == "yaml":
        (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
        hw, want = str(tmp_path / "bad.yaml"), "not valid YAML"
    elif case == "field":
        (tmp_path / "bad.yaml").write_text("base: h100-sxm-8\nefficency: {}\n")
        hw, want = str(tmp_path / "bad.yaml"), "efficency"
    elif case == "missing-yaml":
        hw, want = str(tmp_path / "nope.yaml"), "not found"
    elif case == "plan":
        doc = json.loads(p.read_text())
        doc["ops"][0]["shards"]["hi"][0][0] = 63  # shards no longer cover the index space
        p.write_text(json.dumps(doc))
        want = "not a valid plan"
    elif case == "plan-json":
        p.write_text("{not json")
        want = "bad-json"
    elif case == "no-plan":
        p, want = tmp_path / "missing.json", "does not exist"
    elif case == "device":
        save(retile(g, "fc2", [2, 1], [0, 9]), p)
        hw, want = "h100-sxm-8", "device 9"
    code, out, err = run(["eval", str(p), "--hardware", hw], capsys)
    assert code == 2
    assert want in " ".join(err.split()), err  # the message is wrapped at 100 columns
    assert "Traceback" not in err and err.startswith("error:")


def test_eval_of_a_training_step_reports_mfu_and_the_memory_floor(tmp_path, capsys):
    g = workloads.build("mlp", batch=64, widths=[256, 1024, 256], mode="train", optimizer="sgd")
    p = tmp_path / "step.json"
    save(g, p)
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8"], capsys)
    assert code == 0, err
    assert "model FLOPs per step" in out and "MFU" in out and "memory floor" in out
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8", "--json"], capsys)
    r = json.loads(out)
    e = evaluate(g, "h100-sxm-8")
    assert r["model_flops"] == e.model_flops > 0 and r["mfu"] == pytest.approx(e.mfu) and 0 < r["mfu"] < 1
    assert r["memory_floor"] == pytest.approx(4.0 * (256 * 1024 + 1024 + 1024 * 256 + 256) / 8)


def test_eval_explain_and_gantt(tmp_path, capsys):
    from ir.mesh import Mesh
    from ir.rewrites import unshard
    from ir.rewrites.layout import layout

    g = workloads.build("mlp", batch=64, widths=[256, 1024, 256], mode="train", optimizer="sgd")
    p = tmp_path / "dp.json"
    save(layout(unshard(g), "all", Mesh((8,), 8), ("b",)), p)
    pic = tmp_path / "s.svg"
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8", "--explain", "--gantt", str(pic)], capsys)
    assert code == 0, err
    for word in ("where the time goes", "critical path", "collectives", "reduce_scatter", "all_gather", "ring"):
        assert word in out
    assert pic.stat().st_size > 1000
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8", "--explain", "--json"], capsys)
    r = json.loads(out)
    assert r["explain"]["collectives"] and sum(r["explain"]["bounds"].values()) == r["ops"]
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8", "--gantt", str(tmp_path / "s.pdf")], capsys)
    assert code == 2 and "--gantt" in err and ".png or .svg" in err and "Traceback" not in err


def test_eval_layers_repeat(tmp_path, capsys):
    from optimizer.search.baselines import zero3

    g = zero3(workloads.build("llama", layers=10, d_model=64, heads=4, d_ff=128, vocab=256, seq=32, batch=8,
                              mode="train"), 8)
    p = tmp_path / "step.json"
    save(g, p)
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8", "--layers", "repeat", "--json"], capsys)
    assert code == 0, err
    r = json.loads(out)
    assert r["simulated_layers"] == [5, 6] and r["layers"] == 10
    whole = evaluate(g, "h100-sxm-8")
    assert r["makespan"] == pytest.approx(whole.makespan, rel=0.01)
    assert r["peak_memory"] == pytest.approx(whole.peak_memory, rel=0.01)
    code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8", "--layers", "repeat"], capsys)
    assert code == 0 and "extended from truncations of 5 and 6 of its 10 layers" in " ".join(out.split())
    for bad in (["--layers", "some"], ["--layers", "repeat", "--explain"]):
        code, out, err = run(["eval", str(p), "--hardware", "h100-sxm-8", *bad], capsys)
        assert code == 2 and "--layers" in err and "Traceback" not in err
