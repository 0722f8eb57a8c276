"""``Lowerer.unsubstituted_key``: the key under which ``Evaluator`` shares program facts.

It must be a function of the logical program (``unshard(g)``): equal keys, equal unsharded
digests, on random rewrite walks that fuse attention, norms, elementwise chains and split
reductions, merge matmuls (one key for all of them); and plans that differ only in which layers have fused attention share one key (the
point of it: no ``unshard`` for those), while a different program gets another key.
"""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.evaluate import program_facts
from costmodel.lowering import Lowerer
from costmodel.presets import PRESETS
from ir.builder import GraphBuilder
from ir import workloads
from ir.rewrites import RewriteError, fuse, fuse_attention, random_rewrite, split_reduction, unshard
from ir.rewrites.substitute_merge import merged_matmuls

HW = PRESETS["h100-sxm-8"]


def _sites(g):
    return [n for n in g.ops if n.endswith("attn_qk")]


@pytest.mark.parametrize("name,kw", [("gpt", dict(batch=2, seq=8, layers=2)),
                                     ("llama", dict(batch=2, seq=8, kv_heads=2, layers=2))])
def test_fused_attention_in_some_layers_shares_the_key(name, kw):
    g = workloads.build(name, mode="train", **kw)
    low = Lowerer(HW)
    a, b = _sites(g)
    one, both = fuse_attention(g, a), fuse_attention(fuse_attention(g, a), b)
    keys = {low.unsubstituted_key(x) for x in (g, one, both, fuse_attention(g, b))}
    assert len(keys) == 1
    assert len({low._program_key(x) for x in (g, one, both)}) == 3  # different plans' programs
    other = workloads.build(name, mode="train", **{**kw, "seq": 16})
    assert low.unsubstituted_key(other) not in keys


@pytest.mark.parametrize("seed", range(3))
def test_key_is_a_function_of_the_unsharded_program(seed):
    g0 = workloads.build("gpt", mode="train", batch=4, seq=8, layers=2, d_model=16, heads=2, vocab=32)
    rng = np.random.default_rng(seed)
    low, seen, merged = Lowerer(HW), {}, 0
    g = g0
    for _ in range(60):
        try:
            g, _m = random_rewrite(g, rng, 8, max_shards_per_op=8)
        except RewriteError:
            g = g0
            continue
        digest = unshard(g).digest
        key = low.unsubstituted_key(g)
        assert seen.setdefault(key, digest) == digest
        merged += bool(merged_matmuls(g))
    assert len(seen) == 1 and merged  # one program, whatever the walk substituted (merged matmuls too)


def test_evaluator_facts_equal_those_of_the_unsharded_program():
    g = workloads.build("gpt", mode="train", batch=2, seq=8, layers=2)
    h = fuse_attention(g, _sites(g)[0])
    ev = Evaluator(HW)
    for x in (g, h):
        e = ev(x)
        ref = program_facts(unshard(x), HW, ev.lowerer.curves)
        assert e.lower_bound == ref.lower_bound and e.model_flops == ref.model_flops
        assert e.memory_floor == ref.memory_floor


def test_a_split_reductions_combine_fused_with_its_consumer_keeps_the_key():
    g = workloads.build("gpt", mode="train", batch=4, seq=8, layers=1, d_model=16, heads=2, vocab=32,
                        dtype="bfloat16")
    low = Lowerer(HW)
    h = split_reduction(g, "l0.ln1.dbeta", 2)
    acc = "l0.ln1.dbeta.acc"
    (consumer, _port), = g.consumers[g.ops["l0.ln1.dbeta"].output]  # the weight's cast gradient
    f = fuse(h, acc, consumer)
    assert low.unsubstituted_key(f) == low.unsubstituted_key(h) == low.unsubstituted_key(g)
    assert unshard(f).digest == unshard(g).digest


@pytest.mark.parametrize("name,kw", [("gpt", dict(batch=2, seq=8, layers=2)),
                                     ("llama", dict(batch=2, seq=8, kv_heads=2, layers=2))])
def test_a_childs_program_from_its_parents_equals_the_program_keyed_whole(name, kw):
    """``Lowerer.program_of`` numbers a structural child's program from its parent's
    (``_program_of_recent``: the same program, or the parent's key less the replaced ops' entries
    plus the new ones'); the number is the one keying the child whole gives."""
    g0 = workloads.build(name, mode="train", **kw)
    low = Lowerer(HW)
    rng = np.random.default_rng(4)
    g, same, other = g0, 0, 0
    low.lower(g0)
    for _ in range(120):
        try:
            child, _m = random_rewrite(g, rng, 8, max_shards_per_op=8)
        except RewriteError:
            g = g0
            low.lower(g)
            continue
        parent = low._states[-1].struct.program
        number = low._program_of_recent(child)
        if number is not None:
            assert number == low._program_number(low._program_key(child))
            same += number == parent
            other += number != parent
        low.lower(child)
        if rng.random() < 0.7:
            g = child
        else:
            low.lower(g)  # the parent is the latest state again
    assert same >= 20 and other >= 3


def _wired(post: bool):
    """Two programs with the same ops (names, kernels, params) and ends, wired apart: the relu
    and the second reduction read the wide product or the narrow one."""
    b = GraphBuilder()
    x = b.input("x", (8192, 1024))
    wide = b.einsum(x, b.parameter("W", (1024, 8192)), equation="ij,jk->ik", name="a")
    narrow = b.einsum(x, b.parameter("V", (1024, 16)), equation="ij,jk->ik", name="b")
    u1 = b.reduce_sum(b.relu(narrow if post else wide, name="e"), name="r1")
    u2 = b.reduce_sum(wide if post else narrow, name="r2")
    return b.build(outputs=[b.add(u1, u2, name="s")])


def test_programs_wired_apart_never_share_their_facts():
    """The entries of a program's key name its ops, not their wiring; the key's ``Ends`` (the
    source and output Tensor objects) keeps two programs built apart apart. One evaluator (a
    worker's, shared by campaigns) used to hand the second the first's bound and FLOPs."""
    p, q = _wired(False), _wired(True)
    ref = [program_facts(x, HW, None) for x in (p, q)]
    assert ref[0].model_flops != ref[1].model_flops and ref[0].lower_bound != ref[1].lower_bound
    ev = Evaluator(HW, curves=None)
    for x, f in zip((p, q, p), ref + ref[:1]):
        e = ev(x)
        assert (e.lower_bound, e.model_flops, e.memory_floor) == (f.lower_bound, f.model_flops, f.memory_floor)
    low = Lowerer(HW)
    assert low.program_of(p) != low.program_of(q)
    assert low.unsubstituted_key(p) != low.unsubstituted_key(q)


def test_a_program_built_again_finds_its_facts_by_digest(monkeypatch):
    """A program rebuilt (or a plan parsed afresh) has new Tensor objects, so a new key; its
    facts are found by the unsharded program's digest, not computed again."""
    import importlib

    evaluate = importlib.import_module("costmodel.evaluate")  # (the package exports a function of that name)
    calls = []
    real = evaluate.program_facts
    monkeypatch.setattr(evaluate, "program_facts", lambda *a: calls.append(1) or real(*a))
    ev = Evaluator(HW, curves=None)
    a, b = _wired(False), _wired(False)
    assert ev.lowerer.program_of(a) != ev.lowerer.program_of(b)
    assert ev(a).lower_bound == ev(b).lower_bound
    assert len(calls) == 1
    assert ev(_wired(True)).lower_bound != ev(a).lower_bound and len(calls) == 2
