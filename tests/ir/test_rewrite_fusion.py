"""fuse / unfuse: a producer and its aligned elementwise consumer as one op, and back."""

from __future__ import annotations

import pytest

from ir import workloads
from ir.builder import GraphBuilder
from ir.graph import Graph
from ir.rewrites import RewriteError, fusable, fuse, place, retile, split, split_reduction, unfuse, unshard


@pytest.fixture
def chain() -> Graph:
    """fc = linear(x, W, b) -> act = relu -> t = tanh -> s = mul(t, scale[N]) (graph output)."""
    b = GraphBuilder()
    h = b.linear(b.input("x", (6, 5)), b.parameter("W", (5, 8)), b.parameter("b", (8,)), name="fc")
    h = b.relu(h, name="act")
    h = b.tanh(h, name="t")
    b.mul(h, b.parameter("scale", (8,)), name="s")
    return b.build()


def test_fuse_linear_relu(kit, mlp):
    h = fuse(mlp, "fc1", "act1")
    o = h.ops["fc1+act1"]
    assert o.kernel == "fused" and o.output == "act1.out"
    assert dict(o.inputs) == {"0.x": "x", "0.W": "W1", "0.b": "b1"}
    assert [s["op"] for s in o.params["stages"]] == ["fc1", "act1"]
    assert "fc1" not in h.ops and "act1" not in h.ops and "fc1.out" not in h.tensors
    kit.assert_rewrite_ok(h, mlp)


def test_fused_op_keeps_producer_shards(kit, mlp):
    g = place(split(mlp, "fc1", "o", 4), "fc1", [0, 1, 2, 3])
    h = fuse(g, "fc1", "act1")
    assert h.ops["fc1+act1"].shards is g.ops["fc1"].shards
    kit.assert_rewrite_ok(h, mlp)


def test_unfuse_of_fuse_is_identity(kit, mlp):
    assert unfuse(fuse(mlp, "fc1", "act1"), "fc1+act1").digest == mlp.digest
    t = kit.small("transformer")
    for p, c in [("ff2", "resid2"), ("o_proj", "resid1"), ("ff1", "ff_act")]:
        assert fusable(t, p, c) is None
        f = fuse(t, p, c)
        kit.assert_rewrite_ok(f, t)
        assert unfuse(f, f"{p}+{c}").digest == t.digest


def test_a_fused_op_sits_where_program_order_runs_it():
    """The consumer's other input is made after the producer: the fused op waits for it, so it
    goes right after that op (op order stays program order), not at the producer's place."""
    b = GraphBuilder()
    x = b.input("x", (4, 4))
    p = b.relu(x, name="p")
    q = b.tanh(x, name="q")  # made after p, read by the consumer
    c = b.add(p, q, name="c")
    b.relu(c, name="after")
    g = b.build()
    h = fuse(g, "p", "c")
    assert list(h.ops) == ["q", "p+c", "after"] and h.topo_order == tuple(h.ops)
    assert h.origin() is g
    assert list(fuse(g, "q", "c").ops) == ["p", "q+c", "after"]  # its other input came first: in place
    assert unfuse(h, "p+c").digest == g.digest


def test_in_program_order_reorders_only_what_is_out_of_order(mlp):
    assert mlp.in_program_order() is mlp
    ops = dict(reversed(list(mlp.ops.items())))
    g = Graph(mlp.tensors, ops)
    h = g.in_program_order()
    assert h.topo_order == tuple(h.ops) == mlp.topo_order and h.digest == mlp.digest


def test_unfuse_restores_aligned_consumer_shards(kit, mlp):
    g = retile(mlp, "fc1", (2, 2), devices=(0, 1, 2, 3))
    g = retile(g, "act1", (2, 2), devices=(0, 1, 2, 3))
    u = unfuse(fuse(g, "fc1", "act1"), "fc1+act1")
    assert u.digest == g.digest
    # A fused op sharded after fusion unfuses into two ops sharded alike.
    f = split(fuse(mlp, "fc1", "act1"), "fc1+act1", "n", 3)
    u = unfuse(f, "fc1+act1")
    assert u.ops["act1"].shards == u.ops["fc1"].shards
    kit.assert_rewrite_ok(u, mlp)


def test_fusion_chain_extended_and_unwound(kit, chain):
    f1 = fuse(chain, "fc", "act")
    f2 = fuse(f1, "fc+act", "t")
    f3 = fuse(split(f2, "fc+act+t", "o", 2), "fc+act+t", "s")
    assert [s["op"] for s in f3.ops["fc+act+t+s"].params["stages"]] == ["fc", "act", "t", "s"]
    assert dict(f3.ops["fc+act+t+s"].inputs)["3.b"] == "scale"
    for h in (f1, f2, f3):
        kit.assert_rewrite_ok(h, chain)
    u = unfuse(f3, "fc+act+t+s")
    assert set(u.ops) == {"fc+act+t", "s"}
    u = unfuse(unfuse(u, "fc+act+t"), "fc+act")
    assert set(u.ops) == {"fc", "act", "t", "s"}
    kit.assert_rewrite_ok(u, chain)
    assert unfuse(unfuse(f2, "fc+act+t"), "fc+act").digest == chain.digest
    assert unshard(f3).digest == unshard(chain).digest


