"""Layer repetition: truncations are the programs of smaller models, tied moves keep layers alike
and preserve meaning, and ``Evaluator(layers="repeat")`` matches the whole evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.repetition import repetition
from executor.verify import verify
from ir import workloads
from ir.layers import Chain, Shift, layer_classes, truncate
from ir.rewrites import RewriteError, parse_move, random_rewrite, unshard
from ir.rewrites.tie import tie
from optimizer.search.baselines import megatron, megatron_3d, zero3

TINY = dict(d_model=32, heads=4, kv_heads=2, d_ff=64, vocab=64, seq=8, batch=4, mode="train")
SMALL = dict(d_model=256, heads=8, kv_heads=4, d_ff=512, vocab=1000, seq=256, batch=16, mode="train",
             dtype="bfloat16")


def _texts(g, rename: dict[str, str]) -> tuple[list[str], list[str]]:
    text = g.canonical_json
    for a, b in rename.items():
        text = text.replace(a, b)
    d = json.loads(text)
    return (sorted(json.dumps(x, sort_keys=True) for x in d["ops"]),
            sorted(json.dumps(x, sort_keys=True) for x in d["tensors"]))


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_truncation_is_the_smaller_models_program(family):
    g6 = workloads.build(family, layers=6, **TINY)
    g4 = workloads.build(family, layers=4, **TINY)
    t = truncate(g6, (0, 1, 2, 5))
    assert t is not None
    assert _texts(t, {"l5": "l3"}) == _texts(g4, {})
    # and a cut that leaves a layer reading a dropped one is refused, not half-made
    assert truncate(g6, (1, 2, 5)) is None  # layer 0 feeds every other layer's chain; outside ops read l0


def test_layer_maps_repoint_names():
    c = Chain((0, 1, 2, 7))
    assert c.name("l7.attn_norm") == "l7.attn_norm"
    assert c.name("l6.resid2.out", 7) == "l2.resid2.out"  # the previous kept layer stands for l6
    assert c.name("l3.attn_norm.dx.out", 2) == "l7.attn_norm.dx.out"
    assert c.name("l4.q_proj") is None  # a dropped layer's
    assert c.name("final_norm") == "final_norm" and c.name("labels") == "labels"
    s = Shift(3)
    assert s.name("l1.ff_down+l2.resid2") == "l4.ff_down+l5.resid2"
    assert s.value({"stages": [{"op": "l1.a", "via": "l0.b.out"}], "n": 2}, 1) == \
        {"stages": [{"op": "l4.a", "via": "l3.b.out"}], "n": 2}


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


def _plans():
    g = workloads.build("llama", layers=9, **SMALL)
    g16 = workloads.build("llama", layers=16, **SMALL)  # two stages of eight layers: a class each
    plans = {"zero3": zero3(g, 8), "megatron": megatron(g, 8), "3d": megatron_3d(g16, 8, pp=2, m=4)}
    p = plans["zero3"]
    for i in range(9):
        p = parse_move(f"recompute{{prefix=l{i}.}}").apply(p)
    plans["zero3+recompute"] = p
    p = plans["zero3"]
    for i in range(9):
        p = parse_move(f"fuse_attention{{op=l{i}.attn_qk}}").apply(p)
    plans["zero3+fused-attention"] = p
    return plans


@pytest.fixture(scope="module")
def plans():
    return _plans()


@pytest.mark.parametrize("name", ["zero3", "megatron", "3d", "zero3+recompute", "zero3+fused-attention"])
def test_repeat_matches_whole_evaluation(plans, name):
    p = plans[name]
    whole = Evaluator("h100-sxm-8")(p)
    rep = Evaluator("h100-sxm-8", layers="repeat")(p)
    assert rep.repetition is not None and len(rep.repetition.big) < rep.repetition.layers - 2
    assert whole.repetition is None
    # exact: the whole program's facts
    assert rep.lower_bound == whole.lower_bound and rep.model_flops == whole.model_flops
    assert rep.memory_floor == whole.memory_floor and rep.devices == whole.devices
    assert rep.feasible == whole.feasible
    # extended: step time, energy and bytes within 1%; the peak within 2.5% (measured: 1.9% low with
    # fused attention, where weights fetched just in time put the peak off the layers' rhythm)
    for f, tol in (("makespan", 0.01), ("energy", 0.01), ("bytes_moved", 0.01), ("peak_memory", 0.025)):
        assert _close(getattr(rep, f), getattr(whole, f), tol), (f, getattr(rep, f), getattr(whole, f))
    # a device's own peak may fall outside the forward/backward turn (measured: 1.2% low on the
    # devices other than the busiest, with fused attention); the maximum, which decides feasibility, is exact
    np.testing.assert_allclose(rep.peak_memory_per_device, whole.peak_memory_per_device, rtol=0.025)
    assert _close(rep.mfu, whole.mfu, 0.01)


def test_repeat_falls_back_to_whole():
    g = workloads.build("mlp", batch=64, widths=[64, 128, 64])
    e = Evaluator("h100-sxm-8", layers="repeat")(g)
    assert e.repetition is None and e.makespan == Evaluator("h100-sxm-8")(g).makespan
    few = workloads.build("llama", layers=6, **SMALL)  # too few layers to shorten
    assert repetition(few) is None
    with pytest.raises(ValueError, match="layers"):
        Evaluator("h100-sxm-8", layers="some")


def test_phase_seconds_time_each_part_and_change_nothing():
    """``Evaluator.phase_seconds`` (a dict): the seconds of each phase of the evaluations made
    while it is set, two truncations each; the objectives are those of an untimed evaluator."""
    g = zero3(workloads.build("llama", layers=9, **TINY), 4)
    timed = Evaluator("h100-sxm-8", layers="repeat")
    timed.phase_seconds = {}
    e = timed(g)
    assert e.repetition is not None
    assert set(timed.phase_seconds) == {"truncate", "lower", "lookahead", "simulate"}
    assert all(v > 0 for v in timed.phase_seconds.values())
    plain = Evaluator("h100-sxm-8", layers="repeat")
    assert plain.phase_seconds is None and plain(g).objectives() == e.objectives()


def test_layers_made_different_are_kept_whole(plans):
    p = plans["zero3"]
    rng = np.random.default_rng(3)
    child = p
    while True:  # a shard move in layer 3 only
        try:
            c, _m = random_rewrite(child, rng, 8)
        except RewriteError:
            continue
        if c.edit is not None and {n.split(".")[0].split("_")[0] for n in c.edit.replaced} == {"l3"}:
            break
    classes = layer_classes(c)
    assert classes[3] not in [classes[i] for i in (1, 2, 4, 5)]
    rep = repetition(c)
    assert rep is not None and 3 in rep.small and 3 in rep.big
    whole, fast = Evaluator("h100-sxm-8")(c), Evaluator("h100-sxm-8", layers="repeat")(c)
    assert _close(fast.makespan, whole.makespan, 0.01) and _close(fast.peak_memory, whole.peak_memory, 0.01)


def _middle_layer_move(g, rng, n, want_structural: bool):
    for _ in range(2000):
        try:
            c, m = random_rewrite(g, rng, n)
        except RewriteError:
            continue
        structural = c.edit is None
        names = list(c.edit.replaced) if c.edit is not None else [k for k in c.ops if k not in g.ops]
        if structural == want_structural and names and all(k.startswith(("l2.", "l2_")) for k in names):
            return c, m
    raise AssertionError("no such move found")


@pytest.mark.parametrize("structural", [False, True])
def test_tie_makes_the_move_in_every_layer_of_the_class(structural):
    g = zero3(workloads.build("llama", layers=5, **TINY), 4)
    rng = np.random.default_rng(7 + structural)
    child, move = _middle_layer_move(g, rng, 4, structural)
    tied = tie(g, child)
    assert tied is not child
    classes = layer_classes(tied)
    assert classes[1] == classes[2] == classes[3]  # the middle layers stay one class
    moved = list(child.edit.replaced) if child.edit is not None else [k for k in child.ops if k not in g.ops]
    for n in moved:  # ... with the move in it
        for j in (1, 3):
            m = Shift(j - 2).name(n)
            assert m in tied.ops and m not in g.ops or tied.ops[m] is not g.ops[m]
            assert tied.ops[m].shards == child.ops[n].shards and tied.ops[m].kernel == child.ops[n].kernel
    assert unshard(tied).digest == unshard(g).digest  # the same program
    rep = verify(tied, reference=unshard(g))
    assert rep.ok, rep


def test_tie_leaves_moves_it_cannot_copy():
    g = zero3(workloads.build("llama", layers=5, **TINY), 4)
    c = parse_move("recompute{prefix=l0.}").apply(g)  # layer 0 is a class of its own
    assert tie(g, c) is c
    assert tie(g, g) is g


@pytest.mark.parametrize("builder", [zero3, megatron])
def test_a_proxy_is_evaluated_as_the_model(builder):
    """A 4-layer proxy with ``model_layers=12`` gives the 12-layer model's figures (its middle
    layers copied up), the program facts included (extended: linear in the layers)."""
    g12 = workloads.build("llama", layers=12, **SMALL)
    g4 = workloads.build("llama", layers=4, **SMALL)
    whole = Evaluator("h100-sxm-8")(builder(g12, 8))
    proxy = Evaluator("h100-sxm-8", layers="repeat", model_layers=12)(builder(g4, 8))
    assert proxy.repetition is not None and proxy.repetition.proxy and proxy.repetition.layers == 12
    for f in ("makespan", "energy", "peak_memory", "lower_bound", "model_flops", "memory_floor"):
        assert _close(getattr(proxy, f), getattr(whole, f), 0.01), (f, getattr(proxy, f), getattr(whole, f))


def test_a_pipelined_proxy_grows_every_stage_alike():
    g10 = workloads.build("llama", layers=10, **SMALL)
    g6 = workloads.build("llama", layers=6, **SMALL)
    whole = Evaluator("h100-sxm-8")(megatron_3d(g10, 8, pp=2, m=4))
    plan = megatron_3d(g6, 8, pp=2, m=4)  # stages of layers 0-2 and 3-5: middle classes {1, 2}, {3, 4}
    proxy = Evaluator("h100-sxm-8", layers="repeat", model_layers=10)(plan)
    assert proxy.repetition.x == 2 and len(proxy.repetition.big) == 6  # (10 - 6) / 2 more per stage
    assert _close(proxy.makespan, whole.makespan, 0.01) and _close(proxy.peak_memory, whole.peak_memory, 0.01)


def test_a_pipelined_proxy_of_four_stages_grows_every_stage_alike():
    """Four stages of two layers each on 8 layers: the first and last stages' middle classes hold
    one layer (the other is layer 0 or 7), the others two. The classes differ in length, and all
    eight added layers went to one stage (peak memory +91%, makespan -16%); now each stage
    grows by two. A proxy whose stages differ in length cannot stand for the model: refused."""
    g16 = workloads.build("llama", layers=16, **SMALL)
    whole = Evaluator("h100-sxm-8")(megatron_3d(g16, 8, pp=4, m=4))
    plan = megatron_3d(workloads.build("llama", layers=8, **SMALL), 8, pp=4, m=4)
    assert layer_classes(plan) == [0, 1, 2, 2, 3, 3, 4, 5]
    proxy = Evaluator("h100-sxm-8", layers="repeat", model_layers=16)(plan)
    assert proxy.repetition.x == 2 and proxy.repetition.small == (0, 2, 4, 7)
    assert _close(proxy.makespan, whole.makespan, 0.01) and _close(proxy.peak_memory, whole.peak_memory, 0.01)
    uneven = megatron_3d(workloads.build("llama", layers=6, **SMALL), 8, pp=4, m=4)  # stages of 2, 2, 1, 1
    assert repetition(uneven, model_layers=16) is None
    assert not Evaluator("h100-sxm-8", layers="repeat", model_layers=16)(uneven).feasible


def test_a_tied_proxy_lineage_replays_on_the_model():
    from optimizer.search.local import replay

    g4 = workloads.build("llama", layers=4, **TINY)
    g8 = workloads.build("llama", layers=8, **TINY)
    plan, lineage = zero3(g4, 8), ["seed:zero3"]
    rng = np.random.default_rng(1)
    while len(lineage) < 10:  # tied moves, as local_search(tie_layers=True) makes them
        try:
            child, move = random_rewrite(plan, rng, 8)
        except RewriteError:
            continue
        plan = tie(plan, child)
        lineage.append(str(move))
    proxy = Evaluator("h100-sxm-8", layers="repeat", model_layers=8)(plan)
    full = replay(g8, tuple(lineage), lambda name: zero3(g8, 8), tie_from=4)
    c = layer_classes(full)
    assert len(set(c[1:7])) <= 2  # the middle stays (almost) one class: the moves were tied
    e = Evaluator("h100-sxm-8")(full)
    assert _close(e.makespan, proxy.makespan, 0.05), (e.makespan, proxy.makespan)
    assert verify(full, reference=unshard(g8)).ok


def test_a_move_of_every_proxy_layer_replays_on_every_model_layer():
    """A move of several parts that edits every middle layer of a tied proxy alike (a
    crossover's retiles, one per layer) keeps the proxy's layers one class. Replayed whole, it
    named only the proxy's layers on the model (1, and 2 = P-2 as L-2 = 6): layers 2-5 kept the
    old layout, and a 70B plan recomputed 4 of its 78 middle layers (237 GB a device)."""
    from optimizer.search.local import replay

    g4, g8 = (workloads.build("llama", layers=n, **TINY) for n in (4, 8))
    move = "; ".join(f"retile{{op=l{i}.ff_up,parts=[2,1,1],devices=[0,1]}}" for i in (1, 2))
    proxy = parse_move(move).apply(zero3(g4, 8))
    assert layer_classes(proxy) == [0, 1, 1, 2]
    full = replay(g8, ("seed:zero3", move), lambda name: zero3(g8, 8), tie_from=4)
    assert len(set(layer_classes(full)[1:7])) == 1
    assert all(len(full.ops[f"l{i}.ff_up"].shards) == 2 for i in range(1, 7))
    assert verify(full, reference=unshard(g8)).ok


def test_a_structural_childs_truncation_comes_from_its_parents():
    """A truncation of a tied structural child has the parent's truncation as its origin, so the
    lowerer derives its structure and pieces from the parent's (``Lowerer._derive``)."""
    from costmodel.lowering import Lowerer
    from costmodel.presets import PRESETS

    g = zero3(workloads.build("llama", layers=6, **TINY), 4)
    child, _move = _middle_layer_move(g, np.random.default_rng(8), 4, True)
    tied = tie(g, child)
    kept = (0, 1, 2, 5)
    base, small = truncate(g, kept), truncate(tied, kept)
    assert small.origin is not None and small.origin() is base
    low = Lowerer(PRESETS["h100-sxm-8"])
    low.lower(base)
    derived = low._derived_structure(small, low.program_of(small))
    assert derived is not None and low._link[1].ops_map is base.ops
    low._link = None
    fresh = Lowerer(PRESETS["h100-sxm-8"]).lower(small)
    inc = low.lower(small)
    assert inc.kind.tobytes() == fresh.kind.tobytes() and inc.dur.tobytes() == fresh.dur.tobytes()
    assert inc.succ_idx.tobytes() == fresh.succ_idx.tobytes()


def test_a_childs_truncation_and_classes_derived_from_its_parents_equal_the_whole_ones():
    """``truncate`` and ``layer_classes`` derive a child's from its parent's (an in-place edit:
    the replaced ops; a structural one: ``Graph.ops_delta``); a walk of random moves, tied and
    not, recomputations among them, gives each time what a graph without lineage gives."""
    from ir.graph import Graph
    from ir.layers import _signatures

    g0 = zero3(workloads.build("llama", layers=7, **TINY), 4)
    rng = np.random.default_rng(3)
    kepts = [(0, 1, 2, 6), (0, 1, 2, 3, 6), (0, 2, 4, 6)]
    g, checked, structural = g0, 0, 0
    for step in range(160):
        try:
            if rng.random() < 0.15:
                i = int(rng.integers(0, 7))
                child = parse_move(f"{'recompute' if rng.random() < 0.7 else 'unrecompute'}{{prefix=l{i}.}}").apply(g)
            else:
                child, _ = random_rewrite(g, rng, 4)
        except RewriteError:
            continue
        if rng.random() < 0.7:
            child = tie(g, child)
        for kept in kepts:
            truncate(g, kept)  # the parent's, as an evaluation leaves it
            got = truncate(child, kept)
            whole = truncate(Graph(child.tensors, child.ops), kept)  # no lineage: from scratch
            assert (got is None) == (whole is None), (step, kept)
            if got is not None:
                assert list(got.ops) == list(whole.ops)
                assert all(got.ops[n] is whole.ops[n] for n in got.ops)
                assert list(got.tensors.items()) == list(whole.tensors.items())
        _signatures(g)
        assert _signatures(child) == _signatures(Graph(child.tensors, child.ops))
        checked += 1
        structural += child.edit is None
        g = child if rng.random() < 0.6 else g0 if rng.random() < 0.2 else g
    assert checked > 100 and structural > 20, (checked, structural)


def test_a_derived_truncation_refuses_what_the_whole_one_refuses():
    """An edit that renames what layer 2 hands to layer 3 leaves layer 4 of the truncation to
    layers 0, 2, 4, 6 (whose reads of layer 3 now mean layer 2) reading a tensor that is gone:
    no truncation, derived from the parent's or not."""
    from ir.graph import Graph, Tensor

    g = zero3(workloads.build("llama", layers=7, **TINY), 4)
    kept = (0, 2, 4, 6)
    x = g.ops["l2.resid2"].output
    y = x + "2"
    replace = {"l2.resid2": g.ops["l2.resid2"].replace(output=y)}
    for q, port in g.consumers[x]:
        o = replace.get(q, g.ops[q])
        replace[q] = o.replace(inputs=tuple((p, y if t == x else t) for p, t in o.inputs))
    t = g.tensors[x]
    child = g.with_ops(replace, tensors={x: None, y: Tensor(y, t.shape, t.dtype, t.role)})
    assert truncate(Graph(child.tensors, child.ops), kept) is None
    assert truncate(g, kept) is not None
    assert truncate(child, kept) is None
    assert truncate(child, (0, 1, 2, 3, 6)) is not None  # layers 2 and 3 kept together: closed


def test_derived_signatures_and_truncations_ignore_what_with_ops_ignores():
    """``with_ops`` ignores a replaced name or an insertion anchor that is not an op of the graph;
    so do the derivations from ``Graph.ops_delta``."""
    from ir.graph import Graph
    from ir.layers import _signatures

    g = zero3(workloads.build("llama", layers=7, **TINY), 4)
    extra = g.ops["l3.resid2"].replace(name="l3.extra", output="l3.resid2.out")  # dropped with its anchor
    child = g.with_ops({"l3.no_such_op": None, "l2.resid1": g.ops["l2.resid1"].replace(params={})},
                       insert_after={"l3.no_such_anchor": [extra]})
    assert "l3.extra" not in child.ops
    _signatures(g)
    assert _signatures(child) == _signatures(Graph(child.tensors, child.ops))
    for kept in [(0, 1, 2, 6), (0, 2, 3, 4, 6)]:
        truncate(g, kept)
        got, whole = truncate(child, kept), truncate(Graph(child.tensors, child.ops), kept)
        assert (got is None) == (whole is None)
        assert got is None or list(got.ops) == list(whole.ops)


def test_a_pipeline_whose_short_stage_is_not_shortened_is_evaluated_whole():
    """Two stages of layers 0-5 and 6-10: the first stage's middle class (1-5) is long enough to
    shorten, the second's (6-9) is not. Shortening the first stage alone moves the pipeline's
    bottleneck between the truncations (big: 5 | 5 layers, small: 4 | 5, the whole plan 6 | 5),
    so the line through them is not the whole plan's: the step came out 5.9% short (22.61 against
    24.02 ms) and the energy 0.95% low. Stages that cannot all shrink alike are evaluated whole."""
    g = workloads.build("llama", layers=11, **SMALL)
    p = megatron_3d(g, 8, pp=2, m=8)
    assert layer_classes(p) == [0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    whole = Evaluator("h100-sxm-8")(p)
    rep = Evaluator("h100-sxm-8", layers="repeat")(p)
    assert _close(rep.makespan, whole.makespan, 0.01), (rep.makespan, whole.makespan)
    assert _close(rep.energy, whole.energy, 0.005), (rep.energy, whole.energy)


def test_a_pipelined_proxy_whose_stages_cannot_grow_alike_is_refused():
    """A 2-stage proxy of 6 layers for an 11-layer model (and a 4-stage one of 8 for 18 layers):
    the missing layers do not split evenly over the stages, and all of them were copied into one
    stage (8 | 3 layers where the model's pipeline has 6 | 5): the step 17% short and the peak
    31% high (4 stages: +34% and +93%). Such a proxy cannot stand for its model: refused, as one
    whose stages differ in length."""
    plan = megatron_3d(workloads.build("llama", layers=6, **SMALL), 8, pp=2, m=4)
    assert repetition(plan, model_layers=10) is not None  # 2 more layers per stage
    assert repetition(plan, model_layers=11) is None
    assert not Evaluator("h100-sxm-8", layers="repeat", model_layers=11)(plan).feasible
    four = megatron_3d(workloads.build("llama", layers=8, **SMALL), 8, pp=4, m=4)
    assert repetition(four, model_layers=16) is not None and repetition(four, model_layers=18) is None


def test_a_last_layer_staged_alone_keeps_the_plan_whole():
    """Layers 0-9 tensor parallel on devices 0-3, the last layer and the head (a 128k vocabulary)
    a stage of their own on device 4, four microbatches. Only the middle class shrinks, so the
    head's stage bottlenecks both truncations but not the whole plan: the step came out 5.6%
    short (23.01 against 24.36 ms; 24% long with a 256k vocabulary). A first or last layer on
    devices of its own is a stage that cannot shrink: the plan is evaluated whole."""
    g = workloads.build("llama", layers=11, d_model=128, heads=8, kv_heads=4, d_ff=256, vocab=128_000, seq=128,
                        batch=16, mode="train", dtype="bfloat16")
    p = parse_move("layout{ops=all,mesh=4,use=t}; stage{layers=10:10,devices=4:5}; microbatch{ops=all,m=4}").apply(g)
    assert layer_classes(p) == [0] + [1] * 9 + [2]
    whole = Evaluator("h100-sxm-8")(p)
    rep = Evaluator("h100-sxm-8", layers="repeat")(p)
    assert _close(rep.makespan, whole.makespan, 0.01), (rep.makespan, whole.makespan)
    assert repetition(zero3(g, 8)) is not None  # layers sharing their devices are still cut


def test_a_proxy_whose_last_layer_is_staged_alone_is_refused():
    """The proxy form of the plan above (6 layers standing for 11): the middle layers were copied
    up while the head's stage stayed as it was, 5.6% short of the 11-layer plan's step. A proxy
    with a stage that would not grow cannot stand for its model: refused."""
    g = workloads.build("llama", layers=6, d_model=128, heads=8, kv_heads=4, d_ff=256, vocab=128_000, seq=128,
                        batch=16, mode="train", dtype="bfloat16")
    p = parse_move("layout{ops=all,mesh=4,use=t}; stage{layers=5:5,devices=4:5}; microbatch{ops=all,m=4}").apply(g)
    assert repetition(p, model_layers=11) is None
    assert repetition(parse_move("layout{ops=all,mesh=4,use=t}").apply(g), model_layers=11) is not None
