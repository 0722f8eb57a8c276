"""Verification that proves something (issue 14): a plan names the program it derives from, and
verify compares it with that program; validation refuses plans that would crash eval/verify."""

from __future__ import annotations

import json

import pytest

from ir import workloads
from ir.rewrites import parse_move, unshard
from ir.serialize import InvalidGraph, dumps, load_document, loads
from optimizer.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def files(tmp_path, capsys):
    prog, plan = tmp_path / "prog.json", tmp_path / "plan.json"
    assert _run(capsys, "graph", "build", "mlp", "-o", str(prog), "--set", "batch=8",
                "--set", "widths=[16,32,8]")[0] == 0
    assert _run(capsys, "graph", "rewrite", str(prog), "split{op=fc1,dim=n,parts=2}",
                "place{op=fc1,devices=[0,1]}", "-o", str(plan))[0] == 0
    return prog, plan


def _edit(src, dst, fn):
    d = json.loads(src.read_text())
    fn(d)
    dst.write_text(json.dumps(d))
    return dst


def test_plans_carry_their_program(files):
    prog, plan = files
    g, prov = load_document(plan)
    p0, _ = load_document(prog)
    assert prov.program_digest == unshard(p0).digest and prov.program.digest == prov.program_digest
    assert g.digest != prov.program_digest  # the plan is sharded, the program is not


def test_edited_plans_fail_verify(files, tmp_path, capsys):
    _, plan = files
    assert _run(capsys, "verify", str(plan))[0] == 0
    gelu = _edit(plan, tmp_path / "gelu.json", lambda d: [o.update(kernel="gelu") for o in d["ops"]
                                                          if o["kernel"] == "relu"])

    def drop_activation(d):
        a = next(o for o in d["ops"] if o["kernel"] == "relu")
        d["ops"].remove(a)
        for o in d["ops"]:
            for k, v in o["inputs"].items():
                if v == a["output"]:
                    o["inputs"][k] = a["inputs"]["x"]
        d["tensors"] = [t for t in d["tensors"] if t["name"] != a["output"]]

    dropped = _edit(plan, tmp_path / "dropped.json", drop_activation)
    for bad in (gelu, dropped):
        code, out, _ = _run(capsys, "verify", str(bad))
        assert code == 1 and "FAIL" in out and "embedded program" in out


def test_a_plan_whose_program_cannot_be_found_is_not_passed(files, tmp_path, capsys):
    prog, plan = files
    named = _edit(plan, tmp_path / "named.json", lambda d: d.pop("program"))
    bare = _edit(plan, tmp_path / "bare.json", lambda d: (d.pop("program"), d.pop("program_digest")))
    code, _, err = _run(capsys, "verify", str(named))
    assert code == 2 and "neither embedded" in err
    code, _, err = _run(capsys, "verify", str(bare))
    assert code == 2 and "does not say which program" in err
    assert _run(capsys, "verify", str(named), "--reference", str(prog))[0] == 0
    assert _run(capsys, "verify", str(bare), "--reference", str(prog))[0] == 0
    code, out, _ = _run(capsys, "verify", str(bare), "--self-check")
    assert code == 0 and "the sharding, not the program" in out
    other = tmp_path / "other.json"
    assert _run(capsys, "graph", "build", "mlp", "-o", str(other), "--set", "batch=4",
                "--set", "widths=[16,32,8]")[0] == 0
    code, _, err = _run(capsys, "verify", str(named), "--reference", str(other))
    assert code == 2 and "derives from program" in err


def test_editing_the_embedded_program_is_detected(files, tmp_path, capsys):
    _, plan = files
    both = _edit(plan, tmp_path / "both.json", lambda d: [o.update(kernel="gelu") for o in
                                                          d["ops"] + d["program"]["ops"] if o["kernel"] == "relu"])
    code, _, err = _run(capsys, "verify", str(both))
    assert code == 2 and "the file was edited" in err


def test_validate_refuses_what_crashed_eval_and_verify():
    g = parse_move("fuse{producer=fc1,consumer=act1}").apply(workloads.mlp(batch=8, widths=(16, 32, 8)))
    doc = json.loads(dumps(g))
    fused = next(o for o in doc["ops"] if o["kernel"] == "fused")
    fused["params"]["stages"].append({**fused["params"]["stages"][-1], "op": "extra", "via": fused["output"]})
    with pytest.raises(InvalidGraph, match="fused-stage"):
        loads(json.dumps(doc))
    doc = json.loads(dumps(g))
    sh = doc["ops"][-1]["shards"]
    sh["lo"].append(list(sh["hi"][0]))
    sh["hi"].append(list(sh["hi"][0]))
    sh["device"].append(0)
    with pytest.raises(InvalidGraph, match="empty-shard"):
        loads(json.dumps(doc))
    doc = json.loads(dumps(g))
    doc["ops"][0]["shards"]["device"] = [9]
    loads(json.dumps(doc))  # fine without a hardware
    with pytest.raises(InvalidGraph, match="the hardware has 8 devices"):
        loads(json.dumps(doc), n_devices=8)


def test_dot_labels_break_lines_instead_of_printing_backslash_n():
    import shutil

    from ir.dot import render_svg, to_dot

    g = parse_move("split{op=fc1,dim=n,parts=2}").apply(workloads.mlp(batch=8, widths=(16, 32, 8)))
    dot = to_dot(g)
    assert '"x\\nfloat32[8, 16]"' in dot and "\\\\n" not in dot  # DOT's line break, not an escaped backslash
    if shutil.which("dot"):
        svg = render_svg(dot)
        assert ">x</text>" in svg and ">float32[8, 16]</text>" in svg and "\\n" not in svg


def test_dot_that_takes_too_long_is_a_render_error():
    import shutil

    from ir.dot import RenderError, render_svg, to_dot

    if not shutil.which("dot"):
        pytest.skip("Graphviz's dot is not installed")
    g = workloads.build("llama", layers=6, d_model=32, heads=4, d_ff=64, vocab=64, seq=8, batch=4, mode="train")
    with pytest.raises(RenderError, match="more than"):
        render_svg(to_dot(g), timeout=0.01)  # laying out 600 ops takes longer than that


def test_plans_in_words():
    from optimizer.campaign.export import plan_in_words
    from optimizer.search.baselines import data_parallel

    g = workloads.mlp(batch=64, widths=(256, 1024, 256))
    assert plan_in_words(g) == "single device"
    p = parse_move("fuse{producer=fc1,consumer=act1}").apply(data_parallel(g, 8))
    assert plan_in_words(p) == "data parallel 8 + fused fc1·act1 on 8 devices"
    tp = parse_move("split_reduction{op=fc2,parts=4}").apply(parse_move("split{op=fc1,dim=o,parts=4}").apply(g))
    assert "fc1 split o×4" in plan_in_words(tp) and "fc2 reduction split 4" in plan_in_words(tp)
