"""Two-level reductions: meaning-preserving (executed), placed inside groups then across (one
rail-aligned piece per node at the second level), undone by merge_reduction and unshard;
refusals."""

from __future__ import annotations

import pytest

from executor import verify
from ir import workloads
from ir.rewrites import RewriteError, merge_reduction, parse_move, retile, split_reduction, unshard
from ir.rewrites.hierarchical import two_level


def _flat(g, k):
    """fc2's reduction in k blocks on devices 0..k-1, the sum scattered k ways by rows."""
    p = split_reduction(g, "fc2", k)
    p = retile(p, "fc2", [k, 1, 1], list(range(k)))
    return retile(p, "fc2.acc", [k, 1], list(range(k)))


def test_two_level_reduction_verifies_equal():
    g = workloads.build("mlp", batch=16, widths=[16, 64, 16])
    flat = _flat(g, 8)
    two = two_level(flat, "fc2.acc", 4)
    assert two.ops["fc2.acc"].params["split"] == {"reduction": "k", "parts": 2}
    # level one: block j (partials 4j..4j+3) on the devices that made them, rows split among them
    sh = two.ops["fc2.acc"].shards
    assert sh.device.tolist() == list(range(8))
    assert sh.lo[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # level two keeps the old 8-way sharding of the sum
    assert two.ops["fc2.acc.acc"].shards == flat.ops["fc2.acc"].shards
    assert verify(two, reference=g).ok
    assert str(parse_move("two_level{op=fc2.acc,group=4}")) == "two_level{op=fc2.acc,group=4}"
    assert parse_move("two_level{op=fc2.acc,group=4}").apply(flat).digest == two.digest


def test_partials_cut_over_columns_are_summed_on_their_own_pieces():
    """Tensor parallelism x two microbatches: partial block ``i`` of fc2 is cut over its columns
    between devices ``2(i // 2)`` and ``2(i // 2) + 1``, so a group of two blocks lies on one
    device pair. The first level sums each device's own column half (``own_boxes``): no partial
    crosses a link. Split over rows among the owners instead (``stage_one_shards``, the placement
    for partials that each cover the whole sum), half of each partial went to the peer."""
    from costmodel.lowering import Lowerer
    from costmodel.presets import PRESETS

    g = workloads.build("mlp", batch=16, widths=[16, 64, 16])
    p = split_reduction(g, "fc2", 4)
    p = retile(p, "fc2", [4, 1, 2], [2 * (i // 2) + h for i in range(4) for h in range(2)])
    p = retile(p, "fc2.acc", [4, 1], [0, 1, 2, 3])
    two = two_level(p, "fc2.acc", 2)
    sh = two.ops["fc2.acc"].shards
    assert sh.device.tolist() == [0, 1, 2, 3]
    assert sh.lo.tolist() == [[0, 0, 0], [0, 0, 8], [1, 0, 0], [1, 0, 8]]
    assert sh.hi.tolist() == [[1, 16, 8], [1, 16, 16], [2, 16, 8], [2, 16, 16]]
    assert verify(two, reference=g).ok
    low = Lowerer(PRESETS["h100-sxm-8"]).lower(two)
    nc, names = low.n_compute, list(low.op_names)
    hops = [(names[low.transfer_src_op[c - nc]], names[low.transfer_op[c - nc]]) for c in range(nc, len(low.kind))]
    assert ("fc2", "fc2.acc") not in hops and ("fc2.acc", "fc2.acc.acc") in hops


def test_two_level_is_undone_by_merge_and_unshard():
    g = workloads.build("mlp", batch=16, widths=[16, 64, 16])
    two = two_level(_flat(g, 8), "fc2.acc", 2)
    with pytest.raises(RewriteError, match="itself split"):
        merge_reduction(two, "fc2")
    back = merge_reduction(two, "fc2.acc")
    assert "fc2.acc.acc" not in back.ops
    assert unshard(two).digest == unshard(g).digest


def test_second_level_reads_one_piece_per_node():
    # 64 partials on 8 nodes of 8. Flat, each shard of the sum reads 63 remote partials, 56 of
    # them across nodes; in two levels it reads one first-level piece per node (7 across), all
    # from the same position in each node (rail-aligned), and the first level stays in its node.
    g = workloads.build("mlp", batch=512, widths=[64, 64, 256])
    two = two_level(_flat(g, 64), "fc2.acc", 8)
    first, second = two.ops["fc2.acc"].shards, two.ops["fc2.acc.acc"].shards
    for i in range(len(second)):
        lo, hi, dev = second.lo[i], second.hi[i], int(second.device[i])
        hit = [j for j in range(len(first)) if first.lo[j, 1] < hi[0] and lo[0] < first.hi[j, 1]]
        src = sorted(int(first.device[j]) for j in hit)
        assert len(hit) == 8 and sorted(d // 8 for d in src) == list(range(8))
        assert {d % 8 for d in src} == {dev // 8}
    for j in range(len(first)):  # level one: block j on node j
        assert int(first.device[j]) // 8 == int(first.lo[j, 0])
    assert verify(two, reference=g).ok


@pytest.mark.parametrize("op,group,match", [
    ("fc1", 2, "applies to accumulate ops"),
    ("fc2.acc", 3, "do not fall into groups"),
    ("fc2.acc", 8, "do not fall into groups"),
    ("fc2.acc", 1, "do not fall into groups"),
])
def test_two_level_refusals(op, group, match):
    flat = _flat(workloads.build("mlp", batch=16, widths=[16, 64, 16]), 8)
    with pytest.raises(RewriteError, match=match):
        two_level(flat, op, group)
    with pytest.raises(RewriteError, match="already reduced in two levels"):
        two_level(two_level(flat, "fc2.acc", 4), "fc2.acc", 2)