def test_fuse_softmax_with_broadcast_consumer(kit):
    # The producer's output projection is not the identity (rows read whole): M is composed.
    b = GraphBuilder()
    sm = b.softmax(b.input("x", (3, 4, 6)), name="sm")
    b.mul(sm, b.parameter("w", (6,)), name="scale")
    g = b.build()
    h = fuse(g, "sm", "scale")
    sig = h.signature("sm+scale")
    assert sig.dims == ("d0", "d1")
    kit.assert_rewrite_ok(retile(h, "sm+scale", (3, 2), devices=(0, 1)), g)
    u = unfuse(retile(h, "sm+scale", (3, 2)), "sm+scale")
    assert u.ops["scale"].shards.hi[:, 2].tolist() == [6] * 6  # consumer shards read whole rows
    kit.assert_rewrite_ok(u, g)


def test_refused_consumer_not_elementwise(mlp):
    with pytest.raises(RewriteError, match=r"cannot fuse act1 into fc2: fc2 \(linear\) is not an elementwise kernel"):
        fuse(mlp, "act1", "fc2")


def test_refused_intermediate_read_twice():
    b = GraphBuilder()
    h = b.relu(b.input("x", (4, 5)), name="r")
    t = b.tanh(h, name="t")
    b.add(h, t, name="sum")
    g = b.build()
    with pytest.raises(RewriteError, match=r"r.out is read by \['t', 'sum'\], not by t alone"):
        fuse(g, "r", "t")
    b2 = GraphBuilder()
    h = b2.relu(b2.input("x", (4, 5)), name="r")
    b2.mul(h, h, name="sq")  # one reader, two ports
    with pytest.raises(RewriteError, match="not by sq alone"):
        fuse(b2.build(), "r", "sq")


def test_refused_output_tensor():
    b = GraphBuilder()
    h = b.relu(b.input("x", (4, 5)), name="r")
    y = b.tanh(h, name="t")
    g = b.build(outputs=[h, y])
    with pytest.raises(RewriteError, match="r.out is a graph output and must stay materialised"):
        fuse(g, "r", "t")


def test_refused_broadcast_read():
    b = GraphBuilder()
    x = b.input("x", (4, 5))
    r = b.reduce_sum(x, name="colsum", dim=0)  # r[5]
    b.add(x, r, name="shift")  # reads r broadcast along rows
    g = b.build()
    with pytest.raises(RewriteError, match="shift does not read colsum.out aligned"):
        fuse(g, "colsum", "shift")


def test_refused_other_cases(mlp, chain):
    f = fuse(chain, "act", "t")
    with pytest.raises(RewriteError, match=r"act\+t \(fused\) is not an elementwise kernel"):
        fuse(f, "fc", "act+t")
    s = split_reduction(mlp, "fc1", 2)
    with pytest.raises(RewriteError, match=r"fc1.acc \(accumulate\) is not an elementwise kernel"):
        fuse(s, "fc1", "fc1.acc")
    with pytest.raises(RewriteError, match="no operation 'zz'"):
        fuse(mlp, "fc1", "zz")
    with pytest.raises(RewriteError, match="fc1 is not a fused operation"):
        unfuse(mlp, "fc1")


def test_fused_ops_in_every_workload_verify(kit):
    for name in ("mlp", "transformer", "convnet"):
        g = workloads.build(name, **kit.SMALL[name])
        h = g
        while True:
            pair = next(((h.producers[t], r[0][0]) for t, r in h.consumers.items()
                         if len(r) == 1 and t in h.producers and fusable(h, h.producers[t], r[0][0]) is None), None)
            if pair is None:
                break
            h = fuse(h, *pair)
        assert any(o.kernel == "fused" for o in h.ops.values()), name
        kit.assert_rewrite_ok(h, g)
        assert unshard(h).digest == unshard(g).digest


def test_fused_run_builds_its_stage_signatures_once_per_op(chain, monkeypatch):
    """An executor runs every shard of a fused op: the stages' signatures are built once per
    (input specs, stages), not per shard, and two chains with the same specs but other stages
    still run their own stages."""
    import numpy as np

    from executor.run import execute, random_inputs
    from ir.kernels import fused as fused_mod
    h = split(fuse(fuse(chain, "fc", "act"), "fc+act", "t"), "fc+act+t", "n", 3)
    b = GraphBuilder()  # the same specs and shapes, another chain (gelu for tanh)
    y = b.relu(b.linear(b.input("x", (6, 5)), b.parameter("W", (5, 8)), b.parameter("b", (8,)), name="fc"), name="act")
    b.mul(b.gelu(y, name="t"), b.parameter("scale", (8,)), name="s")
    other = fuse(fuse(b.build(), "fc", "act"), "fc+act", "t")
    calls = []
    real = fused_mod.Fused.stage_signatures
    monkeypatch.setattr(fused_mod.Fused, "stage_signatures",
                        lambda self, ins, params: calls.append(1) or real(self, ins, params))
    fused_mod._RUN_STAGES.clear()
    x = random_inputs(chain, 0)
    want = execute(chain, x, "numpy")["s.out"]
    got = execute(h, x, "numpy")["s.out"]
    assert np.allclose(got, want, rtol=1e-6)
    n_first = len(calls)
    assert np.allclose(execute(h, x, "numpy")["s.out"], want, rtol=1e-6)
    assert len(calls) == n_first  # the second run (3 more shards) built nothing
    assert not np.allclose(execute(other, x, "numpy")["s.out"], want)  # gelu: its own stages, not tanh's
