"""Activation recomputation: meaning-preserving, undone by unshard, memory traded for FLOPs."""

from __future__ import annotations

import pytest

from executor.verify import verify
from ir import workloads
from ir.rewrites import RewriteError, parse_move, unshard
from ir.rewrites.recompute import backward_ops, recompute, recompute_block, unrecompute

TINY = dict(layers=2, d_model=8, heads=2, d_ff=12, vocab=10, seq=4, batch=2)


def _step():
    return workloads.build("gpt", mode="train", optimizer="sgd", **TINY)


def test_recompute_one_op_rewires_backward_readers():
    step = _step()
    p = recompute(step, ["l0.ff1"])
    assert p.ops["l0.ff1.re"].kernel == "linear" and p.ops["l0.ff1.re"].inputs == step.ops["l0.ff1"].inputs
    readers = {r for r, _ in p.consumers["l0.ff1.out"]}
    assert readers and not readers & backward_ops(p)  # only forward ops read the original now
    assert {r for r, _ in p.consumers["l0.ff1.out.re"]} <= backward_ops(p)
    assert verify(p, reference=step).ok
    assert unshard(p).digest == step.digest and unrecompute(p).digest == step.digest


def test_recompute_block_chains_copies_from_the_checkpoint():
    step = _step()
    p = recompute_block(step, "l1.")
    copies = [n for n in p.ops if n.endswith(".re")]
    assert "l1.ff_act.re" in copies and "l1.attn_softmax.re" in copies
    # The copy of ff_act reads the copy of ff1, not the kept forward output.
    assert dict(p.ops["l1.ff_act.re"].inputs)["x"] == "l1.ff1.out.re"
    assert verify(p, reference=step).ok
    assert unshard(p).digest == step.digest


def test_move_text_round_trips():
    step = _step()
    m = parse_move("recompute{prefix=l0.}")
    assert str(m) == "recompute{prefix=l0.}"
    assert m.apply(step).digest == recompute_block(step, "l0.").digest
    assert str(parse_move("recompute{op=l0.ff1}")) == "recompute{op=l0.ff1}"


@pytest.mark.parametrize("ops,message", [
    (["l0.ff1.dx"], "a backward op"),
    (["lm_head"], None),
    (["nope"], "no operation 'nope'"),
])
def test_refusals(ops, message):
    step = _step()
    if message is None:  # the head's output is read by the loss ops, which are not backward ops
        p = recompute(step, ops)
        assert "lm_head.re" in p.ops
        return
    with pytest.raises(RewriteError, match=message):
        recompute(step, ops)


def test_forward_programs_and_double_recompute_are_refused():
    with pytest.raises(RewriteError, match="needs a training step"):
        recompute(workloads.build("gpt", **TINY), ["l0.ff1"])
    p = recompute(_step(), ["l0.ff1"])
    with pytest.raises(RewriteError, match="already recomputed"):
        recompute(p, ["l0.ff1"])


def test_a_recomputed_layer_keeps_its_output_for_the_next_layer():
    """A layer's output is the next layer's input: the checkpoint, kept whole. Recomputing the
    layer copies what its own backward reads, not its output for the next layer's backward."""
    step = _step()
    p = recompute_block(step, "l0.")
    assert "l0.resid2.re" not in p.ops  # layer 0's last op: read by layer 1's backward only
    for r, _ in p.consumers["l0.resid2.out"]:
        assert not r.endswith(".re")
    assert all(r.startswith("l0.") for n in p.ops if n.endswith(".re")
               for r, _ in p.consumers[p.ops[n].output])
    assert verify(p, reference=step).ok


def test_unrecompute_by_prefix_undoes_a_layer():
    step = _step()
    p = parse_move("recompute{prefix=l1.}").apply(recompute(step, ["l0.ff1"]))
    back = parse_move("unrecompute{prefix=l1.}").apply(p)
    assert back.digest == recompute(step, ["l0.ff1"]).digest
    with pytest.raises(RewriteError, match="no recomputed op"):
        parse_move("unrecompute{prefix=l1.}").apply(back)
    with pytest.raises(RewriteError, match="exactly one"):
        parse_move("unrecompute{}").apply(p)


def test_unshard_undoes_recomputed_fused_ops_and_fused_copies():
    """A copy of a fused op (``a+b.re``) cannot be unfused beside its original, and copies fused
    after the recomputation (``a.re+b.re``) only become copies once unfused: ``unshard`` handles
    both orders (a search met the first one and its evaluation failed)."""
    from ir.rewrites.fusion import fuse

    step = _step()
    fused_first = recompute(fuse(step, "l0.o_proj", "l0.resid1"), ["l0.o_proj+l0.resid1"])
    assert "l0.o_proj+l0.resid1.re" in fused_first.ops
    copies_fused = fuse(recompute(step, ["l0.o_proj", "l0.resid1"]), "l0.o_proj.re", "l0.resid1.re")
    assert "l0.o_proj.re+l0.resid1.re" in copies_fused.ops
    for p in (fused_first, copies_fused):
        assert unshard(p).digest == step.digest
        assert verify(p, reference=step).ok
