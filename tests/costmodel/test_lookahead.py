"""Control edges in the simulator and the bounded lookahead built from them.

Control edges gate a node's start (it may start once its control predecessor has started) and
never extend a buffer's lifetime; the lookahead bounds how far ahead of program order a device
runs, which is what makes activation recomputation save memory in the simulated schedule.
"""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.evaluate import Evaluator
from costmodel.lookahead import lookahead_edges, program_positions
from costmodel.simulate import SimulationError, csr_from_edges, simulate
from ir import workloads
from ir.rewrites.recompute import recompute_block


def _chain_and_side():
    """Device 0: a -> b (1 s each); c (3 s, 100 bytes) has no predecessor and feeds nothing."""
    kind = np.zeros(3, np.int8)
    dev = np.zeros(3, np.int32)
    dst = np.full(3, -1, np.int32)
    dur = np.array([1.0, 1.0, 3.0])
    ptr, idx = csr_from_edges(3, [0], [1])
    alloc = np.array([10.0, 10.0, 100.0])
    return kind, dev, dst, dur, ptr, idx, alloc


def test_control_edge_gates_start_but_keeps_buffers_short():
    kind, dev, dst, dur, ptr, idx, alloc = _chain_and_side()
    free = simulate(kind, dev, dst, dur, ptr, idx, alloc, np.zeros(1), 1)
    assert free.start[2] == 0.0 and free.peak_mem[0] == 120.0  # c has the highest rank: it runs first
    ctl_ptr, ctl_idx = csr_from_edges(3, [1], [2])  # c may start once b has started
    s = simulate(kind, dev, dst, dur, ptr, idx, alloc, np.zeros(1), 1, ctl_ptr=ctl_ptr, ctl_idx=ctl_idx)
    assert list(s.start) == [0.0, 1.0, 2.0] and s.makespan == 5.0
    # a's buffer is freed when b (its only data successor) finishes, not held for c.
    assert s.peak_mem[0] == 110.0


def test_control_cycle_is_refused():
    kind, dev, dst, dur, ptr, idx, alloc = _chain_and_side()
    ctl_ptr, ctl_idx = csr_from_edges(3, [1], [0])
    with pytest.raises(SimulationError, match="cycle"):
        simulate(kind, dev, dst, dur, ptr, idx, alloc, np.zeros(1), 1, ctl_ptr=ctl_ptr, ctl_idx=ctl_idx)


def test_program_order_is_topological_and_follows_insertion():
    step = workloads.build("gpt", mode="train", layers=2, d_model=8, heads=2, vocab=10, seq=4, batch=2)
    p = recompute_block(step, "l0.")
    pos = program_positions(p)
    for n, o in p.ops.items():
        for _, t in o.inputs:
            if t in p.producers:
                assert pos[p.producers[t]] < pos[n]
    # the recomputed copies come right before the backward reaches layer 0, long after its forward
    assert pos["l0.ff1.re"] > pos["loss.grad"] > pos["l0.ff1"]


def test_lookahead_makes_recomputation_save_memory():
    step = workloads.build("gpt", mode="train", layers=4, d_model=256, heads=4, vocab=1000, seq=256, batch=8)
    rec = step
    for i in range(4):
        rec = recompute_block(rec, f"l{i}.")
    peaks = {}
    for label, g in (("plain", step), ("recompute", rec)):
        low = Evaluator("h100-sxm-8")(g, keep=True).lowered
        for w in (0, 4):
            ctl = lookahead_edges(low, g, w)
            kw = {} if ctl is None else {"ctl_ptr": ctl[0], "ctl_idx": ctl[1]}
            s = simulate(low.kind, low.dev, low.dst, low.dur, low.succ_ptr, low.succ_idx, low.alloc, low.resident,
                         low.n_devices, lat=low.lat, link=low.link, part_ptr=low.part_ptr, part_dev=low.part_dev,
                         part_alloc=low.part_alloc, **kw)
            peaks[label, w] = s.peak_mem.max()
    assert peaks["recompute", 4] < 0.6 * peaks["plain", 4]  # checkpointing every layer pays
    assert peaks["recompute", 0] > 0.8 * peaks["plain", 0]  # unbounded: copies run early, no saving


