"""The pipeline's point-to-point transfers in unit order on each port (``lookahead._port_order_edges``,
a compiled kernel) against a plain-Python reading of its rule, on pipelined plans with tensor
parallelism inside the stages and after random moves."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.lookahead import _microbatch_of_nodes, _port_order_edges, _struct_info, pipeline_units
from ir import workloads
from ir.layers import LAYER_RE
from ir.rewrites import RewriteError, random_rewrite
from optimizer.search.baselines import megatron_3d

TINY = dict(d_model=32, heads=4, kv_heads=2, d_ff=64, vocab=64, seq=8, batch=8, mode="train")


def _walk(g, n: int, seed: int, steps: int) -> list:
    """``g`` and the plans of a walk of ``steps`` random moves from it (moves that do not apply
    are skipped)."""
    rng = np.random.default_rng(seed)
    plans, q = [g], g
    for _ in range(steps):
        try:
            q, _move = random_rewrite(q, rng, n)
        except RewriteError:
            continue
        plans.append(q)
    return plans


def _stages(low, g) -> dict[int, int]:
    """Device -> the program position of its first microbatched forward op, among the layers of
    which it holds at least half as many microbatched forward nodes as of its busiest layer (the
    ops outside the layers as one layer more); devices of one stage share it."""
    op_of = np.repeat(np.arange(len(low.op_offsets) - 1), np.diff(low.op_offsets))
    info = _struct_info(low, g)
    phase = info.op_phase(g)
    mb = _microbatch_of_nodes(low, g)
    nodes: dict[int, list[int]] = {}  # device -> its microbatched forward nodes
    for i in range(low.n_compute):
        if mb[i] >= 0 and phase[op_of[i]] == 0:
            nodes.setdefault(int(low.dev[i]), []).append(i)
    first: dict[int, int] = {}
    for d, mine in nodes.items():
        layer = [LAYER_RE.match(low.op_names[op_of[i]]) for i in mine]
        layer = [int(m.group(1)) if m else -1 for m in layer]
        per = {k: layer.count(k) for k in set(layer)}
        busiest = max(per.values())
        first[d] = min(int(info.op_pos[op_of[i]]) for i, k in zip(mine, layer) if 2 * per[k] >= busiest)
    return first


def _reference(low, g, unit: np.ndarray) -> tuple[list[int], list[int]]:
    """On each ingress port, a transfer after those whose earliest reader unit is earlier (readers
    all in units); on each egress port, by its producer's unit (a producer in a unit); ties by the
    producer's program position, then node number; an edge between neighbours on a port. Only
    transfers between devices of different stages (``_stages``)."""
    nc, n = low.n_compute, low.kind.shape[0]
    op_of = np.repeat(np.arange(len(low.op_offsets) - 1), np.diff(low.op_offsets))
    pos = _struct_info(low, g).op_pos
    stage = _stages(low, g)
    link = np.zeros(n, np.int64) if low.link is None else low.link
    producer: dict[int, int] = {}
    for i in range(nc):
        for v in low.succ_idx[low.succ_ptr[i]:low.succ_ptr[i + 1]]:
            if low.kind[v] == 1:
                producer[int(v)] = i
    src: list[int] = []
    dst: list[int] = []
    for side in ("ingress", "egress"):
        rows = []
        for t in range(nc, n):
            if low.kind[t] != 1 or stage.get(int(low.dev[t]), -1) == stage.get(int(low.dst[t]), -1):
                continue
            readers = [int(r) for r in low.succ_idx[low.succ_ptr[t]:low.succ_ptr[t + 1]] if r < nc]
            p = producer.get(t)
            if side == "ingress":
                if not readers or any(unit[r] < 0 for r in readers):
                    continue
                port, u = int(low.dst[t]) * 2 + int(link[t]), min(int(unit[r]) for r in readers)
            else:
                if p is None or unit[p] < 0:
                    continue
                port, u = int(low.dev[t]) * 2 + int(link[t]), int(unit[p])
            rows.append((port, u, int(pos[op_of[p]]) if p is not None else 0, t))
        rows.sort()
        for a, b in zip(rows, rows[1:]):
            if a[0] == b[0]:
                src.append(a[3])
                dst.append(b[3])
    return src, dst


# llama on 64 GPUs (14 s, the slowest) runs with CI's test-slow; gpt on 64 keeps the 64-GPU form in make test
_SLOW64 = pytest.param("llama", 64, {}, marks=pytest.mark.slow, id="llama-64-kw2")


@pytest.mark.parametrize("family,n,kw", [("llama", 8, {}), ("gpt", 8, dict(pp=4)), _SLOW64,
                                         ("gpt", 64, dict(pp=2, m=4))])
def test_port_order_edges_follow_the_rule(family, n, kw):
    ev = Evaluator(f"h100-sxm-{n}")
    plans = _walk(megatron_3d(workloads.build(family, layers=4, **TINY), n, **kw), n, seed=n, steps=8)
    checked = 0
    for p in plans:
        low = ev.lowerer.lower(p)
        units = pipeline_units(low, p)
        if units is None:
            continue
        assert units.stage.tolist() == [_stages(low, p).get(d, -1) for d in range(n)]
        s, d = _port_order_edges(low, p, units[0], units.stage)
        ref_s, ref_d = _reference(low, p, units[0])
        assert s.dtype == np.int64 and d.dtype == np.int64
        assert s.tolist() == ref_s and d.tolist() == ref_d
        checked += 1
        assert len(ref_s) > 0
    assert checked >= 1


def test_port_order_sorts_agree():
    """The kernel's two ways of ordering a port's transfers (counting sorts where keys are dense,
    else merge sorts per port) give the same edges."""
    from costmodel.lookahead import _port_order_kernel

    g = megatron_3d(workloads.build("llama", layers=4, **TINY), 64)
    low = Evaluator("h100-sxm-64").lowerer.lower(g)
    units = pipeline_units(low, g)
    unit = units[0]
    args = (low.n_compute, low.kind, np.asarray(low.succ_ptr, np.int64), low.succ_idx, low.dev, low.dst,
            low.link, np.asarray(low.op_offsets, np.int64), _struct_info(low, g).op_pos, unit,
            units.stage)
    a, b = _port_order_kernel(*args), _port_order_kernel(*args, False)
    assert a[0].size > 100 and np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("family,n,kw", [("llama", 8, dict(pp=4)), ("llama", 64, dict(pp=4)), ("gpt", 64, dict(pp=4))])
def test_tensor_parallel_pipelines_keep_the_port_order(family, n, kw):
    """Megatron 3D plans (tensor parallelism inside each stage) get the unit chain and the port
    order together, and the port order joins only transfers between stages. Ordering the
    transfers among a stage's own devices too (a partial sum made in a late unit on one peer and
    read by an early-unit accumulate on another) closed a cycle in every such plan, and the port
    order was dropped."""
    from costmodel.lookahead import _acyclic, _unit_chain_edges, lookahead_edges

    g = megatron_3d(workloads.build(family, layers=4, **TINY), n, **kw)
    low = Evaluator(f"h100-sxm-{n}").lowerer.lower(g)
    units = pipeline_units(low, g)
    cs, cd = _unit_chain_edges(low, g, units[0])
    ts, td = _port_order_edges(low, g, units[0], units.stage)
    assert ts.size > 0
    assert _acyclic(low, np.concatenate([cs, ts]), np.concatenate([cd, td]))
    stage = units.stage
    assert len(np.unique(stage)) == kw["pp"]
    ends = np.concatenate([ts, td])
    assert np.all(stage[low.dev[ends]] != stage[low.dst[ends]])
    ctl_ptr, _ctl_idx = lookahead_edges(low, g)
    assert ctl_ptr[-1] >= len(cs) + len(ts)  # lookahead_edges kept both (and the window's)


def test_one_moved_shard_keeps_its_devices_stage():
    """A search's ``move`` of one forward shard of the first stage onto a device of the last
    leaves every device's stage as it was: the device holds too little of that op to count it.
    Before, the device became a stage of its own, with a 1F1B order unlike its tensor-parallel
    peers', and the cycle through their exchanges dropped the pipeline order."""
    from costmodel.lookahead import _acyclic, _unit_chain_edges
    from ir.rewrites.shard import move

    g = megatron_3d(workloads.build("llama", layers=4, **TINY), 64, pp=2)
    ev = Evaluator("h100-sxm-64")
    low = ev.lowerer.lower(g)
    before = pipeline_units(low, g).stage
    o = g.ops["l0.resid1"]
    moved = move(g, "l0.resid1", 1, 40)  # l0 is on the first stage's devices 0-31
    assert o.shards.device[1] < 32
    low2 = ev.lowerer.lower(moved)
    units = pipeline_units(low2, moved)
    assert np.array_equal(units.stage, before)
    assert _acyclic(low2, *_unit_chain_edges(low2, moved, units[0]))


