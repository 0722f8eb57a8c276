"""fuse_attention / unfuse_attention: the attention pattern as one op, and back.

Property tests draw shapes, the pattern's form (the transformer's bmm + permute, the einsum form
with ``scale`` and ``causal_mask`` ops, grouped-query heads) and shardings of the fused op,
including a split key reduction; each substituted plan verifies against the unfused program and
``unfuse_attention`` gives the original graph back (same digest).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import verify
from ir import workloads
from costmodel import evaluate
from ir.builder import GraphBuilder
from ir.dot import to_dot
from ir.graph import Graph
from ir.rewrites import (RewriteError, fuse, fuse_attention, match_attention, parse_move, place, random_rewrite,
                         split, split_reduction, unfuse_attention, unshard)
from ir.serialize import dumps, loads
from ir.validate import validate

FUSED = "attn_qk+attn_av"


def einsum_attention(b=2, kvh=2, g=1, s=6, e=4, causal=True, offset=0, scale_op=True, dtype="float32") -> Graph:
    """q[b, kvh, (g,) s, e] · k[b, kvh, t, e] -> [scale] -> [causal_mask] -> softmax -> · v, then a
    residual add so the attention output is an intermediate, as in gpt/llama blocks."""
    gb = GraphBuilder(dtype)
    qs = (b, kvh, g, s, e) if g > 1 else (b, kvh, s, e)
    q = gb.input("q", qs)
    k = gb.input("k", (b, kvh, s, e))
    v = gb.input("v", (b, kvh, s, e))
    ql = "bkgse" if g > 1 else "bkse"
    sl = ql[:-1] + "t"
    alpha = 1.0 if scale_op else 1 / math.sqrt(e)
    h = gb.einsum(q, k, name="attn_qk", equation=f"{ql},bkte->{sl}", alpha=alpha)
    if scale_op:
        h = gb.scale(h, name="attn_scale", alpha=1 / math.sqrt(e))
    if causal:
        h = gb.causal_mask(h, name="attn_mask", offset=offset)
    h = gb.softmax(h, name="attn_softmax")
    h = gb.einsum(h, v, name="attn_av", equation=f"{sl},bkte->{ql}")
    gb.add(h, q, name="resid")
    return gb.build()


def assert_equivalent(h: Graph, g: Graph) -> None:
    issues = validate(h)
    assert issues == [], "\n".join(map(str, issues))
    rep = verify(h, reference=g)
    assert rep.ok, str(rep)


def test_transformer_attention_becomes_one_op(kit):
    g = kit.small("transformer")
    h = fuse_attention(g, "attn_qk")
    o = h.ops[FUSED]
    assert o.kernel == "attention" and o.output == "attn_av.out"
    assert dict(o.inputs) == {"q": "q_proj.out", "k": "k_proj.out", "v": "v_proj.out"}
    assert o.params["scale"] == pytest.approx(1 / math.sqrt(4)) and o.params["causal"] is False
    for gone in ("k_t", "attn_qk", "attn_softmax", "attn_av"):
        assert gone not in h.ops
    for gone in ("k_t.out", "attn_qk.out", "attn_softmax.out"):  # no s × t tensor is left
        assert gone not in h.tensors
    assert_equivalent(h, g)
    kit.assert_shared_except(h, g, {"k_t", "attn_qk", "attn_softmax", "attn_av"})
    back = unfuse_attention(h, FUSED)
    assert back.digest == g.digest
    assert unshard(h).digest == g.digest  # the logical program behind a fused plan is the user's


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(2, 9), heads=st.sampled_from([1, 2, 4]), dh=st.integers(1, 5),
       seed=st.integers(0, 2**32 - 1))
def test_transformer_fusion_and_inverse_on_random_shapes(batch, seq, heads, dh, seed):
    g = workloads.build("transformer", batch=batch, seq=seq, d_model=heads * dh, heads=heads, d_ff=8)
    rng = np.random.default_rng(seed)
    h = fuse_attention(g, "attn_qk")
    assert_equivalent(h, g)
    assert unfuse_attention(h, FUSED).digest == g.digest
    # Shard the fused op along rows and heads, split its key reduction, spread it over devices.
    p = split(h, FUSED, "s", min(seq, 2)) if seq > 1 else h
    divisors = [d for d in (2, 3) if seq % d == 0]
    if divisors:
        p = split_reduction(p, FUSED, int(rng.choice(divisors)))
        p = place(split(p, FUSED, "kb", 2), FUSED, [0, 1, 2, 3])
    assert_equivalent(p, g)
    assert unshard(p).digest == g.digest


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 2), kvh=st.integers(1, 2), groups=st.integers(1, 3), s=st.integers(1, 8),
       e=st.integers(1, 4), causal=st.booleans(), offset=st.integers(0, 2), scale_op=st.booleans(),
       rows=st.integers(1, 3), parts=st.sampled_from([1, 2]))
def test_einsum_form_with_mask_and_grouped_heads(b, kvh, groups, s, e, causal, offset, scale_op, rows, parts):
    g = einsum_attention(b, kvh, groups, s, e, causal, offset, scale_op)
    m = match_attention(g, "attn_qk")
    assert not isinstance(m, str), m
    assert m.causal == causal and (m.offset == offset if causal else True)
    assert m.scale == pytest.approx(1 / math.sqrt(e))
    h = fuse_attention(g, "attn_qk")
    assert_equivalent(h, g)
    assert unfuse_attention(h, FUSED).digest == g.digest
    p = split(h, FUSED, "s", rows) if rows <= s and rows > 1 else h
    if parts > 1 and s % parts == 0:
        p = place(split_reduction(p, FUSED, parts), FUSED, [1, 0])
    assert_equivalent(p, g)
    assert unshard(p).digest == g.digest


def test_sharded_pattern_keeps_its_values_shards(kit):
    g = kit.small("transformer")
    g = place(split(g, "attn_av", "m", 3), "attn_av", [0, 1, 2])  # bmm's dims: a, b (batch), m, n
    h = fuse_attention(g, "attn_qk")
    sh = h.ops[FUSED].shards
    assert len(sh) == 3 and sh.device.tolist() == [0, 1, 2]
    assert sh.lo[:, -1].tolist() == [0, 2, 4]  # rows 0:2, 2:4, 4:6 of the query dim
    assert_equivalent(h, g)
    back = unfuse_attention(h, FUSED)
    assert back.ops["attn_av"].shards == g.ops["attn_av"].shards
    assert_equivalent(back, g)


def test_refusals_name_the_reason(kit):
    g = kit.small("transformer")
    with pytest.raises(RewriteError, match="not a plain einsum/matmul/bmm"):
        fuse_attention(g, "attn_softmax")
    with pytest.raises(RewriteError, match="must contract exactly one letter"):
        fuse_attention(g, "o_proj")
    with pytest.raises(RewriteError, match="no operation 'nope'"):
        fuse_attention(g, "nope")
    with pytest.raises(RewriteError, match="not an attention op"):
        unfuse_attention(g, "attn_qk")
    # The scores split into blocks are no longer a plain contraction.
    with pytest.raises(RewriteError, match="not a plain"):
        fuse_attention(split_reduction(g, "attn_qk", 2), "attn_qk")
    # Probabilities that are a graph output must stay materialised.
    b = GraphBuilder()
    q, k, v = (b.input(n, (2, 4, 3)) for n in "qkv")
    p = b.softmax(b.einsum(q, k, name="qk", equation="bse,bte->bst"), name="sm")
    b.einsum(p, v, name="av", equation="bst,bte->bse")
    two = b.build(outputs=["sm.out", "av.out"])
    with pytest.raises(RewriteError, match="graph output"):
        fuse_attention(two, "qk")
    # Scores computed as k·qᵀ (keys first) are not the pattern's layout.
    b = GraphBuilder()
    q, k, v = (b.input(n, (2, 4, 3)) for n in "qkv")
    p = b.softmax(b.einsum(k, q, name="kq", equation="bte,bse->bst"), name="sm")
    b.einsum(p, v, name="av", equation="bst,bte->bse")
    with pytest.raises(RewriteError, match="first operand must be q"):
        fuse_attention(b.build(), "kq")
    # A mask that fills with 0 is not the -inf mask attention applies.
    b = GraphBuilder()
    q, k, v = (b.input(n, (2, 4, 3)) for n in "qkv")
    h = b.causal_mask(b.einsum(q, k, name="qk", equation="bse,bte->bst"), name="mask", fill=0.0)
    b.einsum(b.softmax(h, name="sm"), v, name="av", equation="bst,bte->bse")
    with pytest.raises(RewriteError, match="not -inf"):
        fuse_attention(b.build(), "qk")
    # An attention written as such has nothing to restore; a split one must be merged first.
    direct = GraphBuilder()
    q, k, v = (direct.input(n, (2, 4, 3)) for n in "qkv")
    direct.attention(q, k, v, name="attn")
    with pytest.raises(RewriteError, match="no origin"):
        unfuse_attention(direct.build(), "attn")
    with pytest.raises(RewriteError, match="merge_reduction first"):
        unfuse_attention(split_reduction(fuse_attention(g, "attn_qk"), FUSED, 2), FUSED)


def test_values_op_reading_the_scores_twice_is_refused():
    b = GraphBuilder()
    q, k, v = (b.input(n, (2, 4, 3)) for n in "qkv")
    s = b.einsum(q, k, name="qk", equation="bse,bte->bst")
    p = b.softmax(s, name="sm")
    b.einsum(p, v, name="av", equation="bst,bte->bse")
    b.reduce_sum(s, name="peek", dim=-1)
    with pytest.raises(RewriteError, match="not by one op"):
        fuse_attention(b.build(), "qk")


def test_moves_print_parse_and_apply(kit):
    g = kit.small("transformer")
    m = parse_move("fuse_attention{op=attn_qk}")
    assert str(m) == "fuse_attention{op=attn_qk}"
    h = m.apply(g)
    u = parse_move(f"unfuse_attention{{op={FUSED}}}")
    assert str(u) == f"unfuse_attention{{op={FUSED}}}"
    assert u.apply(h).digest == g.digest
    seq = parse_move(f"fuse_attention{{op=attn_qk}}; split_reduction{{op={FUSED},parts=2,reduction=t}}")
    assert_equivalent(seq.apply(g), g)


def test_json_round_trip_and_picture(kit):
    g = kit.small("transformer")
    h = place(split(split_reduction(fuse_attention(g, "attn_qk"), FUSED, 2), FUSED, "kb", 2), FUSED, [0, 1])
    back = loads(dumps(h))
    assert back.digest == h.digest and back.ops[FUSED].params == h.ops[FUSED].params
    dot = to_dot(h)
    assert "attention[split 2]  (was bmm → softmax → bmm)" in dot and "attention_combine" in dot


def test_fused_attention_can_absorb_an_elementwise_consumer():
    """Stage 0 of a fused op runs with its box, so causal rows keep their absolute positions."""
    g = einsum_attention(causal=True, s=6)
    h = fuse_attention(g, "attn_qk")
    f = split(fuse(h, FUSED, "resid"), f"{FUSED}+resid", "s", 3)
    assert_equivalent(f, g)
    assert unshard(f).digest == g.digest


def test_random_rewrites_find_the_substitution(kit):
    g = kit.small("transformer")
    rng = np.random.default_rng(0)
    h, m = random_rewrite(g, rng, 4, weights={"fuse_attention": 1.0})
    assert str(m) == "fuse_attention{op=attn_qk}" and h.ops[FUSED].kernel == "attention"
    h2, m2 = random_rewrite(h, rng, 4, weights={"unfuse_attention": 1.0})
    assert str(m2) == f"unfuse_attention{{op={FUSED}}}" and h2.digest == g.digest
    with pytest.raises(RewriteError):  # nothing left to fuse
        random_rewrite(h, rng, 4, weights={"fuse_attention": 1.0})


def test_cli_rewrite_accepts_the_moves(tmp_path):
    """``tapestry graph rewrite`` parses substitution moves like any other; a refusal is one paragraph, exit 2."""
    from tests.farm.conftest import cli

    prog, plan = tmp_path / "t.json", tmp_path / "p.json"
    cli("graph", "build", "transformer", "--set", "batch=2", "--set", "seq=8", "-o", str(prog), check=True)
    cli("graph", "rewrite", str(prog), "fuse_attention{op=attn_qk}", "fuse_norm{norm=ln2}",
        f"split_reduction{{op={FUSED},parts=2,reduction=t}}", "-o", str(plan), check=True)
    assert "PASS" in cli("verify", str(plan), check=True).stdout
    bad = cli("graph", "rewrite", str(prog), "fuse_attention{op=attn_softmax}", "-o", str(tmp_path / "q.json"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "attn_softmax (softmax) is not a plain einsum/matmul/bmm" in bad.stderr
    assert not (tmp_path / "q.json").exists()


@pytest.mark.parametrize("name,kw", [("gpt", dict(batch=2, seq=6)), ("llama", dict(batch=2, seq=6, kv_heads=2)),
                                     ("transformer", dict(batch=2, seq=6, d_model=8, heads=2, d_ff=12))])
def test_training_step_substitution_replaces_the_backward_too(name, kw):
    """In a training step the pattern's backward ops (``<op>.d<tag>``) go as well: the gradients of q,
    k and v keep their tensors, now written by attention_grad_* ops that recompute the scores."""
    g = workloads.build(name, mode="train", **kw)
    h = g
    for site in [n for n in g.ops if n.endswith("attn_qk")]:
        h = fuse_attention(h, site)
    assert_equivalent(h, g)
    scores = {t.shape for n, t in g.tensors.items() if n.endswith("attn_softmax.out")}
    assert scores and not [n for n, t in h.tensors.items() if t.shape in scores]  # seq 6 is no head dim
    kernels = sorted(o.kernel for o in h.ops.values() if o.kernel.startswith("attention"))
    layers = len([n for n in g.ops if n.endswith("attn_qk")])
    assert kernels == sorted(["attention", "attention_grad_k", "attention_grad_q", "attention_grad_v",
                              "attention_lse"] * layers)
    back = h
    for n in [n for n, o in h.ops.items() if o.kernel == "attention"]:
        back = unfuse_attention(back, n)
    assert back.digest == g.digest and unshard(h).digest == unshard(g).digest
    assert loads(dumps(h)).digest == h.digest


def test_training_step_refuses_when_an_intermediate_leaves_the_pattern():
    from ir.autodiff import training_step

    b = GraphBuilder()
    q, k, v = (b.parameter(n, (2, 4, 3)) for n in "qkv")
    s = b.einsum(q, k, name="qk", equation="bse,bte->bst")
    p = b.softmax(s, name="sm")
    b.einsum(p, v, name="av", equation="bst,bte->bse")
    step = training_step(b.build())
    assert not isinstance(match_attention(step, "qk"), str)  # the plain step fuses
    b2 = GraphBuilder()
    q, k, v = (b2.parameter(n, (2, 4, 3)) for n in "qkv")
    p = b2.softmax(b2.einsum(q, k, name="qk", equation="bse,bte->bst"), name="sm")
    b2.einsum(p, v, name="av", equation="bst,bte->bse")
    b2.reduce_sum(p, name="peek", dim=-1)
    step2 = training_step(b2.build(), output="av.out")
    assert "not by one op" in match_attention(step2, "qk")


def test_training_step_cost_drops():
    g = workloads.build("gpt", batch=2, seq=256, d_model=128, heads=4, layers=1, vocab=128, mode="train",
                        dtype="bfloat16")
    h = fuse_attention(g, "l0.attn_qk")
    a, b = evaluate(g, "h100-sxm-8"), evaluate(h, "h100-sxm-8")
    assert b.peak_memory < a.peak_memory and b.makespan < a.makespan


def test_recomputed_attention_copies_are_not_fused():
    """Fusing a recomputed copy's attention (``l0.attn_qk.re``) would record ops that
    ``unrecompute`` drops, and ``unshard`` (so every evaluation's program facts) failed on the
    plan; the move is refused with the way round: fuse the forward first, then recompute."""
    from ir.autodiff import training_step
    from ir.rewrites import unshard
    from ir.rewrites.substitute_attention import attention_sites
    from optimizer.search.baselines import recompute_layers, zero3

    fwd = workloads.build("llama", mode="forward", layers=2, d_model=16, heads=2, kv_heads=1, d_ff=32, vocab=10,
                          seq=4, batch=2)
    for site in attention_sites(fwd):
        fwd = fuse_attention(fwd, site)
    plan = recompute_layers(zero3(training_step(fwd, loss="cross_entropy", optimizer="adamw"), 2))
    assert "l0.attn_qk.re" in plan.ops
    with pytest.raises(RewriteError, match="recomputed copy"):
        fuse_attention(plan, "l0.attn_qk.re")
    unshard(fuse_attention(plan, "l0.attn_qk"))  # the forward's own site still fuses, and unshards
