"""``tapestry graph show``: per op, which index dims are split how many ways over which mesh axis."""

from __future__ import annotations

import pytest

from ir import workloads
from ir.mesh import parse_mesh
from ir.rewrites.layout import layout
from ir.serialize import save
from optimizer.cli import main


def run(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    out, err = capsys.readouterr()
    return ei.value.code, out, err


def test_show_names_mesh_axes(tmp_path, capsys):
    g = workloads.build("transformer", batch=4, seq=8, d_model=16, heads=4, d_ff=32)
    p = tmp_path / "plan.json"
    save(layout(g, "all", parse_mesh("2x4", 4), ["b", "t"]), p)
    code, out, err = run(["graph", "show", str(p)], capsys)
    assert code in (0, None), err
    # 8 devices are one node of 8 by default: both axes lie inside it
    assert out.startswith("# mesh 2x4: g0=2 × g1=4")
    assert "# q_proj: b/2 over g0 · h/4 over g1  [8 shards" in out
    assert "# o_proj: kb(h)/4 over g1 (partial sums) · b/2 over g0" in out
    code, out, err = run(["graph", "show", str(p), "--mesh", "8"], capsys)  # no axis explains it
    assert "# q_proj: b/2 (no mesh axis) · h/4 (no mesh axis)" in out


def test_show_refuses_a_bad_mesh(tmp_path, capsys):
    p = tmp_path / "plan.json"
    save(workloads.build("mlp"), p)
    code, out, err = run(["graph", "show", str(p), "--mesh", "8by8"], capsys)
    assert code == 2
    assert "--mesh" in err + out and "8x8" in err + out and "Traceback" not in err + out


def test_show_of_an_unsharded_program(tmp_path, capsys):
    p = tmp_path / "plan.json"
    save(workloads.build("mlp", batch=64, widths=[256, 1024, 256]), p)
    code, out, err = run(["graph", "show", str(p)], capsys)
    assert code in (0, None), err
    assert "# fc1: whole on device 0" in out and "Traceback" not in out + err