def _first_readers_by_walk(g, names) -> np.ndarray:
    """The reference: per op fed by sources only, the position of its output's first reader in
    ``names``, found by walking the graph's consumers."""
    pos = {n: i for i, n in enumerate(names)}
    out = np.full(len(names), -1, np.int64)
    for i, n in enumerate(names):
        o = g.ops[n]
        if o.inputs and not any(t in g.producers for _, t in o.inputs):
            readers = [pos[r] for r, _port in g.consumers.get(o.output, ()) if r in pos]
            if readers:
                out[i] = min(readers)
    return out


@pytest.mark.parametrize("plan", ["mlp-forward", "gpt-zero3", "llama-3d-recompute"])
def test_fetch_readers_from_the_lowering_flow_equal_the_graph_walk(plan):
    """The vectorised first-reader positions (from ``Lowered.flow``) equal a walk over the
    graph's consumers, for forward programs, sharded state and recomputed pipelines."""
    from costmodel.lookahead import fetch_readers
    from costmodel.lowering import lower
    from costmodel.presets import preset
    from optimizer.search.baselines import megatron_3d, recompute_layers, zero3

    if plan == "mlp-forward":
        g = workloads.build("mlp", batch=64, widths=[32, 64, 32])
    elif plan == "gpt-zero3":
        g = zero3(workloads.build("gpt", mode="train", layers=2, d_model=64, heads=4, vocab=50, seq=32, batch=8,
                                  dtype="bfloat16"), 8)
    else:
        step = workloads.build("llama", mode="train", layers=4, d_model=64, heads=4, kv_heads=2, d_ff=128,
                               vocab=50, seq=32, batch=16, dtype="bfloat16")
        g = recompute_layers(megatron_3d(step, 8, 8))
    low = lower(g, preset("h100-sxm-8"))
    names = low.op_names
    walk = _first_readers_by_walk(g, names)
    flow = fetch_readers(low.flow, [bool(g.ops[n].inputs) for n in names])
    assert np.array_equal(flow, walk)
    if plan != "mlp-forward":  # bf16 weights' casts: fetched for their first reader, which comes later
        assert (walk >= 0).sum() >= 4 and (walk[walk >= 0] > np.nonzero(walk >= 0)[0]).all()


def _phase_by_walk(g, names) -> np.ndarray:
    """The reference: 1 for ``loss.grad``, a recomputed copy and every op reading an output of one."""
    from ir.rewrites.recompute import SUFFIX as RE

    back_t: set[str] = set()
    phase = np.zeros(len(names), np.int64)
    for i, n in enumerate(names):
        o = g.ops[n]
        if n == "loss.grad" or n.startswith("loss.grad.") or (n.endswith(RE) and n[:-len(RE)] in g.ops) \
                or any(t in back_t for _, t in o.inputs):
            phase[i] = 1
            back_t.add(o.output)
    return phase


def _barriers_by_walk(g, names, tagged: dict[str, int]):
    """The reference, producer by producer: (within, across, the untagged ops reached from tagged ones)."""
    reach: dict[str, int] = {}
    within = across = False
    for n in names:
        mask = direct = 0
        for _, t in g.ops[n].inputs:
            p = g.producers.get(t)
            if p is None:
                continue
            if p in tagged:
                direct |= 1 << tagged[p]
            else:
                mask |= reach.get(p, 0)
        if n in tagged:
            within |= bool(mask & (1 << tagged[n]))
            across |= tagged[n] == 1 and bool(mask & 1)
        elif mask | direct:
            reach[n] = mask | direct
    return within, across, np.array([n in reach for n in names])


