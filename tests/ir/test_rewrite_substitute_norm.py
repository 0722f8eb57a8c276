"""fuse_norm / unfuse_norm: a layernorm or rmsnorm computed inside the contractions that read it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel import evaluate
from executor import verify
from ir import workloads
from ir.builder import GraphBuilder
from ir.dot import to_dot
from ir.rewrites import (RewriteError, fuse, fuse_norm, parse_move, place, random_rewrite, split, split_reduction,
                         unfuse, unfuse_norm, unshard)
from ir.rewrites.substitute_norm import fused_norms, norm_sites
from ir.serialize import dumps, loads
from ir.validate import validate


def assert_equivalent(h, g):
    issues = validate(h)
    assert issues == [], "\n".join(map(str, issues))
    rep = verify(h, reference=g)
    assert rep.ok, str(rep)


def test_norm_into_every_reader_and_back(kit):
    g = kit.small("transformer")
    assert norm_sites(g) == ["ln1", "ln2"]
    h = fuse_norm(g, "ln1")
    assert "ln1" not in h.ops and "ln1.out" not in h.tensors
    for c in ("q_proj", "k_proj", "v_proj"):
        o = h.ops[f"ln1+{c}"]
        assert o.kernel == "norm_matmul" and dict(o.inputs)["x"] == "x" and o.output == f"{c}.out"
    assert_equivalent(h, g)
    back = h
    for c in ("q_proj", "k_proj", "v_proj"):
        back = unfuse_norm(back, f"ln1+{c}")
    assert back.digest == g.digest
    assert unshard(h).digest == g.digest


def test_one_reader_keeps_the_norm_for_the_others(kit):
    g = kit.small("transformer")
    h = fuse_norm(g, "ln1", "k_proj")
    assert "ln1" in h.ops and h.ops["q_proj"].input_map["a"] == "ln1.out"
    assert_equivalent(h, g)
    assert unfuse_norm(h, "ln1+k_proj").digest == g.digest
    with pytest.raises(RewriteError, match="not a plain"):  # q_proj already absorbed it
        fuse_norm(fuse_norm(h, "ln1", "q_proj"), "ln1", "ln1+q_proj")


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["gpt", "llama"]), seq=st.integers(2, 6), seed=st.integers(0, 2**32 - 1))
def test_random_shapes_and_shardings(name, seq, seed):
    g = workloads.build(name, batch=2, seq=seq, d_model=16, heads=2, d_ff=24, vocab=20)
    rng = np.random.default_rng(seed)
    h = g
    for n in norm_sites(g):
        h = fuse_norm(h, n)
    fused = [n for n, o in h.ops.items() if o.kernel == "norm_matmul"]
    assert fused and not [n for n, o in h.ops.items() if o.kernel in ("layernorm", "rmsnorm")]
    for n in rng.choice(fused, size=3, replace=False):
        dims = h.signature(n).dims
        d = dims[int(rng.integers(len(dims)))]
        if h.signature(n).extents[dims.index(d)] >= 2:  # column shards repeat the normalisation of their rows
            h = place(split(h, n, d, 2), n, [0, 1])
    assert_equivalent(h, g)
    assert unshard(h).digest == g.digest


def test_refusals_name_the_reason(kit):
    g = kit.small("transformer")
    with pytest.raises(RewriteError, match="is not a plain layernorm or rmsnorm"):
        fuse_norm(g, "q_proj")
    with pytest.raises(RewriteError, match="resid1 \\(add\\) is not a plain"):
        fuse_norm(g, "ln2", "resid1")
    with pytest.raises(RewriteError, match="not a plain"):  # the contraction over d is split in blocks
        fuse_norm(split_reduction(g, "ff1", 2), "ln2")
    with pytest.raises(RewriteError, match="not a norm_matmul"):
        unfuse_norm(g, "ff1")
    b = GraphBuilder()
    h = b.layernorm(b.input("x", (4, 6)), b.parameter("g", (6,)), b.parameter("bb", (6,)), name="ln")
    b.matmul(h, b.parameter("W", (6, 3)), name="mm")
    out = b.build(outputs=["ln.out", "mm.out"])
    with pytest.raises(RewriteError, match="graph output"):
        fuse_norm(out, "ln")
    b = GraphBuilder()  # a contraction that keeps the normalised dim (an outer product) cannot normalise rows
    h = b.layernorm(b.input("x", (4, 6)), b.parameter("g", (6,)), b.parameter("bb", (6,)), name="ln")
    b.einsum(h, b.parameter("w", (3,)), name="outer", equation="nd,k->ndk")
    with pytest.raises(RewriteError, match="does not read the normalised dim whole"):
        fuse_norm(b.build(), "ln")


def test_moves_json_picture_and_search(kit):
    g = kit.small("transformer")
    m = parse_move("fuse_norm{norm=ln2,op=ff1}")
    assert str(m) == "fuse_norm{norm=ln2,op=ff1}" and str(parse_move("fuse_norm{norm=ln1}")) == "fuse_norm{norm=ln1}"
    h = m.apply(g)
    assert str(parse_move("unfuse_norm{op=ln2+ff1}")) == "unfuse_norm{op=ln2+ff1}"
    assert parse_move("unfuse_norm{op=ln2+ff1}").apply(h).digest == g.digest
    assert loads(dumps(h)).digest == h.digest
    assert "norm_matmul[layernorm → linear]" in to_dot(h)
    assert "fused[norm_matmul → gelu]" in to_dot(fuse(h, "ln2+ff1", "ff_act"))  # the GEMM's epilogue
    h2, move = random_rewrite(g, np.random.default_rng(0), 2, weights={"fuse_norm": 1.0})
    assert str(move).startswith("fuse_norm{norm=ln") and validate(h2) == []


def test_the_cost_model_gains():
    """The normalised activations are neither written nor read back: less time, less memory."""
    g = workloads.build("transformer", batch=8, seq=1024, d_model=1024, heads=16, d_ff=4096, dtype="bfloat16")
    h = fuse_norm(fuse_norm(g, "ln1"), "ln2")
    a, b = evaluate(g, "h100-sxm-8"), evaluate(h, "h100-sxm-8")
    act = 8 * 1024 * 1024 * 2  # one [b, s, d] bf16 activation: what each norm wrote and its readers read
    assert b.makespan < a.makespan
    assert b.peak_memory <= a.peak_memory - act
    ops = {o["op"]: o for o in b.breakdown().ops}
    un = {o["op"]: o for o in a.breakdown().ops}
    # The fused op does the contraction's FLOPs plus the norm's once per row (8 per element).
    assert ops["ln2+ff1"]["flops"] == pytest.approx(un["ff1"]["flops"] + un["ln2"]["flops"])


def test_a_norm_fused_into_a_fused_gemm_and_activation_either_way(kit):
    """ln2 → ff1 → ff_act as one kernel (TransformerEngine's LayerNormMLP): the norm fused into the
    fused GEMM + GELU, or the GELU fused onto the norm_matmul, give the same op; it runs equal to
    the program, comes apart both ways, unshards to the program, and is cheaper than either pair."""
    g = kit.small("transformer")
    a = fuse_norm(fuse(g, "ff1", "ff_act"), "ln2")
    b = fuse(fuse_norm(g, "ln2"), "ln2+ff1", "ff_act")
    assert a.digest == b.digest and a.ops["ln2+ff1+ff_act"].kernel == "fused"
    assert "ln2" not in a.ops and "ln2.out" not in a.tensors and validate(a) == []
    assert verify(a, reference=g).ok
    assert unfuse_norm(a, "ln2+ff1+ff_act").digest == fuse(g, "ff1", "ff_act").digest
    assert unfuse(a, "ln2+ff1+ff_act").digest == fuse_norm(g, "ln2").digest
    assert unshard(a).digest == g.digest and fused_norms(a) == ["ln2+ff1+ff_act"]
    assert loads(dumps(a)).digest == a.digest
    big = workloads.build("transformer", batch=8, seq=1024, d_model=1024, heads=16, d_ff=4096, dtype="bfloat16")
    one = evaluate(fuse_norm(fuse(big, "ff1", "ff_act"), "ln2"), "h100-sxm-8").makespan
    assert one < min(evaluate(fuse(big, "ff1", "ff_act"), "h100-sxm-8").makespan,
                     evaluate(fuse_norm(big, "ln2"), "h100-sxm-8").makespan)


def test_a_fused_consumer_must_start_with_the_contraction(kit):
    g = kit.small("transformer")
    with pytest.raises(RewriteError, match="nor a fused op whose first stage"):
        fuse_norm(g, "ln2", "resid2")  # an add
    with pytest.raises(RewriteError, match="exactly one port of its contraction"):
        fuse_norm(fuse(g, "ff2", "resid2"), "ln2", "ff2+resid2")  # its GEMM reads ff_act.out
    with pytest.raises(RewriteError, match="nor a fused op whose first stage"):
        unfuse_norm(fuse(g, "ff1", "ff_act"), "ff1+ff_act")