def _chain_reference(low, unit: np.ndarray) -> tuple[list[int], list[int]]:
    """Per device, its pipeline nodes grouped by unit (ascending) in node order: every node of a
    group to the first node of the device's next group, then each group's first node to its
    other nodes."""
    groups: dict[int, dict[int, list[int]]] = {}
    for i in range(low.n_compute):
        if unit[i] >= 0:
            groups.setdefault(int(low.dev[i]), {}).setdefault(int(unit[i]), []).append(i)
    src: list[int] = []
    dst: list[int] = []
    for d in sorted(groups):
        units = [groups[d][u] for u in sorted(groups[d])]
        for a, b in zip(units, units[1:]):
            src += a
            dst += [b[0]] * len(a)
    for d in sorted(groups):
        for u in sorted(groups[d]):
            nodes = groups[d][u]
            src += [nodes[0]] * (len(nodes) - 1)
            dst += nodes[1:]
    return src, dst


def _units_reference(low, g, policy: str) -> np.ndarray:
    """Each compute node's unit from an explicit table per device: GPipe F0..F(m-1) B0..B(m-1);
    1F1B ``w = min(p - s - 1, m)`` warm-up forwards, then one forward and one backward; the
    drain's nodes (untagged, computed from the pipeline) at 2m."""
    info = _struct_info(low, g)
    phase = info.op_phase(g)
    mb = _microbatch_of_nodes(low, g)
    op_of = np.repeat(np.arange(len(low.op_offsets) - 1), np.diff(low.op_offsets))
    stage = _stages(low, g)
    ids = sorted(set(stage.values()))
    p = len(ids)
    m_dev = {}
    for i in range(low.n_compute):
        if mb[i] >= 0:
            d = int(low.dev[i])
            m_dev[d] = max(m_dev.get(d, 0), int(mb[i]) + 1)
    unit = np.full(low.n_compute, -1, np.int64)
    for i in range(low.n_compute):
        if mb[i] < 0:
            continue
        d = int(low.dev[i])
        m = m_dev[d]
        s = ids.index(stage[d]) if d in stage else p - 1
        seq = [(0, j) for j in range(m)] + [(1, j) for j in range(m)]
        if policy == "1f1b":
            w = min(p - s - 1, m)
            seq = [(0, j) for j in range(w)]
            for k in range(m):
                if k + w < m:
                    seq.append((0, k + w))
                seq.append((1, k))
        unit[i] = seq.index((int(phase[op_of[i]]), int(mb[i])))
    return unit


