"""Constant folding (``ir.folding``): ops computed from weights alone run once, at load time."""

from __future__ import annotations

import numpy as np

from costmodel import Evaluator
from costmodel.lowering import Lowerer
from costmodel.presets import preset
from ir.autodiff import training_step
from ir.builder import GraphBuilder
from ir.folding import fold_constants, folded_ops
from ir.rewrites import place


def packed():
    """y = relu(x @ concat(A, B)) @ concat(C, D) transposed twice: two weight-only chains."""
    b = GraphBuilder()
    x = b.input("x", (8, 4))
    w = b.concat(b.parameter("A", (4, 3)), b.parameter("B", (4, 3)), name="cat", axis=1)
    y = b.matmul(x, w, name="mm")
    ct = b.transpose(b.concat(b.parameter("C", (3, 4)), b.parameter("D", (3, 4)), name="cat2", axis=0),
                     name="ct", perm=[1, 0])
    b.matmul(b.relu(y, name="act"), b.transpose(ct, name="back", perm=[1, 0]), name="mm2", out="y")
    return b.build(outputs=["y"])


def test_weight_only_ops_fold_and_become_weights():
    g = packed()
    assert folded_ops(g) == ("cat", "cat2", "ct", "back")  # chains of them too, in op order
    f = fold_constants(g)
    assert list(f.ops) == ["mm", "act", "mm2"]
    assert f.tensors["cat.out"].role == "parameter" and f.tensors["back.out"].role == "parameter"
    assert fold_constants(g) is f  # memoised on the plan
    h = place(g, "mm", [1])  # a shard move shares the tensor table, and so the folded one
    assert fold_constants(h).tensors is f.tensors and list(fold_constants(h).ops) == ["mm", "act", "mm2"]


def test_the_cost_model_lowers_the_folded_plan():
    g = place(packed(), "mm", [1])
    hw = preset("h100-sxm-8")
    low = Lowerer(hw, runtime=True).lower(g)  # as a runtime runs it (the Evaluator's lowering)
    assert low.op_names == ("mm", "act", "mm2")
    # as this repository's executor runs it (every op, every run): what measurements are predicted with
    assert Lowerer(hw).lower(g).op_names == ("cat", "mm", "cat2", "ct", "act", "back", "mm2")
    # the folded weights are resident where they are read (x and the stacked A|B on device 1, C|D
    # transposed twice on device 0), the originals nowhere
    assert low.resident[1] == (8 * 4 + 4 * 6) * 4
    assert low.resident[0] == 6 * 4 * 4
    # as if the program had read that weight directly
    b = GraphBuilder()
    x = b.input("x", (8, 4))
    y = b.matmul(x, b.parameter("cat.out", (4, 6)), name="mm")
    b.matmul(b.relu(y, name="act"), b.parameter("back.out", (6, 4)), name="mm2", out="y")
    ref = place(b.build(outputs=["y"]), "mm", [1])
    ev = Evaluator("h100-sxm-8")
    assert ev(g).makespan == ev(ref).makespan


def test_nothing_folds_where_the_weights_change_or_a_weight_is_an_output():
    g = packed()
    assert folded_ops(training_step(g)) == ()  # trained weights are loop-carried: the concat runs every step
    b = GraphBuilder()
    w = b.transpose(b.parameter("A", (4, 3)), name="t", perm=[1, 0])
    b.matmul(b.input("x", (2, 3)), w, name="mm")
    g2 = b.build(outputs=["t.out", "mm.out"])
    assert folded_ops(g2) == ()  # an output is computed (and written) by the step
    assert np.isfinite(Evaluator("h100-sxm-8")(g2).makespan)


def _full_pass(g):
    """``folded_ops`` of ``g`` found by the pass over every op (a fresh table has no lineage)."""
    from ir.graph import Graph

    return folded_ops(Graph(dict(g.tensors), dict(g.ops)))


def test_a_child_of_a_plan_that_folds_nothing_is_told_without_the_pass_and_rightly():
    from ir.folding import _folds_nothing
    from ir.graph import Op, Tensor

    b = GraphBuilder()
    x = b.input("x", (8, 4))
    y = b.matmul(x, b.parameter("A", (4, 3)), name="mm")
    b.relu(y, name="act", out="y")
    g = b.build(outputs=["y"])
    assert folded_ops(g) == ()
    # an edit that adds nothing foldable: the child's answer comes from its origin's
    h = g.with_ops(insert_after={"act": [Op("neg", "relu", (("x", "y"),), "neg.out")]},
                   tensors={"neg.out": Tensor("neg.out", (8, 3))})
    assert _folds_nothing(h) and folded_ops(h) == _full_pass(h) == ()
    # a new op reading weights only folds
    t = Op("t", "transpose", (("x", "A"),), "t.out", {"perm": [1, 0]})
    h = g.with_ops(insert_after={"mm": [t]}, tensors={"t.out": Tensor("t.out", (3, 4))})
    assert not _folds_nothing(h) and folded_ops(h) == _full_pass(h) == ("t",)
    # an input made a weight: the op reading it and a weight folds
    h = g.with_ops(tensors={"x": Tensor("x", (8, 4), "float32", "parameter")})
    assert not _folds_nothing(h) and folded_ops(h) == _full_pass(h) == ("mm",)  # (act writes the output)
    # trained weights that stop being carried (their next values gone) fold again
    s = training_step(packed())
    assert folded_ops(s) == ()
    gone = {n: None for n in s.tensors if n.endswith(".next")}
    h = s.with_ops(tensors=gone)
    assert not _folds_nothing(h) and folded_ops(h) == _full_pass(h) != ()
    # a weights-only op whose output stops being a graph output folds
    b = GraphBuilder()
    w = b.transpose(b.parameter("A", (4, 3)), name="t", perm=[1, 0])
    b.matmul(b.input("x", (2, 3)), w, name="mm")
    g2 = b.build(outputs=["t.out", "mm.out"])
    assert folded_ops(g2) == ()
    h = g2.with_ops(tensors={"t.out": Tensor("t.out", (3, 4))})
    assert not _folds_nothing(h) and folded_ops(h) == _full_pass(h) == ("t",)
