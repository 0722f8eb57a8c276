"""Pipeline schedules in the simulator: a plan of ``p`` equal stages and ``m`` microbatches has
the bubble of the closed form ``(p - 1) / (m + p - 1)`` (GPipe, Huang et al. 2019; 1F1B,
Narayanan et al. 2021), communication adds one stage-to-stage hop per stage boundary each way,
1F1B keeps fewer activations alive than GPipe, and a microbatched plan runs faster than the same
stages without microbatches."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.evaluate import Evaluator
from costmodel.hardware import Hardware, LinkSpec
from costmodel.hardware_io import load_hardware
from costmodel.lookahead import _microbatch_of_nodes, lookahead_edges, pipeline_units
from ir.autodiff.step import training_step
from ir.builder import GraphBuilder
from ir.rewrites import parse_move


def _chain(p: int, k: int, batch: int, d: int, d_in: int = 64, frozen: bool = False):
    """``x[batch, d_in] -> inp -> l0.fc -> ... -> l{pk-1}.fc``: ``p·k`` equal matmul layers (no
    bias: every stage's backward is the same work), a small input projection on stage 0 so that
    stage 0 also computes its input gradient. ``frozen``: the layers' weights are inputs, not
    parameters, so a stage's backward is its input gradient alone."""
    b = GraphBuilder("bfloat16")
    h = b.matmul(b.input("x", (batch, d_in)), b.parameter("W_in", (d_in, d)), name="inp")
    for i in range(p * k):
        w = b.input(f"l{i}_W", (d, d)) if frozen else b.parameter(f"l{i}_W", (d, d))
        h = b.matmul(h, w, name=f"l{i}.fc")
    return b.build()


def _hw(link_speed: float, contention: float | None = None) -> Hardware:
    """h100-sxm-8 with NVLink ``link_speed`` times as fast (bandwidth times, latency divided by
    it): 1e4 makes point-to-point transfers negligible (~1 ns for a microbatch's activations)."""
    hw = load_hardware("h100-sxm-8")
    link = hw.intra_link
    hw = hw.replace(intra_link=LinkSpec(link.bandwidth * link_speed, link.latency / link_speed,
                                        link.energy_per_byte))
    return hw if contention is None else hw.replace(contention=contention)


def _pipelined_step(p: int, m: int, d: int, frozen: bool = False, k: int = 2, batch: int = 2048):
    step = training_step(_chain(p, k, batch, d, frozen=frozen), loss="mse", optimizer="sgd")
    return parse_move(f"pipeline{{stages={p},group=1}}; microbatch{{ops=all,m={m}}}").apply(step)


def _span(low, s, plan) -> float:
    t = np.nonzero(_microbatch_of_nodes(low, plan) >= 0)[0]
    return float(s.finish[t].max() - s.start[t].min())


def _hop(low) -> float:
    """Seconds of one stage-to-stage transfer (latency + bytes / bandwidth; all are alike here)."""
    tr = np.arange(low.n_compute, low.kind.shape[0])
    tr = tr[low.kind[tr] == 1]
    return float(np.median(low.dur[tr] + low.lat[tr]))


def _op_of_nodes(low) -> np.ndarray:
    return np.repeat(np.arange(len(low.op_names)), np.diff(np.asarray(low.op_offsets)))


def _schedule(plan, policy: str, hw: str | Hardware = "h100-sxm-8"):
    ev = Evaluator(hw)
    low = ev.lowerer.lower(plan)
    return low, low.simulate(lookahead_edges(low, plan, 16, policy)), pipeline_units(low, plan, policy)


def _bubble(low, s, plan, p: int) -> float:
    """1 - (busy seconds of the microbatched nodes per stage) / (their span): the optimizer
    step after the pipeline drains is not part of the bubble."""
    t = np.nonzero(_microbatch_of_nodes(low, plan) >= 0)[0]
    span = s.finish[t].max() - s.start[t].min()
    busy = np.bincount(low.dev[t], weights=low.dur[t], minlength=p)[:p]
    return 1.0 - busy.mean() / span


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 8)])
def test_gpipe_forward_bubble_matches_closed_form(p, m):
    plan = parse_move(f"pipeline{{stages={p},group=1}}; microbatch{{ops=all,m={m}}}").apply(_chain(p, 4, 256, 8192))
    low, s, (unit, used) = _schedule(plan, "auto")
    assert used == "gpipe"  # forward only
    closed = (p - 1) / (m + p - 1)
    assert _bubble(low, s, plan, p) == pytest.approx(closed, rel=0.10)
    # whole-plan view too: idle share of the stages' devices over the makespan
    assert 1 - s.busy_compute[:p].mean() / s.makespan == pytest.approx(closed, rel=0.10)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_training_bubble_lies_between_the_closed_forms(p, m):
    """Forward + backward on h100-sxm-8 as it is (transfers and contention included): with an
    atomic backward ``t_b`` the bubble is (p-1)/(m+p-1), for GPipe and 1F1B alike. The simulator
    is finer: a stage sends its input gradient (``da``) before it computes its weight gradients
    (``db``), so the upstream stage starts earlier and only ``t_f + t_da`` (here ``t_b / 2``, with
    ``t_b = 2 t_f``) per stage lies on the ramp."""
    plan = _pipelined_step(p, m, 8192)
    closed = (p - 1) / (m + p - 1)
    finer = 2 * (p - 1) / (3 * m + 2 * (p - 1))  # ramp (p-1)(t_f + t_b/2) over m(t_f + t_b) + ramp
    bubbles = {}
    for policy in ("gpipe", "1f1b"):
        low, s, (unit, used) = _schedule(plan, policy)
        assert used == policy
        bubbles[policy] = bubble = _bubble(low, s, plan, p)
        # measured (h100-sxm-8): gpipe 0.160 (2,4), 0.229 (4,8); 1f1b 0.160, 0.231 (0.329 at
        # (4,8) before transfers kept the pipeline order on each port: lookahead._port_order_edges)
        assert finer * 0.95 <= bubble <= closed * 1.10, (policy, bubble)
    # the weight gradients (t_db = t_b/2 > 2 hops) hide 1F1B's steady-state round trip
    assert bubbles["1f1b"] == pytest.approx(bubbles["gpipe"], rel=0.02)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8)])
