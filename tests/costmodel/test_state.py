"""Loop-carried state in the lowering: a state lives where its next value's producer writes it;
reading it elsewhere is a transfer (FSDP's all-gather); its home is resident memory; the next value
replaces it. Hand-built graphs checked against closed forms."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.lowering import Lowerer
from costmodel.presets import PRESETS
from costmodel.transfers import transfer_plan
from ir.builder import GraphBuilder
from ir.graph import Graph, Tensor, next_name
from ir.rewrites import place, retile, split

HW8 = PRESETS["h100-sxm-8"]
M, K, N = 64, 32, 48
F4 = 4  # float32 bytes


def rename(g: Graph, old: str, new: str, role: str | None = None) -> Graph:
    """``g`` with tensor ``old`` renamed (and its role changed), readers and producer rewired."""
    tensors = {}
    for n, t in g.tensors.items():
        if n == old:
            tensors[new] = Tensor(new, t.shape, t.dtype, role or t.role)
        else:
            tensors[n] = t
    ops = {}
    for n, o in g.ops.items():
        ins = tuple((p, new if t == old else t) for p, t in o.inputs)
        ops[n] = o.replace(inputs=ins, output=new if o.output == old else o.output)
    return Graph(tensors, ops)


def step(update: str = "sub") -> Graph:
    """y = x @ W; W.next = W - d (an update op reading W at home)."""
    b = GraphBuilder()
    x, W, d = b.input("x", (M, K)), b.parameter("W", (K, N)), b.input("d", (K, N))
    b.matmul(x, W, name="mm")
    getattr(b, update)(W, d, name="upd")
    g = b.build()
    return rename(g, "upd.out", next_name("W"), "output")


def fsdp(g: Graph, parts: int = 4) -> Graph:
    """matmul split by rows over devices 0..parts-1, the update split by rows of W the same way."""
    g = place(split(g, "mm", 0, parts), "mm", list(range(parts)))
    return place(split(g, "upd", 0, parts), "upd", list(range(parts)))


def test_carried_is_declared():
    assert step().carried == {"W": "W.next"}


def test_sharded_state_read_everywhere_is_an_all_gather():
    p = 4
    g = fsdp(step(), p)
    low = Lowerer(HW8, collectives=False).lower(g)  # point to point (the collective form: test_collectives)
    nc = low.n_compute
    tb = low.alloc[nc:]
    # each of the p matmul shards reads all of W; it holds 1/p of it: p*(p-1) transfers of K/p rows
    assert len(tb) == p * (p - 1)
    assert np.all(tb == K // p * N * F4)
    assert tb.sum() == (p - 1) * K * N * F4
    # state transfers have no predecessor: nothing points at them
    preds = np.zeros(len(low.kind), np.int64)
    np.add.at(preds, low.succ_idx, 1)
    assert np.all(preds[nc:] == 0)
    # resident: own rows of x, own rows of d (read by the update), the home of W
    want = (M // p * K + K // p * N + K // p * N) * F4
    assert np.array_equal(low.resident[:p], np.full(p, want, float)) and not low.resident[p:].any()
    # the update writes in place: its shards allocate nothing; the matmul shards their outputs
    upd = list(low.op_names).index("upd")
    a, z = low.op_offsets[upd], low.op_offsets[upd + 1]
    assert not low.alloc[a:z].any()
    mm = list(low.op_names).index("mm")
    assert np.all(low.alloc[low.op_offsets[mm]:low.op_offsets[mm + 1]] == M // p * N * F4)


def test_state_at_home_is_free_and_counted_once():
    g = step()  # everything on device 0
    low = Lowerer(HW8).lower(g)
    assert low.n_transfer == 0
    assert low.resident[0] == (M * K + K * N + K * N) * F4  # x, d and W (W.next replaces W)
    ev = Evaluator(HW8)(g)
    # peak memory = resident + the matmul's output; the next value adds nothing
    assert ev.peak_memory == (M * K + 2 * K * N + M * N) * F4


def test_state_home_elsewhere_costs_time():
    g = place(step(), "upd", [1])  # W lives on device 1, the matmul runs on device 0
    low = Lowerer(HW8).lower(g)
    assert low.n_transfer == 1 and low.alloc[low.n_compute] == K * N * F4
    assert low.dev[low.n_compute] == 1 and low.dst[low.n_compute] == 0
    ev = Evaluator(HW8)(g, keep=True)
    s = ev.schedule
    t = low.n_compute
    assert s.start[t] == 0.0
    assert s.finish[t] == pytest.approx(K * N * F4 / HW8.intra_link.bandwidth + HW8.intra_link.latency, rel=1e-12)
    mm = low.op_offsets[list(low.op_names).index("mm")]
    assert s.start[mm] >= s.finish[t]
    # forward-only: the same weight without a next value is resident where read, for free
    fwd = rename(step(), "W.next", "W2", "output")
    assert fwd.carried == {}
    low2 = Lowerer(HW8).lower(place(fwd, "upd", [1]))
    assert low2.n_transfer == 0 and low2.resident[1] == 2 * K * N * F4


def test_state_sharded_differently_from_its_readers():
    """W's home split by columns over 2 devices, the matmul by rows over 4 others: every matmul
    shard gathers both halves (2 transfers of K*N/2 each)."""
    g = step()
    g = place(split(g, "mm", 0, 4), "mm", [4, 5, 6, 7])
    g = place(split(g, "upd", 1, 2), "upd", [0, 1])
    low = Lowerer(HW8, collectives=False).lower(g)
    tb = low.alloc[low.n_compute:]
    assert len(tb) == 8 and np.all(tb == K * N // 2 * F4)
    assert sorted(zip(low.dev[low.n_compute:].tolist(), low.dst[low.n_compute:].tolist())) == sorted(
        (s, d) for s in (0, 1) for d in (4, 5, 6, 7))
    assert low.resident[0] == low.resident[1] == (K * N // 2 + K * N // 2) * F4  # home of W + read of d


def test_transfer_plan_lists_state_transfers_in_the_lowerings_order():
    g = place(split(step(), "mm", 0, 4), "mm", [4, 5, 6, 7])
    g = place(split(g, "upd", 1, 2), "upd", [0, 1])
    low = Lowerer(HW8, collectives=False).lower(g)
    tp = transfer_plan(g, HW8)
    allt = tp.transfers + tp.state_transfers
    nc = low.n_compute
    assert len(tp.state_transfers) == 8 and all(t["tensor"] == "W" for t in tp.state_transfers)
    assert np.array_equal(low.alloc[nc:], [t["bytes"] for t in allt])
    assert np.array_equal(low.dev[nc:], [t["src"] for t in allt])
    assert np.array_equal(low.dst[nc:], [t["dst"] for t in allt])
    assert np.array_equal(tp.resident_bytes(), low.resident)
    homes = {(r["device"], tuple(map(tuple, r["boxes"]))) for r in tp.residency if r["tensor"] == "W"}
    assert homes == {(0, (((0, 0), (K, N // 2)),)), (1, (((0, N // 2), (K, N)),))}


def test_incremental_equals_fresh_with_state():
    from tests.costmodel.test_lowering import assert_same

    for coll in (True, False):
        rng = np.random.default_rng(3)
        inc = Lowerer(HW8, states=3, collectives=coll)
        g = step()
        for _ in range(40):
            op = ["mm", "upd"][int(rng.integers(2))]
            parts = [int(rng.choice([1, 2, 4])), int(rng.choice([1, 2]))]
            devs = rng.integers(0, 8, size=parts[0] * parts[1]).tolist()
            g = retile(g, op, parts, devs)
            assert_same(inc.lower(g), Lowerer(HW8, collectives=coll).lower(g))
        assert inc.stats["incremental"] > 20


def test_model_flops_and_mfu_by_hand():
    g = step()  # one device: matmul 2*M*K*N FLOPs, the update K*N
    ev = Evaluator(HW8)(g)
    flops = 2 * M * K * N + K * N
    assert ev.model_flops == flops
    assert ev.devices == 1
    assert ev.mfu == pytest.approx(flops / HW8.peak_flops("float32") / ev.makespan, rel=1e-12)
    # spreading over 4 devices keeps the model FLOPs; MFU divides by the 4 devices' peak
    e4 = Evaluator(HW8)(fsdp(g, 4))
    assert e4.model_flops == flops and e4.devices == 4
    assert e4.mfu == pytest.approx(flops / HW8.peak_flops("float32") / (4 * e4.makespan), rel=1e-12)
    assert 0 < e4.mfu < 1 and 0 < ev.mfu < 1


def test_memory_floor_refuses_state_that_cannot_fit_fully_sharded():
    b = GraphBuilder()
    Kb, Nb = 400_000, 500_000  # 2e11 float32 cells: 800 GB of state, 100 GB per device on 8
    b.matmul(b.input("x", (1, Kb)), b.parameter("W", (Kb, Nb)), name="mm")
    b.sub("W", b.input("d", (Kb, Nb)), name="upd")
    g = rename(b.build(), "upd.out", "W.next", "output")
    g = place(split(g, "upd", 0, 8), "upd", list(range(8)))
    ev = Evaluator(HW8)(g)
    assert ev.memory_floor == Kb * Nb * F4 / 8 == 100e9
    assert not ev.feasible
    # the same state as a forward-only weight has no floor
    fwd = rename(b.build(), "upd.out", "W2", "output")
    assert Evaluator(HW8)(fwd).memory_floor == 0.0


def test_sizes_that_would_overflow_are_refused():
    from costmodel.lowering import PlanSizeError, check_op_size, check_sizes, check_tensor_size
    from ir import workloads
    from ir.workloads import WorkloadError

    # the IR refuses the 1e11-wide MLP already (it gave a negative peak memory before)
    with pytest.raises(WorkloadError, match="cells"):
        workloads.build("mlp", batch=64, widths=[int(1e11)] * 3)
    with pytest.raises(PlanSizeError, match="'W'"):
        check_tensor_size(Tensor("W", (2**26, 2**25), "float32"))  # 2**53 bytes
    check_tensor_size(Tensor("W", (2**26, 2**25 - 1), "float32"))
    with pytest.raises(PlanSizeError, match="'big'"):
        check_op_size("big", (2**27, 2**26))
    check_sizes(step())
    # just below the limits, bytes are counted exactly
    ok = workloads.build("mlp", batch=2, widths=[2**20, 2**20, 2])
    ev = Evaluator(HW8)(ok)
    assert ev.peak_memory >= 2**40 * 4 + 2**21 * 4  # W1 and W2 resident, positive and exact
    assert ev.peak_memory < 2**53
