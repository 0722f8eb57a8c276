"""A campaign on a transformer starts from the program as written (attention unfused) and its
front holds fused-attention plans, which the exported ``summary.md`` reports."""

from __future__ import annotations

import json

import pytest

from ir.rewrites import unshard
from ir.serialize import load
from tests.farm.conftest import cli, small_config, write_config


@pytest.mark.slow  # about 30 s on an idle core: a local Dask cluster and 1000 evaluations
def test_transformer_campaign_finds_fused_attention(tmp_path, db):
    cfg = small_config("attn", db, workload={"name": "transformer", "params": {
        "batch": 8, "seq": 1024, "d_model": 1024, "heads": 16, "d_ff": 4096, "dtype": "bfloat16"}},
        budget={"evaluations": 1000})
    cli("run", str(write_config(tmp_path, cfg)), "--db", db, "--quiet", check=True)
    st = json.loads(cli("status", "attn", "--db", db, "--json", check=True).stdout)
    assert st["campaign"]["status"] == "finished"
    out = tmp_path / "export"
    cli("export", "attn", "--db", db, "--out", str(out), check=True)
    plans = [load(p) for p in sorted((out / "plans").glob("*.json"))]
    assert plans
    fused = [g for g in plans if any(o.kernel == "attention" for o in g.ops.values())]
    assert fused, "no front plan runs fused attention"
    program = unshard(fused[0])  # the program the campaign started from: attention as written
    assert "attn_softmax" in program.ops and not any(o.kernel == "attention" for o in program.ops.values())
    summary = (out / "summary.md").read_text()
    assert f"{len(fused)} of {len(plans)} front plans run fused attention" in summary