@pytest.mark.parametrize("frozen", [True, False], ids=["atomic-backward", "split-backward"])
def test_training_bubble_matches_closed_form_when_transfers_are_negligible(p, m, frozen):
    """The closed form's assumptions: ``p`` equal stages (here 2 matmul layers of 16384² each,
    so that stage 0's input projection and the last stage's loss are a few % of a stage), transfers
    between stages take no time (NVLink 10^4 times faster), and a stage's backward is atomic: its
    input gradient is ready only when its whole backward is done. Frozen weights make it so (the
    backward is the input gradients alone): then GPipe and 1F1B (Megatron-LM's order: ``p-s-1``
    warm-up forwards, then one forward and one backward) both have (p-1)/(m+p-1) within 10%
    (measured 1.01-1.06×, the excess from the loss on the last stage). With trainable weights
    the simulator sends the input gradient first and computes the weight gradients after, so
    only ``t_f + t_da`` per stage lies on the ramp: ``2(p-1)/(3m+2(p-1))`` for ``t_b = 2 t_f``
    and ``t_da = t_db`` (measured 0.98-1.07×)."""
    plan = _pipelined_step(p, m, 16384, frozen=frozen)
    expect = (p - 1) / (m + p - 1) if frozen else 2 * (p - 1) / (3 * m + 2 * (p - 1))
    hw = _hw(1e4)
    for policy in ("gpipe", "1f1b"):
        low, s, (unit, used) = _schedule(plan, policy, hw)
        assert used == policy
        assert _bubble(low, s, plan, p) == pytest.approx(expect, rel=0.10), policy


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 8)])
def test_transfers_add_one_hop_per_stage_boundary_each_way(p, m):
    """With transfers of ``c`` seconds each (latency + bytes / bandwidth of one microbatch's
    activations or gradients), the ramp up crosses ``p-1`` boundaries forward and the ramp down
    ``p-1`` backward: the pipeline's span grows by ``2(p-1)c`` over the span with negligible
    transfers, for GPipe, and for 1F1B as long as the weight-gradient work a stage does after
    sending its input gradient covers a round trip ``2c`` (its steady state sends the input
    gradient upstream and gets the next microbatch's activations back while computing it). In
    the steady state a stage runs its backward in program order, layer by layer (``da`` then
    ``db``, as autograd does; the lookahead window's control edges pass their ranks back), so
    that work is the ``db`` of its first layer: links of a tenth of NVLink's speed
    (``c`` 0.21 ms against that ``db``'s 0.23 ms) expose part of the round trip, which
    ``test_1f1b_exposes_the_round_trip_without_weight_gradients`` prices. Contention off, so
    that communication costs only its own time. The bubble is then
    ``(p-1)(t_f + t_da + 2c) / (m(t_f + t_b) + (p-1)(t_f + t_da + 2c))``."""
    plan = _pipelined_step(p, m, 16384)
    base = {}
    for speed in (1e4, 1.0, 0.3, 0.2):
        for policy in ("gpipe", "1f1b"):
            low, s, (unit, used) = _schedule(plan, policy, _hw(speed, contention=1.0))
            span = _span(low, s, plan)
            if speed == 1e4:
                base[policy] = span
                continue
            c = _hop(low)
            nc = low.n_compute
            first = f"l{2 * 1}.fc.db"  # stage 1's first layer (two layers a stage)
            db = np.array([n == first for n in low.op_names])[_op_of_nodes(low)] & (low.dev[:nc] == 1)
            assert 2 * c <= low.dur[:nc][db].sum() / m  # the db after the send covers a round trip
            # measured: 2(p-1)c within 0.01% at 2c / db = 0.18-0.97; at a tenth of NVLink (1.84) 1F1B
            # at p=4, m=8 grows 13% more (gpipe and the other shapes still exactly 2(p-1)c)
            assert span - base[policy] == pytest.approx(2 * (p - 1) * c, rel=0.02), (policy, speed)