@pytest.mark.parametrize("plan", ["gpt-zero3", "llama-3d", "llama-3d-recompute"])
def test_phases_and_barriers_from_the_lowering_flow_equal_the_graph_walk(plan):
    """The compiled passes over ``Lowered.flow`` equal walks over the graph: the backward phase of
    every op, and the barriers for the microbatched ops a pipeline tags, and for random tags."""
    from costmodel.lookahead import _struct_info, pipeline_units
    from costmodel.lowering import lower
    from costmodel.presets import preset
    from optimizer.search.baselines import megatron_3d, recompute_layers, zero3

    step = workloads.build("llama", mode="train", layers=4, d_model=64, heads=4, kv_heads=2, d_ff=128,
                           vocab=50, seq=32, batch=16, dtype="bfloat16")
    g = {"gpt-zero3": lambda: zero3(workloads.build("gpt", mode="train", layers=2, d_model=64, heads=4, vocab=50,
                                                    seq=32, batch=8, dtype="bfloat16"), 8),
         "llama-3d": lambda: megatron_3d(step, 8, 8),
         "llama-3d-recompute": lambda: recompute_layers(megatron_3d(step, 8, 8))}[plan]()
    low = lower(g, preset("h100-sxm-8"))
    names = low.op_names
    info = _struct_info(low, g)
    phase = info.op_phase(g)
    assert np.array_equal(phase, _phase_by_walk(g, names)) and 0 < phase.sum() < len(names)
    rng = np.random.default_rng(2)
    for density in (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 0.9, 1.0) * 2:
        tag = np.full(len(names), -1, np.int64)
        pick = rng.random(len(names)) < density
        tag[pick] = phase[pick]
        within, across, after = info.barriers(tag)
        ref = _barriers_by_walk(g, names, {names[i]: int(tag[i]) for i in np.nonzero(tag >= 0)[0]})
        assert (within, across) == ref[:2] and np.array_equal(after, ref[2])
    if plan != "gpt-zero3":
        assert pipeline_units(low, g) is not None  # the pipelines' own tags pass the barriers



def _window_edges_reference(low, g, window: int, skip):
    """The window's edges as NumPy array passes (the implementation ``_window_kernel`` replaced)."""
    nc = low.n_compute
    offs = np.asarray(low.op_offsets)
    from costmodel.lookahead import _struct_info

    info = _struct_info(low, g)
    op_pos = info.op_pos
    counts = np.diff(offs)
    node_pos = np.repeat(op_pos, counts)  # program position of each compute node's op
    dev = np.asarray(low.dev[:nc], np.int64).copy()
    if skip is not None:
        dev[skip] = low.n_devices  # a device of their own, never gating nor gated
    # ops fed by sources only (weights' casts: programs build them all first) are fetched just in
    # time: out of the window's order, each gated by the node `window` places before its first
    # reader (FSDP gathers a layer's weights a layer or so ahead, not the whole model at once)
    fetch_pos = np.repeat(info.fetch_reader, counts)
    fetch = np.nonzero((fetch_pos >= 0) & (dev < low.n_devices))[0]
    fetch_dev = dev[fetch]
    dev[fetch] = low.n_devices
    # by device, then program order: nodes are numbered in program order (op by op, ``op_pos`` is
    # the identity), so a stable sort on the device alone (a radix sort on int16 keys) gives it
    order = np.argsort(dev.astype(np.int16 if low.n_devices < 2**15 else np.int32), kind="stable")
    dev_sorted = dev[order]
    starts = np.searchsorted(dev_sorted, np.arange(low.n_devices + 2))
    rank = np.empty(nc, np.int64)  # rank of a compute node within its device's program order
    rank[order] = np.arange(nc) - starts[dev_sorted]
    src, dst = [], []
    same = np.nonzero((rank[order] >= window) & (dev_sorted < low.n_devices))[0]
    if same.size:
        src.append(order[same - window])
        dst.append(order[same])
    # Transfers without predecessors: gated by the node `window` places before their first reader.
    n = low.kind.shape[0]
    ptr, idx = low.succ_ptr, low.succ_idx
    indeg = np.bincount(idx, minlength=n)
    free = np.nonzero(indeg[nc:] == 0)[0] + nc  # point-to-point and collective (kind 2) gathers
    if free.size:
        counts = ptr[free + 1] - ptr[free]
        t_of = np.repeat(free, counts)
        lo = np.repeat(ptr[free], counts)
        within = np.arange(t_of.size) - np.repeat(np.cumsum(counts) - counts, counts)
        v = np.asarray(idx)[lo + within].astype(np.int64)
        keep = v < nc
        t_of, v = t_of[keep], v[keep]
        if t_of.size:
            o = np.lexsort((node_pos[v], t_of))  # per transfer, its reader earliest in program order first
            t_sorted, v_sorted = t_of[o], v[o]
            first = np.ones(t_sorted.size, bool)
            first[1:] = t_sorted[1:] != t_sorted[:-1]
            t_first, reader = t_sorted[first], v_sorted[first]
            r = rank[reader] - window
            ok = (r >= 0) & (dev[reader] < low.n_devices)
            if ok.any():
                src.append(order[starts[dev[reader[ok]]] + r[ok]])
                dst.append(t_first[ok])
    if fetch.size:  # on its own device: the windowed nodes before its first reader's position
        span = int(node_pos.max()) + 2  # (device, position) as one sortable key
        key = dev_sorted * span + node_pos[order]
        before = np.searchsorted(key, fetch_dev * span + fetch_pos[fetch]) - starts[fetch_dev]
        r = before - window
        ok = r >= 0
        if ok.any():
            src.append(order[starts[fetch_dev[ok]] + r[ok]])
            dst.append(fetch[ok])
    return src, dst


