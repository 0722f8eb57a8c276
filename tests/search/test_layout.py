"""Region layout moves: every layout keeps a plan valid and meaning-preserving (executed on small
shapes against the unsharded program), replays from its text, and gives the expected shardings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import verify
from ir import workloads
from ir.layout_describe import describe_op
from ir.mesh import parse_mesh
from ir.rewrites import RewriteError, parse_move
from ir.rewrites.layout import USES, layout, select_ops
from ir.rewrites.substitute_attention import fuse_attention
from ir.validate import validate

PROGRAMS = {
    "mlp": workloads.build("mlp", batch=8, widths=[16, 32, 16]),
    "transformer": workloads.build("transformer", batch=4, seq=8, d_model=16, heads=4, d_ff=32),
    "llama-train": workloads.build("llama", mode="train", batch=4, seq=8, layers=1, d_model=16, heads=4,
                                   vocab=32, d_ff=32),
    "transformer-fused": fuse_attention(workloads.build("transformer", batch=4, seq=8, d_model=16, heads=4,
                                                        d_ff=32), "attn_qk"),
}
MESHES = ["2", "4", "2x2", "2x4", "4x2", "2x2x2"]


@settings(max_examples=14, deadline=None)
@given(name=st.sampled_from(sorted(PROGRAMS)), mesh=st.sampled_from(MESHES), seed=st.integers(0, 2**31))
def test_layout_keeps_plans_valid_and_equal(name, mesh, seed):
    g = PROGRAMS[name]
    rng = np.random.default_rng(seed)
    m = parse_mesh(mesh, 4)
    plan = g
    for _ in range(2):  # a layout on top of another layout (and of a region of it)
        use = [USES[int(rng.integers(3))] for _ in range(m.ndim)]
        order = plan.topo_order
        region = "all" if rng.random() < 0.5 else f"{order[int(rng.integers(len(order) // 2))]}:{order[-1]}"
        text = f"layout{{ops={region},mesh={mesh},use={'.'.join(use)},node=4}}"
        try:
            child = parse_move(text).apply(plan)
        except RewriteError as e:
            assert "already laid out" in str(e)
            continue
        assert validate(child) == [], text
        assert str(parse_move(text)) == text
        plan = child
    assert verify(plan, reference=g).ok


def test_megatron_layout_splits_heads_and_reduces_the_output_projection():
    g = PROGRAMS["transformer"]
    m = parse_mesh("2x2", 2)
    p = layout(g, "all", m, ["b", "t"])
    assert describe_op(p, "q_proj", m).startswith("b/2 over n0 · h/2 over g0")
    assert describe_op(p, "o_proj", m).startswith("kb(h)/2 over g0 (partial sums) · b/2 over n0")
    assert describe_op(p, "ff1", m).startswith("n0/2 over n0 · o/2 over g0")
    assert p.ops["ff2"].params["split"] == {"reduction": "f", "parts": 2}
    assert verify(p, reference=g).ok


def test_context_parallel_layout_splits_the_sequence_and_gathers_keys():
    g = PROGRAMS["transformer"]
    m = parse_mesh("2x2", 2)
    p = layout(g, "all", m, ["b", "s"])
    assert describe_op(p, "q_proj", m).startswith("b/2 over n0 · s/2 over g0")
    # scores: query rows split, key columns whole (the keys are gathered)
    assert describe_op(p, "attn_qk", m).startswith("a/2 over n0 · m/2 over g0")
    assert not any(o.params.get("split") for o in p.ops.values())


def test_layout_over_many_devices_reduces_in_two_levels():
    g = workloads.build("mlp", batch=8, widths=[8, 64, 8])
    p = layout(g, "all", parse_mesh("2x4", 4), ["t", "t"], hierarchical=True)  # fc2 over both axes
    assert p.ops["fc2.acc"].params["split"] == {"reduction": "k", "parts": 2}  # node first
    assert "fc2.acc.acc" in p.ops
    assert verify(p, reference=g).ok
    flat = layout(g, "all", parse_mesh("2x4", 4), ["t", "t"])
    assert "fc2.acc.acc" not in flat.ops


def test_relayout_undoes_split_reductions_in_the_region():
    g = PROGRAMS["mlp"]
    tp = layout(g, "all", parse_mesh("4", 4), ["t"])
    assert "fc2.acc" in tp.ops
    dp = layout(tp, "all", parse_mesh("4", 4), ["b"])
    assert "fc2.acc" not in dp.ops and not dp.ops["fc2"].params.get("split")
    assert sorted(dp.ops["fc1"].shards.device.tolist()) == [0, 1, 2, 3]


def test_region_selection():
    g = PROGRAMS["transformer"]
    assert select_ops(g, "ln2:ff2") == ["ln2", "ff1", "ff_act", "ff2"]
    assert select_ops(g, "ff*") == ["ff1", "ff_act", "ff2"]
    assert select_ops(g, "ln1|resid2") == ["ln1", "resid2"]
    p = layout(g, "ff*", parse_mesh("4"), ["t"])
    assert len(p.ops["ln1"].shards) == 1 and len(p.ops["ff1"].shards) == 4


@pytest.mark.parametrize("region,use,match", [
    ("nope", ["b"], "names no operation"),
    ("zz*", ["b"], "selects no operation"),
    ("all", ["b", "t"], "one use per mesh axis"),
    ("all", ["x"], "one use per mesh axis"),
])
def test_layout_refusals(region, use, match):
    with pytest.raises(RewriteError, match=match):
        layout(PROGRAMS["mlp"], region, parse_mesh("4"), use)


def test_same_layout_twice_is_refused():
    p = layout(PROGRAMS["mlp"], "all", parse_mesh("4"), ["b"])
    with pytest.raises(RewriteError, match="already laid out"):
        layout(p, "all", parse_mesh("4"), ["b"])