def test_1f1b_exposes_the_round_trip_without_weight_gradients():
    """Frozen weights (no ``db`` to overlap) and slow links: 1F1B's steady state waits for the
    round trip (stage ``s`` sends ``B(i)``'s input gradient up and needs ``F(i+w+1)``'s
    activations back: ``s.B(i-1) -> s.F -> s+1.F -> s+1.B -> s.B(i+1)`` is ``2T + 2c`` against
    ``2T`` of its own work, so a steady step takes at least ``T + c``), GPipe does not (its
    forwards never wait for a backward): both pay the ramp's ``2(p-1)c``, 1F1B more."""
    p, m = 4, 8
    plan = _pipelined_step(p, m, 16384, frozen=True)
    grow = {}
    for policy in ("gpipe", "1f1b"):
        spans = [_span(*_schedule(plan, policy, _hw(speed, contention=1.0))[:2], plan) for speed in (1e4, 0.1)]
        grow[policy] = spans[1] - spans[0]
    c = _hop(_schedule(plan, "gpipe", _hw(0.1, contention=1.0))[0])
    # measured (c = 211 us, T = 771 us): gpipe 6.0c = 2(p-1)c, 1f1b 15.5c; stage 0 runs m-p+1
    # steady-state steps, each at least T + c
    assert grow["gpipe"] == pytest.approx(2 * (p - 1) * c, rel=0.05)
    assert grow["1f1b"] >= grow["gpipe"] + (m - p + 1) * c