@pytest.mark.parametrize("plan", ["gpt-zero3", "llama-3d", "llama-3d-recompute", "walk"])
def test_the_window_kernel_equals_the_array_passes(plan):
    """``_window_kernel`` gives the edges the NumPy passes it replaced gave, with and without
    pipeline units to skip, on fixed plans and random walks. The kernel gives the window's own
    edges in source order (so that their CSR's counting sort writes in order), the passes by
    device: the same edges, compared as sets (the order of a node's control edges changes
    nothing in the schedule: each lowers an in-degree and raises a ready time by a max)."""
    from costmodel.lookahead import _window_edges, pipeline_units
    from costmodel.lowering import Lowerer
    from costmodel.presets import preset
    from ir.rewrites import RewriteError, random_rewrite
    from optimizer.search.baselines import megatron_3d, recompute_layers, zero3

    step = workloads.build("llama", mode="train", layers=4, d_model=64, heads=4, kv_heads=2, d_ff=128,
                           vocab=50, seq=32, batch=16, dtype="bfloat16")
    gpt = workloads.build("gpt", mode="train", layers=2, d_model=64, heads=4, vocab=50, seq=32, batch=8,
                          dtype="bfloat16")
    starts = {"gpt-zero3": [zero3(gpt, 8)], "llama-3d": [megatron_3d(step, 8, 8)],
              "llama-3d-recompute": [recompute_layers(megatron_3d(step, 8, 8))]}
    lowerer = Lowerer(preset("h100-sxm-8"), collectives=True)
    plans = starts.get(plan)
    if plans is None:
        rng = np.random.default_rng(6)
        g, plans = zero3(gpt, 8), []
        for _ in range(40):
            try:
                g, _m = random_rewrite(g, rng, 8, max_shards_per_op=16)
            except RewriteError:
                continue
            plans.append(g)
    for g in plans:
        low = lowerer.lower(g)
        pipe = pipeline_units(low, g)
        for skip in (None, pipe[0] >= 0 if pipe is not None else None):
            for window in (0, 1, 4, 16):
                a = _window_edges(low, g, window, skip)
                b = _window_edges_reference(low, g, window, skip)
                flat = [np.concatenate(x) if x else np.zeros(0, np.int64) for x in (*a, *b)]
                pairs_a = sorted(zip(flat[0].tolist(), flat[1].tolist()))
                pairs_b = sorted(zip(flat[2].tolist(), flat[3].tolist()))
                assert pairs_a == pairs_b and len(pairs_a) == flat[0].size


def _assert_same_microbatches(got: tuple, want: tuple) -> tuple[bool, bool]:
    """``got`` and ``want`` (each a plan's ``(_microbatch_of_nodes, pipeline_units)``) are equal;
    returns whether the plan is microbatched and whether it has pipeline units."""
    assert (got[0] is None) == (want[0] is None) and (got[1] is None) == (want[1] is None)
    if want[0] is not None:
        assert np.array_equal(got[0], want[0])
    if want[1] is not None:
        assert np.array_equal(got[1][0], want[1][0]) and got[1][1] == want[1][1]
    return want[0] is not None, want[1] is not None


