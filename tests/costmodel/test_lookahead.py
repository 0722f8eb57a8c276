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
    from costmodel.lookahead import _fetch_readers
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
    flow = _fetch_readers(low.flow, [bool(g.ops[n].inputs) for n in names])
    assert np.array_equal(flow, walk)
    if plan != "mlp-forward":  # bf16 weights' casts: fetched for their first reader, which comes later
        assert (walk >= 0).sum() >= 4 and (walk[walk >= 0] > np.nonzero(walk >= 0)[0]).all()
