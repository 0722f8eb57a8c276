"""The search's ``recompute`` operator: a layer's activations traded for FLOPs in one move."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.presets import preset
from executor.verify import verify
from ir import workloads
from ir.layers import layer_classes
from ir.rewrites import RewriteError, unshard
from ir.rewrites.recompute import recompute_block, recomputed
from ir.rewrites.tie import tie
from optimizer.search.baselines import recompute_layers, zero3
from optimizer.search.local import local_search
from optimizer.search.mutation import MutationContext
from optimizer.search.recomputation import op_recompute

TINY = dict(d_model=32, heads=4, kv_heads=2, d_ff=64, vocab=64, seq=8, batch=4, mode="train")
SMALL = dict(d_model=256, heads=8, kv_heads=4, d_ff=512, vocab=1000, seq=512, batch=16, mode="train")
CTX = MutationContext(8, 32, devices_per_node=8)


def _draws(g, seed=0, n=60):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield op_recompute(g, rng, CTX)


def test_a_tied_layer_move_recomputes_the_whole_class_and_verifies():
    g = zero3(workloads.build("llama", layers=5, **TINY), 4)
    seen_whole = seen_op = False
    for child, move in _draws(g):
        tied = tie(g, child)
        layers = {n.split(".")[0].split("_")[0] for n in recomputed(tied)}
        if str(move).startswith("recompute{prefix=l2."):  # a middle layer: every middle layer with it
            assert layers == {"l1", "l2", "l3"}
            assert layer_classes(tied)[1:4] == [layer_classes(tied)[1]] * 3
            rep = verify(tied, reference=unshard(g))
            assert rep.ok, rep
            assert unshard(tied).digest == unshard(g).digest
            seen_whole = True
        elif str(move).startswith("recompute{op="):
            seen_op = True
            assert len(recomputed(child)) == 1
    assert seen_whole and seen_op


def test_a_recomputed_layer_is_undone_by_the_next_draw_on_it():
    g = zero3(workloads.build("llama", layers=3, **TINY), 4)
    p = recompute_layers(g)
    undo = {}
    for child, move in _draws(p, seed=3, n=20):
        text = str(move)
        assert text.startswith("unrecompute{prefix=")  # every layer is recomputed
        layer = text.split("=")[1].split(".")[0].split("_")[0]
        left = {n for n in recomputed(child)}
        assert left == {n for n in recomputed(p) if not n.startswith((layer + ".", layer + "_"))}
        undo[layer] = move
    assert sorted(undo) == ["l0", "l1", "l2"]
    back = p
    for move in undo.values():  # undoing every layer gives the plan back
        back = move.apply(back)
    assert back.digest == g.digest


def test_forward_programs_and_programs_without_layers_are_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(RewriteError, match="numbered layers"):
        op_recompute(workloads.build("mlp", batch=8, widths=[8, 8, 8]), rng, CTX)
    fwd = zero3(workloads.build("llama", layers=3, **{**TINY, "mode": "forward"}), 4)
    with pytest.raises(RewriteError):
        for _ in range(20):
            op_recompute(fwd, rng, CTX)


def test_the_search_recomputes_to_fit_a_device_too_small_for_the_activations():
    """ZeRO-3 of a 6-layer llama holds 239 MB a device, recomputing every layer 80 MB: on a
    device of 150 MB only recomputation makes a plan feasible, and the search finds it."""
    g = workloads.build("llama", layers=6, **SMALL)
    hw = preset("h100-sxm-8")
    hw = hw.replace(device=dataclasses.replace(hw.device, mem_capacity=150e6))
    ev = Evaluator(hw)
    assert not ev(zero3(g, 8)).feasible and ev(recompute_layers(zero3(g, 8))).feasible
    run = local_search(g, ev, 6.0, {"zero3": zero3(g, 8)}, seed=0, weights={"recompute": 1.0},
                       tie_layers=True)
    assert run.best.feasible
    assert any(m.startswith("recompute{prefix=") for m in run.best.lineage)


def test_search_walks_with_recomputation_keep_the_program():
    """Random walks of every search operator, recomputation drawn often, on a tied llama step:
    each child computes the program (``unshard``), the walks' ends execute equal to it, and the
    children whose copies a later rewrite left unrecoverable are refused (``keeps_program``)."""
    from ir.rewrites.substitute_attention import attention_sites, fuse_attention
    from ir.autodiff import training_step
    from optimizer.search.mutation import DEFAULT_OPERATOR_WEIGHTS, AdaptiveWeights, mutate

    kw = {k: v for k, v in TINY.items() if k != "mode"}
    fwd = workloads.build("llama", layers=6, **{**kw, "batch": 8})
    for s in attention_sites(fwd):
        fwd = fuse_attention(fwd, s)
    program = training_step(fwd, loss="cross_entropy", optimizer="adamw")
    ref = unshard(program)
    w = {k: v for k, v in DEFAULT_OPERATOR_WEIGHTS.items() if k != "crossover"} | {"recompute": 3.0}
    aw = AdaptiveWeights(w, False)
    rng = np.random.default_rng(0)
    refused = copies = 0
    for walk in range(8):
        g = zero3(program, 8) if walk % 2 else program
        for _ in range(30):
            try:
                g, _ = mutate(g, aw.choose(rng), rng, CTX, tied=True)
            except RewriteError as e:
                refused += "no longer computes" in str(e)
                continue
            assert unshard(g).digest == ref.digest
        copies += bool(recomputed(g))
        rep = verify(g, reference=ref)
        assert rep.ok, rep
    assert copies >= 2 and refused >= 1


def test_only_structural_children_with_copies_are_unsharded(monkeypatch):
    """``keeps_program`` costs an ``unshard``: only a structural child holding recomputed copies
    pays it (``l0.resid1`` is not a copy's name; ``l0.ff1.re`` and ``a.re+b`` are)."""
    from ir.rewrites import parse_move
    from optimizer.search import mutation

    calls = []
    monkeypatch.setattr(mutation, "_program_digest", lambda g: calls.append(g) or "x")
    g = zero3(workloads.build("llama", layers=3, **TINY), 4)
    fused = parse_move("fuse{producer=l1.o_proj,consumer=l1.resid1}").apply(g)  # structural, no copies
    assert mutation.keeps_program(g, fused) and not calls
    p = recompute_layers(g)
    shard = parse_move("merge{op=l1.ff_up.re,dim=b}").apply(p)  # copies, shards only
    assert mutation.keeps_program(p, shard) and not calls
    assert mutation.keeps_program(p, parse_move("fuse{producer=l1.o_proj,consumer=l1.resid1}").apply(p))
    assert len(calls) == 2  # the child and its parent


def test_a_structural_change_away_from_the_copies_is_not_unsharded(monkeypatch):
    """A structural child whose changed ops neither are nor hold nor derive from a recomputed copy
    or its original passes without an ``unshard``; a change to a copy, to an original (fused
    under another name too) or to an op named after one (its backward, its accumulate) is checked."""
    from ir.rewrites import parse_move
    from optimizer.search import mutation

    calls = []
    monkeypatch.setattr(mutation, "_program_digest", lambda g: calls.append(g.digest) or "x")
    g = zero3(workloads.build("llama", layers=3, **TINY), 4)
    p = recompute_block(g, "l1.")
    assert "l0.o_proj.re" not in p.ops and "l1.o_proj.re" in p.ops
    far = parse_move("fuse{producer=l0.o_proj,consumer=l0.resid1}").apply(p)  # layer 0 keeps its activations
    assert mutation.keeps_program(p, far) and not calls
    near = [parse_move("fuse{producer=l1.o_proj,consumer=l1.resid1}").apply(p),  # an original
            parse_move("fuse{producer=l1.o_proj.re,consumer=l1.resid1.re}").apply(p),  # copies
            parse_move("merge_reduction{op=l1.o_proj.db}").apply(p)]  # the original's backward
    for child in near:
        calls.clear()
        assert mutation.keeps_program(p, child) and len(calls) == 2
    assert mutation._touches_copies(p.ops, far.ops) is False
    fused = near[0]  # ``l1.o_proj+l1.resid1`` holds the original: a change to it is checked
    assert mutation._touches_copies(fused.ops, parse_move("unfuse{op=l1.o_proj+l1.resid1}").apply(fused).ops)