def test_1f1b_holds_fewer_activations_than_gpipe():
    p, m = 4, 8
    # activations dominate: a long batch through narrow layers
    step = training_step(_chain(p, 2, 65536, 1024), loss="mse", optimizer="sgd")
    plan = parse_move(f"pipeline{{stages={p},group=1}}; microbatch{{ops=all,m={m}}}").apply(step)
    _, gp, (_, u1) = _schedule(plan, "gpipe")
    _, ff, (_, u2) = _schedule(plan, "1f1b")
    assert (u1, u2) == ("gpipe", "1f1b")
    # stage 0 holds every microbatch's activations under GPipe, at most p under 1F1B
    assert ff.peak_mem[0] < 0.75 * gp.peak_mem[0]
    assert ff.peak_mem[:p].max() < gp.peak_mem[:p].max()
    # the default policy for a training step is 1F1B
    low, s, (unit, used) = _schedule(plan, "auto")
    assert used == "1f1b"


def test_microbatches_shorten_a_pipelined_plan_and_off_restores_op_order():
    p = 4
    g = _chain(p, 4, 8192, 2048)  # 1024 rows per microbatch: the GEMMs stay compute-bound
    staged = parse_move(f"pipeline{{stages={p},group=1}}").apply(g)
    plan = parse_move("microbatch{ops=all,m=8}").apply(staged)
    ev = Evaluator("h100-sxm-8")
    assert ev(plan).makespan < 0.5 * ev(staged).makespan
    low, s_off, none = _schedule(plan, "off")
    assert none is None
    _, s_on, _ = _schedule(plan, "auto")
    assert s_on.makespan < s_off.makespan  # op-major order runs all microbatches of one op first


def test_plans_without_microbatches_get_no_pipeline_order():
    g = _chain(2, 2, 64, 1024)
    staged = parse_move("pipeline{stages=2,group=1}").apply(g)
    ev = Evaluator("h100-sxm-8")
    assert pipeline_units(ev.lowerer.lower(staged), staged) is None
    with pytest.raises(ValueError, match="policy"):
        pipeline_units(ev.lowerer.lower(staged), staged, "zigzag")


def test_a_shard_moved_beside_another_is_no_microbatch():
    """Data parallelism over 8 devices with one shard of an op moved onto a device that holds
    another: that device runs two batch pieces of the op, the others one. As in the lowering
    (``_microbatched``: two per device on average), that is no microbatch, so the plan gets no
    pipeline order (it made a single-stage pipeline whose 1F1B order was cyclic); cut into
    microbatches, it does."""
    from ir import workloads

    step = workloads.build("gpt", mode="train", layers=2, d_model=8, heads=2, vocab=10, seq=4, batch=8)
    dp = parse_move("layout{ops=all,mesh=8,use=b,node=8}").apply(step)
    ev = Evaluator("h100-sxm-8")
    assert pipeline_units(ev.lowerer.lower(dp), dp) is None
    moved = parse_move("move{op=l0.ff_act,shard=3,device=4}").apply(dp)
    on = moved.ops["l0.ff_act"].shards.device
    assert (on == 4).sum() == 2 and len(np.unique(on)) == 7
    low = ev.lowerer.lower(moved)
    assert pipeline_units(low, moved) is None and _microbatch_of_nodes(low, moved) is None
    cut = parse_move("microbatch{ops=all,m=2}").apply(step)
    assert pipeline_units(ev.lowerer.lower(cut), cut) is not None


def test_tensor_parallel_stages_get_one_pipeline_order():
    """Under TP a weightless op (layernorm) may have its batch split over the stage's devices
    already; microbatches are cut at global boundaries, so every op of microbatch j is in unit j
    and the pipeline order applies (no deadlock, lower peak than the op-major order)."""
    from costmodel.lookahead import _acyclic, _unit_chain_edges
    from ir import workloads

    step = workloads.build("gpt", mode="train", layers=4, d_model=8, heads=2, vocab=10, seq=4, batch=8)
    plan = parse_move("layout{ops=all,mesh=4,use=t,node=8}; pipeline{stages=2,group=4}; "
                      "microbatch{ops=all,m=4}").apply(step)
    low, s, res = _schedule(plan, "auto")
    assert res is not None and res[1] == "1f1b"
    assert _acyclic(low, *_unit_chain_edges(low, plan, res[0]))
    mb = _microbatch_of_nodes(low, plan)
    assert set(np.unique(mb[mb >= 0]).tolist()) == {0, 1, 2, 3}


