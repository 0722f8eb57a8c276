"""Mutation operators: every operator keeps plans valid and meaning-preserving; weights adapt."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import verify
from ir import workloads
from ir.rewrites import RewriteError, parse_move
from ir.validate import validate
from optimizer.search.baselines import data_parallel, megatron_mlp
from optimizer.search.mutation import OPERATORS, AdaptiveWeights, Crossover, MutationContext

PROGRAMS = {
    "mlp": workloads.build("mlp", batch=8, widths=[16, 32, 16]),
    "transformer": workloads.build("transformer", batch=2, seq=8, d_model=16, heads=2, d_ff=32),
    "convnet": workloads.build("convnet", batch=2, channels=[3, 4, 4], size=8),
}


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(PROGRAMS)), seed=st.integers(0, 2**32 - 1), n_dev=st.integers(2, 8))
def test_operator_walks_stay_valid_and_equivalent(name, seed, n_dev):
    g = PROGRAMS[name]
    rng = np.random.default_rng(seed)
    ctx = MutationContext(n_dev, 16)
    pool = [g]
    h = g
    for _ in range(12):
        op = sorted(OPERATORS)[int(rng.integers(len(OPERATORS)))]
        ctx.mates = pool
        try:
            child, move = OPERATORS[op](h, rng, ctx)
        except RewriteError:
            continue
        assert validate(child) == [], (op, str(move))
        if not isinstance(move, Crossover):  # every other move replays from its text
            assert parse_move(str(move)).apply(h).digest == child.digest
        pool.append(child)
        h = child
    assert verify(h, reference=g).ok


def test_crossover_takes_whole_op_shardings_from_the_mate():
    g = PROGRAMS["mlp"]
    a, b = data_parallel(g, 4), megatron_mlp(g, 4)
    rng = np.random.default_rng(1)
    child, move = OPERATORS["crossover"](a, rng, MutationContext(4, 16, mates=[a, b]))
    assert move.ops and set(move.ops) <= {"fc1", "act1"}  # fc2 is a different operation once split
    for n in child.ops:
        src = b if n in move.ops else a
        assert child.ops[n].shards is src.ops[n].shards
    assert str(move).startswith(f"crossover{{mate={b.digest[:16]}")
    with pytest.raises(RewriteError, match="no crossover partner"):
        OPERATORS["crossover"](a, rng, MutationContext(4, 16, mates=[a]))


def test_adaptive_weights_favour_operators_that_win():
    w = AdaptiveWeights({"a": 1.0, "b": 1.0})
    for _ in range(50):
        w.record("a", True)
        w.record("b", False)
    names, p = w.probabilities()
    # the floor (5% shared out before renormalising) keeps a losing operator alive
    assert p[names.index("a")] > 0.9 and p[names.index("b")] >= 0.024
    assert AdaptiveWeights.from_json(w.to_json()).probabilities()[1].tolist() == p.tolist()
    fixed = AdaptiveWeights({"a": 1.0, "b": 3.0}, adaptive=False)
    assert fixed.probabilities()[1].tolist() == [0.25, 0.75]