@pytest.mark.parametrize("family,n,kw", [("llama", 8, dict(pp=4)), ("gpt", 8, dict(pp=4)),
                                         ("llama", 64, dict(pp=4)), ("gpt", 64, dict(pp=2, m=4))])
def test_units_and_their_chain_follow_the_rule(family, n, kw):
    """``pipeline_units``' closed-form units (``_units_kernel``) against explicit 1F1B and GPipe
    tables per device, and the unit chain (``_unit_chain_kernel``, a counting sort) against a
    grouping in plain Python, on 3D plans after random moves."""
    from costmodel.lookahead import _unit_chain_edges

    ev = Evaluator(f"h100-sxm-{n}")
    plans = _walk(megatron_3d(workloads.build(family, layers=4, **TINY), n, **kw), n, seed=n + 1, steps=10)
    checked = 0
    for p in plans:
        low = ev.lowerer.lower(p)
        for policy in ("1f1b", "gpipe"):
            units = pipeline_units(low, p, policy)
            if units is None:
                continue
            unit = units[0]
            ref = _units_reference(low, p, units[1])
            tagged = ref >= 0
            assert np.array_equal(unit[tagged], ref[tagged])
            assert np.all((unit[~tagged] == -1) | (unit[~tagged] >= 2))  # outside, or the drain
            s, d = _unit_chain_edges(low, p, unit)
            ref_s, ref_d = _chain_reference(low, unit)
            assert s.tolist() == ref_s and d.tolist() == ref_d
            checked += 1
    assert checked >= 2