def test_gradient_accumulation_over_microbatches_is_in_place():
    """Each microbatch's weight-gradient partial is added into the gradient as it is made
    (``Lowered.acc``, Megatron-LM's ``main_grad``), so more microbatches cost no gradient memory:
    the peak stays at the unmicrobatched plan's. Holding every partial until one accumulate sums
    them (``acc`` off, the model before) grows by a whole set of gradients per microbatch."""
    from costmodel.lowering import Lowerer
    from costmodel.presets import PRESETS
    from ir import workloads

    step = workloads.build("gpt", mode="train", layers=2, d_model=256, heads=2, vocab=16, seq=4, batch=8)
    w1 = 256 * 1024 * 4  # one layer's W1 gradient, fp32 bytes
    peaks, held = {}, {}
    for m in (1, 2, 4, 8):
        plan = parse_move(f"microbatch{{ops=all,m={m}}}").apply(step) if m > 1 else step
        low = Lowerer(PRESETS["h100-sxm-8"]).lower(plan)
        assert low.acc.sum() == sum(len(o.shards) for o in plan.ops.values() if o.kernel == "accumulate")
        assert (m > 1) == bool(low.acc.any())
        peaks[m] = low.simulate().peak_mem[0]
        low.acc = None
        held[m] = low.simulate().peak_mem[0]
    for m in (2, 4, 8):
        assert peaks[m] <= 1.02 * peaks[1], (m, peaks)
    assert held[8] - held[2] > 6 * 2 * w1  # six more sets of partials, each with two layers' W1 alone


def test_recomputed_forward_runs_in_the_backward_units():
    """A pipelined plan with recomputation (Megatron 3D + ``recompute_layers``) recomputes each
    layer's forward in the backward units, so it holds less than the same plan keeping its
    activations; before, the recomputed ops ran in the forward units and held as much."""
    from costmodel.lookahead import _struct_info
    from ir import workloads
    from optimizer.search.baselines import megatron_3d, recompute_layers

    step = workloads.build("gpt", mode="train", layers=4, d_model=256, heads=4, vocab=64, seq=256, batch=16)
    plan = megatron_3d(step, 8, 8)
    rec = recompute_layers(plan)
    ev = Evaluator("h100-sxm-8")
    e_keep, e_rec = ev(plan, keep=True), ev(rec, keep=True)
    low = e_rec.lowered
    phase = _struct_info(low, rec).op_phase(rec)
    re_ops = [i for i, n in enumerate(low.op_names) if n.endswith(".re")]
    assert re_ops and all(phase[i] == 1 for i in re_ops)
    units, _policy = pipeline_units(low, rec)
    offs = low.op_offsets
    for i in re_ops:  # in the units of the backward (1F1B: after the stage's warm-up forwards)
        assert (units[offs[i]:offs[i + 1]] >= 1).all()
    assert e_rec.peak_memory < 0.8 * e_keep.peak_memory, (e_rec.peak_memory, e_keep.peak_memory)


def _tiny_llama_step():
    from ir import workloads

    return workloads.build("llama", layers=4, d_model=32, heads=4, kv_heads=2, d_ff=64, vocab=64, seq=8, batch=8,
                           mode="train")


def _placed_against_1f1b(step):
    """A tiny llama Megatron 3D plan on 8 GPUs (pp 4) with a forward op of stage 1 and a backward
    op of stage 0 each placed on every stage's devices (two ``place`` moves a walk found)."""
    from optimizer.search.baselines import megatron_3d

    return parse_move("place{op=l1.ff_act,devices=[5,6,7,0,1,2,3,4]}; "
                      "place{op=l0.attn_av.db,devices=[1,2,3,4,5,6,7,0]}").apply(megatron_3d(step, 8, pp=4))


