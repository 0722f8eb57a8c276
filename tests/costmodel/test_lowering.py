"""Lowering: against a slow, independent reference (ZRange arithmetic and cell sets), hand-checked
transfers, exact unions, and incremental == fresh lowering on random rewrite sequences."""

from __future__ import annotations

import dataclasses
import itertools
import pickle

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel import _kernels as K
from costmodel.hardware import HardwareError
from costmodel.lowering import Lowerer, kernel_class_of, union_volume
from costmodel.structure import build_structure
from costmodel.presets import PRESETS
from ir import workloads
from ir.builder import GraphBuilder
from ir.graph import SOURCE_ROLES, Shards
from ir.kernels import ITEMSIZE
from ir.rewrites import RewriteError, fuse, place, random_rewrite, random_walk, retile, split, split_reduction
from ir.zspace import ZRange

SMALL = {
    "mlp": dict(batch=6, widths=(12, 20, 10)),
    "transformer": dict(batch=2, seq=6, d_model=8, heads=2, d_ff=12),
    "convnet": dict(batch=2, channels=(3, 4, 4), size=6),
}
HW4 = PRESETS["h100-sxm-8"].replace(name="h100-4x2", n_nodes=2, devices_per_node=2)  # intra and inter links


# ---------------------------------------------------------------------------------------------
# the reference: one box at a time, unions as sets of cells
# ---------------------------------------------------------------------------------------------


def clip(box: ZRange, shape) -> ZRange:
    lo = [min(max(a, 0), s) for a, s in zip(box.start, shape)]
    hi = [min(max(b, a), s) for b, a, s in zip(box.end, lo, shape)]
    return ZRange(lo, hi)


def cells(box: ZRange) -> set:
    return set(itertools.product(*[range(a, b) for a, b in zip(box.start, box.end)]))


def reference(g, hw):
    """(compute, transfers, edges, resident): compute = {(op, i): (dev, dur, flops, bytes, out bytes)},
    transfers = {(producer op, shard, dst dev): bytes}, edges = {((op, i), (op', j), via dst dev or None)}."""
    compute, out_box, in_box = {}, {}, {}
    for name in g.topo_order:
        o = g.ops[name]
        sig = g.signature(o)
        dtype = g.tensors[o.output].dtype
        for i, box in enumerate(o.shards.boxes()):
            flops = box.size * sig.flops_per_point
            read = 0.0
            for port, t in o.inputs:
                b = clip(sig.inputs[port].apply(box), g.tensors[t].shape)
                in_box[(name, i, port)] = b
                read += b.size * ITEMSIZE[g.tensors[t].dtype]
            ob = sig.output.apply(box)
            out_box[(name, i)] = ob
            written = clip(ob, g.tensors[o.output].shape).size * ITEMSIZE[dtype]
            dur = float(hw.shard_time(flops, read + written, dtype, kernel_class_of(o)))
            compute[(name, i)] = (int(o.shards.device[i]), dur, flops, read + written, written)
    transfers, edges = {}, set()
    for pname in g.topo_order:
        p = g.ops[pname]
        readers = [(c, port) for c in g.topo_order for port, t in g.ops[c].inputs if t == p.output]
        item = ITEMSIZE[g.tensors[p.output].dtype]
        for i in range(len(p.shards)):
            pdev = int(p.shards.device[i])
            need: dict[int, set] = {}
            for c, port in readers:
                for j in range(len(g.ops[c].shards)):
                    inter = out_box[(pname, i)].intersect(in_box[(c, j, port)])
                    if inter.is_empty:
                        continue
                    cdev = int(g.ops[c].shards.device[j])
                    if not reads_replica(p.shards, i, cdev, hw.devices_per_node):
                        continue  # another replica of this box serves that device
                    if cdev == pdev:
                        edges.add(((pname, i), (c, j), None))
                    else:
                        need.setdefault(cdev, set()).update(cells(inter))
                        edges.add(((pname, i), (c, j), cdev))
            for d, cs in need.items():
                transfers[(pname, i, d)] = len(cs) * item
    resident = np.zeros(hw.n_devices)
    for t, tensor in g.tensors.items():
        if tensor.role not in SOURCE_ROLES:
            continue
        per_dev: dict[int, set] = {}
        for c in g.topo_order:
            for port, tt in g.ops[c].inputs:
                if tt == t:
                    for j in range(len(g.ops[c].shards)):
                        per_dev.setdefault(int(g.ops[c].shards.device[j]), set()).update(cells(in_box[(c, j, port)]))
        for d, cs in per_dev.items():
            resident[d] += len(cs) * ITEMSIZE[tensor.dtype]
    return compute, transfers, edges, resident