def test_microbatch_facts_taken_from_earlier_plans_equal_those_found_afresh():
    """``_mb_facts`` reuses the facts of ops the last plans share with this one (same structure,
    another structure, another microbatch count); along walks that microbatch, stage, fuse and
    split reductions, the microbatch of every node and the pipeline units equal those of a
    lowerer and caches that never saw another plan."""
    from costmodel import lookahead as LA
    from costmodel.lowering import Lowerer
    from costmodel.presets import preset
    from ir.rewrites import RewriteError
    from optimizer.search.baselines import megatron_3d
    from optimizer.search.mutation import OPERATORS, MutationContext

    step = workloads.build("llama", mode="train", layers=4, d_model=32, heads=4, kv_heads=2, d_ff=64,
                           vocab=50, seq=16, batch=16)
    hw = preset("h100-sxm-64")
    warm = Lowerer(hw)
    rng = np.random.default_rng(11)
    ctx = MutationContext(n_devices=64, max_shards_per_op=64, devices_per_node=8)
    p0 = megatron_3d(step, 64)
    p, pipelines, microbatched = p0, 0, 0
    for i in range(40):
        try:
            child, _m = OPERATORS[("pipeline", "rewrite", "layout", "pipeline", "rewrite")[i % 5]](p, rng, ctx)
        except RewriteError:
            p = p0
            continue
        low = warm.lower(child)
        got = (LA._microbatch_of_nodes(low, child), LA.pipeline_units(low, child))
        saved = LA._MB_RECENT.copy()
        LA._MB_RECENT.clear()
        LA._STRUCT_INFO.clear()
        fresh_low = Lowerer(hw).lower(child)
        want = (LA._microbatch_of_nodes(fresh_low, child), LA.pipeline_units(fresh_low, child))
        LA._MB_RECENT.extend(saved)
        mb, pipe = _assert_same_microbatches(got, want)
        microbatched += mb
        pipelines += pipe
        p = child if rng.random() < 0.7 else p
    assert microbatched >= 15 and pipelines >= 10


def test_an_op_whose_microbatches_change_is_looked_at_again():
    """Children of one microbatched plan that each merge one op's batch pieces (that op is no
    longer microbatched, the others are): the facts of every other op come from the parent's,
    the merged op's are found again, and the result equals a fresh lowering's."""
    from costmodel import lookahead as LA
    from costmodel.lowering import Lowerer
    from costmodel.presets import preset
    from ir.rewrites import RewriteError, merge, parse_move
    from ir.rewrites.pipeline import batch_dims

    step = workloads.build("gpt", mode="train", layers=2, d_model=32, heads=2, vocab=50, seq=16, batch=16)
    plan = parse_move("pipeline{stages=2,group=4}; microbatch{ops=all,m=4}").apply(step)
    hw = preset("h100-sxm-8")
    warm = Lowerer(hw)
    base = LA._microbatch_of_nodes(warm.lower(plan), plan)
    assert base is not None and base.max() == 3
    changed = 0
    for name, (kind, col) in list(batch_dims(plan).items())[:40:3]:
        if kind != "dim":
            continue
        try:
            child = merge(plan, name, col)
        except RewriteError:
            continue
        warm.lower(plan)  # the parent's facts are the last ones
        LA._microbatch_of_nodes(warm.lower(plan), plan)
        got = LA._microbatch_of_nodes(warm.lower(child), child)
        saved = LA._MB_RECENT.copy()
        LA._MB_RECENT.clear()
        LA._STRUCT_INFO.clear()
        fresh = Lowerer(hw)
        want = LA._microbatch_of_nodes(fresh.lower(child), child)
        LA._MB_RECENT.extend(saved)
        assert np.array_equal(got, want)
        changed += not np.array_equal(want, base)
    assert changed >= 3


