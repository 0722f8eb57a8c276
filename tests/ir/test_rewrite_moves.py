"""Moves as data: every move prints and parses back to itself, and applies like its function."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from ir.rewrites import MOVES, RewriteError, parse_move, random_rewrite
from ir.rewrites import moves as M

EXAMPLES = [
    M.Split("fc1", "o", 4),
    M.Merge("fc1", "o"),
    M.Merge("fc1", "n", 2),
    M.Retile("fc1", (2, 3)),
    M.Retile("fc1", (2, 3), (0, 5, 7)),
    M.Place("act1", (1, 2, 3)),
    M.MoveShard("act1", 2, 6),
    M.SplitReduction("fc2", 4),
    M.SplitReduction("o_proj", 2, "h"),
    M.MergeReduction("fc2"),
    M.Fuse("fc1", "act1"),
    M.Unfuse("fc1+act1"),
    M.Unfuse("fc2.acc+act2"),
    M.Sequence((M.Split("fc1", "o", 2), M.Place("fc1", (0, 1)))),
]


SAMPLE = {"str": "fc1+act1", "int": 3, "int | None": 2, "str | None": "f", "tuple[int, ...]": (2, 0, 5),
          "tuple[int, ...] | None": (1, 4), "tuple[str, ...]": ("q_proj", "l0.k_proj+x")}


def sample_moves(cls: type) -> list:
    """Instances of a move class built from its field types: all fields set, and optional ones left out."""
    full = cls(**{f.name: SAMPLE[str(f.type)] for f in fields(cls)})
    required = cls(**{f.name: SAMPLE[str(f.type)] for f in fields(cls) if "None" not in str(f.type)})
    return [full, required]


def test_examples_cover_every_move_kind():
    assert {type(m) for m in EXAMPLES} >= {M.Split, M.Merge, M.Retile, M.Place, M.MoveShard, M.SplitReduction,
                                           M.MergeReduction, M.Fuse, M.Unfuse, M.Sequence}


@pytest.mark.parametrize("m", EXAMPLES, ids=str)
def test_parse_of_str_is_identity(m):
    assert parse_move(str(m)) == m


@pytest.mark.parametrize("kind", sorted(MOVES))
def test_parse_of_str_is_identity_for_every_registered_kind(kind):
    for m in sample_moves(MOVES[kind]):
        assert parse_move(str(m)) == m, str(m)


def test_text_form():
    assert str(M.Split("fc1", "o", 4)) == "split{op=fc1,dim=o,parts=4}"
    assert str(M.Retile("fc1", (2, 3), (0, 1))) == "retile{op=fc1,parts=[2,3],devices=[0,1]}"
    assert str(M.Merge("fc1", "o")) == "merge{op=fc1,dim=o}"
    assert str(EXAMPLES[-1]) == "split{op=fc1,dim=o,parts=2}; place{op=fc1,devices=[0,1]}"


def test_moves_apply_like_functions(kit, mlp):
    seq = parse_move("split{op=fc1,dim=o,parts=4}; place{op=fc1,devices=[0,1]}; move{op=fc1,shard=3,device=5}; "
                     "split_reduction{op=fc2,parts=2}; fuse{producer=fc1,consumer=act1}")
    h = seq.apply(mlp)
    assert h.ops["fc1+act1"].shards.device.tolist() == [0, 1, 0, 5]
    assert "fc2.acc" in h.ops
    kit.assert_rewrite_ok(h, mlp)


@pytest.mark.parametrize("text,message", [
    ("explode{op=fc1}", "cannot parse move"),
    ("split op=fc1", "cannot parse move"),
    ("split{op=fc1,dim=o,parts=4,colour=red}", "no argument 'colour'"),
    ("split{op=fc1,dim=o}", "missing 1 required positional argument"),
])
def test_parse_errors(text, message):
    with pytest.raises(RewriteError, match=message):
        parse_move(text)


def test_random_lineage_replays_from_text(kit):
    g = kit.small("transformer")
    rng = np.random.default_rng(7)
    h, lineage = g, []
    for _ in range(25):
        h, m = random_rewrite(h, rng, 4)
        lineage.append(str(m))
        assert parse_move(str(m)) == m
    replayed = parse_move("; ".join(lineage)).apply(g)
    assert replayed.digest == h.digest


def test_random_walk_takes_legal_steps_and_stops_when_stuck():
    import numpy as np

    from ir import workloads
    from ir.rewrites import random_walk, unshard
    from ir.validate import validate

    g0 = workloads.mlp(batch=8, widths=(16, 32, 16))
    g = random_walk(g0, np.random.default_rng(1), 4, 12)
    assert g.digest != g0.digest and not validate(g)
    assert unshard(g).digest == unshard(g0).digest
    assert random_walk(g0, np.random.default_rng(1), 4, 12).digest == g.digest  # same seed, same walk
    assert random_walk(g0, np.random.default_rng(1), 4, 0) is g0
    # only merges on an unsharded program: nothing is legal, the walk ends where it started
    assert random_walk(g0, np.random.default_rng(1), 4, 5, weights={"merge": 1.0}) is g0