def reads_replica(shards, i: int, d: int, per_node: int) -> bool:
    """The rule for a box computed on several devices (replicas), written out: device ``d`` reads
    a replicated box from its own replica, else from one on its node, else from any: the
    ``d % count``-th of those candidates. Whether ``d`` reads shard ``i`` of ``shards``."""
    box = (tuple(shards.lo[i]), tuple(shards.hi[i]))
    members = [k for k in range(len(shards)) if (tuple(shards.lo[k]), tuple(shards.hi[k])) == box]
    devs = [int(shards.device[k]) for k in members]
    local = [k for k, x in zip(members, devs) if x == d]
    near = [k for k, x in zip(members, devs) if x // per_node == d // per_node]
    return i == (local[0] if local else near[d % len(near)] if near else members[d % len(members)])


def decode(low):
    """The same three views of a ``Lowered``."""
    nc = low.n_compute
    node = {}
    compute = {}
    for k, name in enumerate(low.op_names):
        for i, x in enumerate(range(low.op_offsets[k], low.op_offsets[k + 1])):
            node[x] = (name, i)
            compute[(name, i)] = (int(low.dev[x]), float(low.dur[x]), float(low.flops[x]), float(low.nbytes[x]),
                                  float(low.alloc[x]))
    succ = {u: low.succ_idx[low.succ_ptr[u]:low.succ_ptr[u + 1]].tolist() for u in range(len(low.kind))}
    pred_of_t = {}
    for u in range(nc):
        for v in succ[u]:
            if v >= nc:
                assert v not in pred_of_t, "a transfer has one producer shard"
                pred_of_t[v] = u
    transfers, edges = {}, set()
    for t in range(nc, len(low.kind)):
        pname, i = node[pred_of_t[t]]
        key = (pname, i, int(low.dst[t]))
        assert key not in transfers, f"two transfers for {key}"
        assert low.dev[t] == low.dev[pred_of_t[t]] and low.dst[t] != low.dev[t]
        transfers[key] = float(low.alloc[t])
        for v in succ[t]:
            assert v < nc
            edges.add((node[pred_of_t[t]], node[v], int(low.dst[t])))
    for u in range(nc):
        for v in succ[u]:
            if v < nc:
                edges.add((node[u], node[v], None))
    return compute, transfers, edges, low.resident


def random_plans(name, n_plans, steps, seed, n_devices=4):
    rng = np.random.default_rng(seed)
    g0 = workloads.build(name, **SMALL[name])
    for _ in range(n_plans):
        yield random_walk(g0, rng, n_devices, steps)


@pytest.mark.parametrize("name", ["mlp", "transformer", "convnet"])
def test_matches_reference_on_random_plans(name):
    for g in random_plans(name, 12, 8, seed=sum(map(ord, name))):
        low = Lowerer(HW4).lower(g)
        rc, rt, re, rr = reference(g, HW4)
        c, t, e, r = decode(low)
        assert c.keys() == rc.keys()
        for k in rc:
            assert c[k][0] == rc[k][0] and c[k][2] == rc[k][2] and c[k][3] == rc[k][3] and c[k][4] == rc[k][4]
            assert c[k][1] == pytest.approx(rc[k][1], rel=1e-12)
        assert t == rt
        assert e == re
        np.testing.assert_array_equal(r, rr)
        # transfer port times (bytes / bandwidth), latencies and link energies by the link they cross
        nc = low.n_compute
        tn = np.arange(nc, len(low.kind))
        np.testing.assert_array_equal(low.dur[tn], low.alloc[tn] / HW4.link_bandwidth(low.dev[tn], low.dst[tn]))
        np.testing.assert_array_equal(low.lat[tn], HW4.link_latency(low.dev[tn], low.dst[tn]))
        np.testing.assert_allclose(low.elapsed[tn], HW4.transfer_time(low.dev[tn], low.dst[tn], low.alloc[tn]),
                                   rtol=1e-15)
        np.testing.assert_array_equal(low.lat[:nc], 0.0)
        np.testing.assert_array_equal(low.transfer_epb, HW4.link_energy_per_byte(low.dev[tn], low.dst[tn]))


def chain_graph(M=64, K=32, N=48):
    b = GraphBuilder()
    x = b.input("x", (M, K))
    y = b.matmul(x, b.parameter("W", (K, N)), name="mm")
    b.relu(y, name="act")
    return b.build()


def test_split_matmul_transfer_by_hand():
    M, K, N = 64, 32, 48
    g = retile(chain_graph(M, K, N), "mm", [2, 1], [0, 1])  # rows 0:32 on 0, 32:64 on 1; act whole on 0
    low = Lowerer(HW4).lower(g)
    assert low.op_names == ("mm", "act")
    assert len(low.kind) == 2 + 1 + 1  # 2 mm shards, 1 act shard, 1 transfer
    t = 3
    assert low.kind[t] == 1 and low.dev[t] == 1 and low.dst[t] == 0
    assert low.alloc[t] == (M // 2) * N * 4  # the lower half of y
    # it holds the NVLink ports for bytes / bandwidth; the latency only delays the data
    assert low.dur[t] == (M // 2) * N * 4 / HW4.intra_link.bandwidth
    assert low.lat[t] == HW4.intra_link.latency
    np.testing.assert_array_equal(low.lat[:3], 0.0)
    # resident: x rows and all of W on each device
    np.testing.assert_array_equal(low.resident, [(M // 2 * K + K * N) * 4] * 2 + [0, 0])
    # across nodes (device 2 is on node 1): the InfiniBand link
    g2 = place(g, "mm", [0, 2])
    low2 = Lowerer(HW4).lower(g2)
    assert low2.dev[3] == 2 and low2.dur[3] == (M // 2) * N * 4 / HW4.inter_link.bandwidth
    assert low2.lat[3] == HW4.inter_link.latency


def test_box_needed_by_several_shards_and_ops_moves_once():
    # y = mm(x, W) on device 0; two readers (act split in 4 rows on device 1, and an add reading y twice)
    b = GraphBuilder()
    x = b.input("x", (8, 4))
    y = b.matmul(x, b.parameter("W", (4, 6)), name="mm")
    b.relu(y, name="act")
    b.add(y, y, name="twice")
    g = b.build()
    g = retile(g, "act", [4, 1], [1])
    g = retile(g, "twice", [2, 1], [1, 1])
    low = Lowerer(HW4).lower(g)
    tr = np.nonzero(low.kind == 1)[0]
    assert len(tr) == 1 and low.alloc[tr[0]] == 8 * 6 * 4  # all of y once to device 1
    # its successors: 4 act shards and 2 twice shards (twice reads it through two ports: duplicate
    # edges, which the simulator allows)
    assert sorted(set(low.succ_idx[low.succ_ptr[tr[0]]:low.succ_ptr[tr[0] + 1]].tolist())) == [1, 2, 3, 4, 5, 6]


def test_halo_and_partial_overlap_unions():
    # conv rows split over 3 devices, its producer rows split differently: unions of halos are exact
    g = workloads.build("convnet", batch=1, channels=(2, 3, 3), size=12)
    g = retile(g, "relu1", [1, 1, 4, 1], [0, 1, 2, 3])
    g = retile(g, "conv2", [1, 1, 3, 1], [0, 1, 2])
    low = Lowerer(HW4).lower(g)
    _, rt, _, _ = reference(g, HW4)
    _, t, _, _ = decode(low)
    assert t == rt
    # relu1 shard 1 (rows 3:6 on device 1) -> device 0 needs rows 3:5 (conv2 rows 0:4 read 0:5): 2 rows
    assert t[("relu1", 1, 0)] == 1 * 3 * 2 * 12 * 4


def test_union_volume_paths():
    rng = np.random.default_rng(1)
    for _ in range(200):
        k, r = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        lo = rng.integers(0, 6, (k, r))
        hi = lo + rng.integers(0, 5, (k, r))
        want = len(set().union(*[cells(ZRange(a, b)) for a, b in zip(lo, hi)]))
        assert union_volume(lo, hi) == want
        assert K._union_by_subtraction(lo.astype(np.int64), hi.astype(np.int64)) == want  # the large-grid path
    assert union_volume(np.zeros((0, 2)), np.zeros((0, 2))) == 0
    assert union_volume(np.array([[0, 0], [0, 0]]), np.array([[2, 3], [2, 3]])) == 6


def test_empty_shards_are_lowered():
    g = chain_graph(4, 3, 5)
    o = g.ops["mm"]
    from ir.graph import Shards

    g = g.with_ops({"mm": o.replace(shards=Shards([[0, 0], [4, 0]], [[4, 5], [4, 5]], [0, 1]))})
    low = Lowerer(HW4).lower(g)
    rc, rt, re, rr = reference(g, HW4)
    c, t, e, r = decode(low)
    assert t == rt and e == re
    assert c[("mm", 1)][2] == 0 and c[("mm", 1)][1] == HW4.device.launch_overhead


def test_device_out_of_range_is_a_hardware_error():
    g = retile(chain_graph(), "mm", [2, 1], [0, 9])
    with pytest.raises(HardwareError, match="device 9"):
        Lowerer(HW4).lower(g)


ARRAYS = ("kind", "dev", "dst", "dur", "lat", "elapsed", "succ_ptr", "succ_idx", "alloc", "resident", "op_offsets",
          "flops", "nbytes", "transfer_op", "transfer_src_op", "transfer_epb", "link", "part_ptr", "part_dev",
          "part_alloc")


def assert_same(a, b):
    assert a.op_names == b.op_names and a.n_devices == b.n_devices
    for f in ARRAYS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        assert x.tobytes() == y.tobytes(), f  # bit-identical


@pytest.mark.parametrize("name,n_dev", [("mlp", 4), ("transformer", 4), ("convnet", 4), ("transformer", 8)])
def test_incremental_equals_fresh_on_random_walks(name, n_dev):
    hw = HW4 if n_dev == 4 else PRESETS["h100-sxm-8"]
    rng = np.random.default_rng(7)
    inc = Lowerer(hw, states=3)
    ev_inc = Evaluator(hw)
    g0 = workloads.build(name, **SMALL[name])
    seen = [g0]
    g = g0
    for step in range(150):
        try:
            child, _m = random_rewrite(g, rng, n_dev)
        except RewriteError:
            child = g0
        low = inc.lower(child)
        assert_same(low, Lowerer(hw).lower(child))
        e1, e2 = ev_inc(child), Evaluator(hw)(child)
        assert e1.vector().tobytes() == e2.vector().tobytes() and e1.lower_bound == e2.lower_bound
        seen.append(child)
        r = rng.random()
        g = child if r < 0.6 else (seen[int(rng.integers(len(seen)))] if r < 0.8 else g)
    assert inc.stats["incremental"] > 50 and inc.stats["fresh"] > 0


def test_structural_children_of_a_training_step_equal_fresh_lowerings():
    """A training step has hundreds of pieces: a structural child (fusion, reduction split,
    substitution) reuses its parent's pieces and runs of its concatenated arrays (``Lowerer._derive``)."""
    hw = PRESETS["h100-sxm-8"]
    rng = np.random.default_rng(3)
    g0 = workloads.build("gpt", mode="train", batch=4, seq=8, layers=2, d_model=16, heads=2, vocab=32)
    inc, g, structural = Lowerer(hw), g0, 0
    inc.lower(g0)
    for _ in range(80):
        try:
            child, m = random_rewrite(g, rng, 8, max_shards_per_op=8)
        except RewriteError:
            g = g0
            continue
        fresh_before = inc.stats["fresh"]
        assert_same(inc.lower(child), Lowerer(hw).lower(child))
        structural += inc.stats["fresh"] > fresh_before
        g = child if rng.random() < 0.7 else g
    assert structural >= 10 and len(g0.ops) > 64


def test_a_child_is_lowered_from_its_parents_state_through_its_edit():
    hw = HW4
    g = workloads.build("transformer", **SMALL["transformer"])
    inc = Lowerer(hw)
    inc.lower(g)
    k = split(g, "ff1", "o", 2)
    assert k.edit is not None and k.edit.parent() is g and k.edit.replaced == ("ff1",)
    before = inc.stats["incremental"]
    assert_same(inc.lower(k), Lowerer(hw).lower(k))
    assert inc.stats["incremental"] == before + 1
    assert pickle.loads(pickle.dumps(k)).edit is None  # lineage stays in its process
    fused = fuse(g, "ff1", "ff_act")  # a structural rewrite records no edit
    assert fused.edit is None


def test_sibling_and_revisit_paths():
    hw = HW4
    g = workloads.build("transformer", **SMALL["transformer"])
    g = split(g, "ff1", "o", 2)
    inc = Lowerer(hw)
    inc.lower(g)
    kids = [place(g, "ff1", [1, 2]), split(g, "attn_qk", 0, 2), split_reduction(g, "ff2", 2)]
    for k in kids + kids[::-1] + [g]:
        assert_same(inc.lower(k), Lowerer(hw).lower(k))
    # a graph with the same ops in a new dict is the same plan
    from ir.graph import Graph

    same = Graph(g.tensors, dict(g.ops))
    assert inc.lower(same) is inc.lower(g)


def test_warmup_compiles_the_kernels():
    from costmodel.lowering import warmup

    warmup()
    assert warmup() < 0.5


def test_a_child_of_a_plan_whose_state_is_gone_derives_its_structure_from_the_plans_sketch(monkeypatch):
    """A search mutates a good plan long after its state left the recent ones: the child's
    structure is still derived from the plan's (``Lowerer._sketches``), not built whole, and the
    sketch goes with the plan."""
    import gc

    import costmodel.lowering as L

    hw = PRESETS["h100-sxm-8"]
    g0 = workloads.build("gpt", mode="train", batch=4, seq=8, layers=2, d_model=16, heads=2, vocab=32)
    small = Lowerer(hw)
    small.lower(workloads.build("transformer", **SMALL["transformer"]))
    assert not small._sketches  # a small program's structures come from the cache by key
    inc = Lowerer(hw, states=1)
    inc.SKETCH_MIN_OPS = 0  # (a 2-layer step is about the threshold: sketch it whatever its size)
    parent = fuse(g0, "l1.o_proj", "l1.resid1")
    inc.lower(parent)
    rng = np.random.default_rng(5)
    for _ in range(3):  # other plans push the parent's state out
        inc.lower(random_rewrite(g0, rng, 8, max_shards_per_op=8)[0])
    assert all(S.ops_map is not parent.ops for S in inc._states) and id(parent) in inc._sketches
    built = []
    monkeypatch.setattr(L, "build_structure", lambda *a: built.append(1) or build_structure(*a))
    child = fuse(parent, "l0.o_proj", "l0.resid1")
    low = inc.lower(child)
    assert not built  # derived from the sketch
    assert_same(low, Lowerer(hw).lower(child))
    key = id(parent)
    del parent
    child.origin = None
    gc.collect()
    assert key not in inc._sketches  # the plan is gone: so is its sketch


def replicated(g, op: str, devices: list[int]):
    """``op`` computed whole on each of ``devices`` (one replica each)."""
    o = g.ops[op]
    ext = list(g.signature(o).extents)
    n = len(devices)
    return g.with_ops({op: dataclasses.replace(o, shards=Shards([[0] * len(ext)] * n, [ext] * n, devices))})


@pytest.mark.parametrize("replicas, act, sources", [
    ([0, 1, 2, 3], [0], []),  # a replica on the reader's device: nothing moves
    ([1, 2, 3], [0], [1]),  # none there: the one on its node (NVLink), once
    ([2, 3], [0], [2]),  # none on its node: one of the others (0 % 2), once
    ([2, 3], [0, 1], [2, 3]),  # two readers spread over the two replicas (d % 2)
])
def test_a_replicated_box_is_read_from_one_replica(replicas, act, sources):
    M, K, N = 64, 32, 48
    g = replicated(chain_graph(M, K, N), "mm", replicas)
    g = retile(g, "act", [len(act), 1], act)
    low = Lowerer(HW4).lower(g)
    tr = np.nonzero(low.kind != 0)[0]
    assert sorted(low.dev[tr].tolist()) == sources  # before: every replica sent its box to every reader
    assert low.alloc[tr].sum() == M * N * 4 * len(sources) // len(act)
    _, rt, _, _ = reference(g, HW4)
    _, t, _, _ = decode(low)
    assert t == rt


@pytest.mark.parametrize("baseline", ["zero3-8", "zero3-8-recompute", "megatron-tp8-dp1", "data-parallel-8", "single-device"])
def test_the_program_order_of_a_lowering_is_topological(baseline):
    """``Lowered.topo_hint`` orders the nodes as the program does (each op's compute nodes, then
    the transfers and collectives of its output; a state's gathers and a weight's cast just
    before their first reader): every data edge and every control edge of the lookahead window
    points forward in it, on training steps with gathered states, bf16 casts of fp32 weights,
    reductions and collectives, so the simulator needs no topological pass of its own."""
    from costmodel.lookahead import fetch_readers, lookahead_edges
    from optimizer.search.baselines import baselines

    g = workloads.build("llama", mode="train", layers=4, d_model=64, heads=4, kv_heads=2, d_ff=128, vocab=50, seq=32,
                        batch=16, dtype="bfloat16")
    plan = baselines(g, 8)[baseline]
    low = Lowerer(PRESETS["h100-sxm-8"], collectives=True).lower(plan)
    hint = low.topo_hint
    n = low.kind.shape[0]
    assert sorted(hint.tolist()) == list(range(n))  # a permutation
    at = np.empty(n, np.int64)
    at[hint] = np.arange(n)
    src = np.repeat(np.arange(n), np.diff(low.succ_ptr))
    assert (at[src] < at[low.succ_idx]).all()
    for window in (4, 16):
        ctl_ptr, ctl_idx = lookahead_edges(low, plan, window)
        ctl_src = np.repeat(np.arange(n), np.diff(ctl_ptr))
        assert ctl_idx.size and (at[ctl_src] < at[ctl_idx]).all()
    assert (fetch_readers(low.flow, low.op_reads > 0) >= 0).any()  # casts fetched for their readers
    if baseline == "zero3-8":  # the gathers of the sharded states have no producer in the step
        assert (low.kind == 2).any()