def test_the_control_edges_csr_keeps_each_nodes_edges_in_input_order():
    from costmodel.lookahead import _csr

    rng = np.random.default_rng(2)
    for n, m in ((1, 0), (5, 12), (300, 2000)):
        src, dst = rng.integers(0, n, m), rng.integers(0, n, m)
        ptr, idx = _csr(n, src, dst)
        order = np.argsort(src, kind="stable")  # the reference: a stable sort by source
        assert ptr.tolist() == [0] + np.cumsum(np.bincount(src, minlength=n)).tolist()
        assert idx.dtype == np.int32 and idx.tolist() == dst[order].tolist()


def test_ops_with_several_nodes_on_a_device_equal_a_count_per_op_and_device():
    from costmodel.lookahead import _multi
    from costmodel.lowering import Lowerer
    from costmodel.presets import preset
    from ir.rewrites import RewriteError, random_rewrite

    g = workloads.build("gpt", mode="train", layers=2, d_model=32, heads=2, vocab=50, seq=16, batch=16)
    lowerer, rng, seen = Lowerer(preset("h100-sxm-8")), np.random.default_rng(4), 0
    for _ in range(30):
        try:
            g, _m = random_rewrite(g, rng, 8, max_shards_per_op=16)
        except RewriteError:
            continue
        low = lowerer.lower(g)
        counts = np.diff(np.asarray(low.op_offsets))
        per = np.zeros((len(counts), low.n_devices), np.int64)
        np.add.at(per, (np.repeat(np.arange(len(counts)), counts), low.dev[:low.n_compute]), 1)
        assert _multi(low).tolist() == (per.max(axis=1) > 1).tolist()
        seen += int((per.max(axis=1) > 1).any())
    assert seen >= 10


@pytest.mark.slow  # 18 s of random walks, checked against the batch flow: CI's test-slow runs it
def test_the_two_starts_check_answers_as_the_batch_flow_would(monkeypatch):
    """``_microbatch_parts`` says "not microbatched" without the batch flow where no op has two
    starts a device in any dim. ``_two_starts`` is ``_shard_starts``' test over every dim, and
    along walks of random moves (splits that put two shards of an op on a device, microbatching,
    pipelines) the microbatches and pipeline units equal those found with the check off."""
    from costmodel import lookahead as LA
    from costmodel.lowering import Lowerer
    from costmodel.presets import preset
    from ir.rewrites import RewriteError, random_rewrite
    from ir.mesh import Mesh
    from ir.rewrites.layout import layout
    from optimizer.search.mutation import OPERATORS, MutationContext

    step = workloads.build("llama", mode="train", layers=4, d_model=64, heads=4, kv_heads=2, d_ff=128,
                           vocab=64, seq=64, batch=16)
    hw = preset("h100-sxm-64")
    rng = np.random.default_rng(5)
    ctx = MutationContext(n_devices=64, max_shards_per_op=64, devices_per_node=8)
    p0 = layout(step, "all", Mesh((8, 8), 8), ("b", "t"))
    p, early, found = p0, 0, 0
    for i in range(60):
        try:
            if i % 4 == 3:  # a pipeline now and then (the walk goes on from the plan before it)
                child, _m = OPERATORS["pipeline"](p, rng, ctx)
            else:
                child, _m = random_rewrite(p, rng, 64, max_shards_per_op=64)
        except RewriteError:
            p = p0
            continue
        for o in list(child.ops.values())[::7]:
            rank = o.shards.lo.shape[1]
            assert LA._two_starts(o) == any(LA._shard_starts(o, c)[0] for c in range(rank))
        low = Lowerer(hw).lower(child)
        got = (LA._microbatch_of_nodes(low, child), LA.pipeline_units(low, child))
        multi = LA._multi(low)
        early += bool(multi.any()) and not any(LA._two_starts(child.ops[n]) for n, m in zip(low.op_names, multi) if m)
        with monkeypatch.context() as m:
            m.setattr(LA, "_two_starts", lambda o: True)
            LA._MB_RECENT.clear()
            LA._STRUCT_INFO.clear()
            fresh = Lowerer(hw).lower(child)
            want = (LA._microbatch_of_nodes(fresh, child), LA.pipeline_units(fresh, child))
        found += _assert_same_microbatches(got, want)[0]
        p = child if i % 4 != 3 and rng.random() < 0.7 else p
    assert early >= 10 and found >= 5