def test_a_placement_against_1f1b_gets_gpipe_order():
    """A forward op of stage 1 and a backward op of stage 0 each placed on every stage's devices
    (two ``place`` moves of a search's walk, found by one): 1F1B's unit chain, which interleaves
    each device's forwards and backwards by its own stage, has a cycle through them. The plan
    then follows GPipe's order (every device runs all its forward units before its backward
    ones) instead of no pipeline order at all."""
    from costmodel.lookahead import _acyclic, _unit_chain_edges

    step = _tiny_llama_step()
    plan = _placed_against_1f1b(step)
    ev = Evaluator("h100-sxm-8")
    low = ev.lowerer.lower(plan)
    unit, policy = pipeline_units(low, plan)
    assert policy == "1f1b" and not _acyclic(low, *_unit_chain_edges(low, plan, unit))
    g_unit, g_policy = pipeline_units(low, plan, "gpipe")
    assert g_policy == "gpipe"
    ptr, idx = lookahead_edges(low, plan)
    edges = set(zip(np.repeat(np.arange(len(ptr) - 1), np.diff(ptr)).tolist(), idx.tolist()))
    gs, gd = _unit_chain_edges(low, plan, g_unit)
    assert gs.size and set(zip(gs.tolist(), gd.tolist())) <= edges
    s = low.simulate((ptr, idx))
    start = s.start[:low.n_compute]
    for d in range(8):  # unit by unit: GPipe's units are F0..F(m-1), B0..B(m-1), then the drain
        on = low.dev[:low.n_compute] == d
        units = np.unique(g_unit[on & (g_unit >= 0)])
        assert len(units) >= 5
        for k in units[:-1]:
            assert start[on & (g_unit == k)].max() <= start[on & (g_unit > k)].min()



def test_the_evaluator_follows_the_first_acyclic_tier():
    """``Evaluator`` lets the simulator's own topological pass pick the first acyclic control-edge
    set of ``lookahead_tiers`` (no separate check): on the plan above, whose 1F1B chain is cyclic,
    its schedule is the one of ``lookahead_edges``' choice (GPipe's order), and a cyclic tier
    simulated with ``cycle_ok`` gives None where it would raise."""
    from costmodel.lookahead import lookahead_tiers
    from costmodel.simulate import SimulationError
    from optimizer.search.baselines import megatron_3d

    step = _tiny_llama_step()
    plan = _placed_against_1f1b(step)
    ev = Evaluator("h100-sxm-8")
    low = ev.lowerer.lower(plan)
    tiers = list(lookahead_tiers(low, plan))
    assert len(tiers) == 5  # 1F1B with and without the port order, GPipe's likewise, the window's
    assert low.simulate(tiers[0], cycle_ok=True) is None
    with pytest.raises(SimulationError, match="cycle"):
        low.simulate(tiers[1])
    chosen = low.simulate(lookahead_edges(low, plan))
    assert ev(plan).makespan == chosen.makespan
    plain = megatron_3d(step, 8, pp=4)  # the unmoved plan keeps 1F1B with its port order: the first tier
    low0 = ev.lowerer.lower(plain)
    import costmodel.lookahead as la

    calls = []
    real = la.pipeline_units
    la.pipeline_units = lambda *a, **k: calls.append(a[2:]) or real(*a, **k)
    try:
        first = next(iter(lookahead_tiers(low0, plain)))
    finally:
        la.pipeline_units = real
    assert calls == [("auto",)]  # GPipe's units only once 1F1B's tiers have failed
    assert ev(plain).makespan == low0.simulate(first).makespan
    assert ev(plain).makespan != low0.simulate(list(lookahead_tiers(low0, plain))[-1]).makespan
