"""Copy-on-write: a rewrite of one op leaves every other op the identical object, arrays shared."""

from __future__ import annotations

import numpy as np
import pytest

from ir.rewrites import fuse, merge, merge_reduction, move, place, retile, split, split_reduction, unfuse


@pytest.fixture
def base(kit):
    g = kit.small("transformer")
    for op in g.ops:  # give every op two shards so that arrays are worth sharing
        g = split(g, op, 0, 2)
    return g


REWRITES = {
    "split": (lambda g: split(g, "ff1", "o", 2), {"ff1"}),
    "merge": (lambda g: merge(g, "ff1", 0), {"ff1"}),
    "retile": (lambda g: retile(g, "ln2", (2, 3)), {"ln2"}),
    "place": (lambda g: place(g, "attn_qk", [1, 2]), {"attn_qk"}),
    "move": (lambda g: move(g, "attn_qk", 1, 3), {"attn_qk"}),
    "split_reduction": (lambda g: split_reduction(g, "ff2", 2), {"ff2"}),
    "fuse": (lambda g: fuse(g, "ff1", "ff_act"), {"ff1", "ff_act"}),
}


@pytest.mark.parametrize("kind", list(REWRITES))
def test_other_ops_are_shared(kit, base, kind):
    rewrite, changed = REWRITES[kind]
    h = rewrite(base)
    assert h is not base and h.digest != base.digest
    kit.assert_shared_except(h, base, changed)
    kit.assert_rewrite_ok(h, base)
    # The parent is untouched (its cached digest still matches its content).
    assert base.digest == type(base)(dict(base.tensors), dict(base.ops)).digest


def test_tensor_table_shared_unless_tensors_change(base):
    assert split(base, "ff1", "o", 2).tensors is base.tensors
    assert place(base, "ff1", [3]).tensors is base.tensors
    assert "ff2.partial" in split_reduction(base, "ff2", 2).tensors and "ff2.partial" not in base.tensors


def test_inverse_rewrites_share_too(kit, base):
    f = fuse(base, "ff1", "ff_act")
    u = unfuse(f, "ff1+ff_act")
    kit.assert_shared_except(u, base, {"ff1", "ff_act"})
    s = split_reduction(base, "ff2", 2)
    kit.assert_shared_except(merge_reduction(s, "ff2"), base, {"ff2"})


def test_shard_arrays_are_read_only(base):
    sh = base.ops["ff1"].shards
    for arr in (sh.lo, sh.hi, sh.device):
        with pytest.raises(ValueError):
            arr[0] = 7
    h = place(base, "ff1", [5, 6])
    assert h.ops["ff1"].shards.lo is sh.lo and not h.ops["ff1"].shards.device.flags.writeable
    assert np.array_equal(sh.device, [0, 0])


@pytest.mark.parametrize("program", ["mlp", "gpt-train", "llama-train-sgd"])
def test_is_carried_agrees_with_the_carried_map(program):
    """``Graph.is_carried`` (no pass over the graph) answers as ``Graph.carried`` for every tensor,
    on fresh graphs, forward and training programs alike."""
    from ir import workloads
    from ir.graph import Graph

    if program == "mlp":
        g = workloads.build("mlp", batch=8, widths=[16, 32, 16])
    elif program == "gpt-train":
        g = workloads.build("gpt", mode="train", layers=2, d_model=32, heads=2, vocab=20, seq=8, batch=2,
                            dtype="bfloat16")
    else:
        g = workloads.build("llama", mode="train", optimizer="sgd", layers=1, d_model=32, heads=2, kv_heads=1,
                            d_ff=64, vocab=20, seq=8, batch=2)
    fresh = Graph(g.tensors, g.ops)
    answers = {t: fresh.is_carried(t) for t in g.tensors}  # before the map exists
    assert "carried" not in fresh.__dict__
    assert {t for t, c in answers.items() if c} == set(g.carried)
    assert all(g.is_carried(t) == (t in g.carried) for t in g.tensors)  # after it exists
    assert (len(g.carried) > 0) == (program != "mlp") and not fresh.is_carried("no-such-tensor")


def test_flow_key_carries_over_only_while_the_data_flow_is_the_same(base):
    o = next(iter(base.ops.values()))
    key = o.flow_key
    assert key == (o.name, o.kernel, o.inputs, o.output)
    moved = o.replace(shards=o.shards)
    assert moved.flow_key is key  # a shard move keeps the memo
    renamed = o.replace(output=o.output + "_x")
    assert renamed.flow_key == (o.name, o.kernel, o.inputs, o.output + "_x")
    rewired = o.replace(inputs=tuple((p, t + "_y") for p, t in o.inputs))
    assert rewired.flow_key[2] == tuple((p, t + "_y") for p, t in o.inputs)


def _scan(a, b) -> set[str]:
    """The tensors that differ between two tables, by comparing every entry."""
    return {n for n in a.keys() | b.keys() if a.get(n) is not b.get(n)}


def test_changed_tensors_are_known_from_the_rewrite_and_equal_a_full_comparison(base):
    import pickle

    from ir.rewrites import unfuse

    children = {"fuse": fuse(base, "ff1", "ff_act"), "split_reduction": split_reduction(base, "ff2", 2),
                "split": split(base, "ff1", "o", 2)}
    children["unfuse"] = unfuse(children["fuse"], "ff1+ff_act")
    parents = {"fuse": base, "split_reduction": base, "split": base, "unfuse": children["fuse"]}
    for kind, child in children.items():
        parent = parents[kind]
        got = child.changed_tensors(parent.tensors)
        assert set(got) == _scan(child.tensors, parent.tensors), kind
        if child.tensors is not parent.tensors:
            assert child.tensor_delta[0] is parent.tensors and got, kind  # from the rewrite, not a scan
    assert set(children["fuse"].changed_tensors(base.tensors)) == {"ff1.out"}  # removed
    # another table (no delta for it): the full comparison
    far = children["unfuse"]
    assert set(far.changed_tensors(children["split_reduction"].tensors)) == _scan(
        far.tensors, children["split_reduction"].tensors)
    copy = pickle.loads(pickle.dumps(children["fuse"]))
    assert copy.tensor_delta is None  # lineage stays in its process
    assert set(copy.changed_tensors(base.tensors)) == _scan(copy.tensors, base.tensors)
