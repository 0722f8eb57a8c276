"""Mutation operators for the search, with weights that adapt to success.

Each operator takes ``(g, rng, ctx)`` and returns ``(child, move)`` where ``move`` is an
``ir.rewrites.moves.Move`` (printable, replayable lineage) or raises ``RewriteError``.

- ``rewrite``: one ``ir.rewrites.random_rewrite`` (split, merge, place, move, reduction
  split/merge, fuse, unfuse);
- ``spread``: retile an op along one dim over a contiguous device mesh;
- ``align``: copy a neighbour's sharding (producer or consumer with the same index space);
- ``fuse_chain``: fuse a producer with its elementwise consumers along a chain;
- ``reduce_spread``: split a hidden reduction k ways and spread the partials over k devices;
- ``layout_all``: the same (dim 0, k devices) spread for every op (a data-parallel jump);
- ``layout`` / ``two_level`` (``optimizer.search.layouts``): a region laid out on a device mesh
  (TP x DP, DP x CP, FSDP, ... in one move), and a reduction split in two levels;
- ``recompute`` (``optimizer.search.recomputation``): a layer's forward recomputed in the
  backward (or one op of it), or its recomputation undone;
- ``crossover``: recombination with a mate from the task's front: each op that is the same
  operation in both plans (kernel, params, tensors) takes the mate's shards with probability ½.
  Shards of one op never constrain another's, so the child is valid by construction.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ir.graph import Graph
from ir.rewrites import RewriteError, fusable, random_rewrite
from ir.rewrites import moves as M
from ir.rewrites import unshard
from ir.rewrites.recompute import SUFFIX
from ir.rewrites.tie import tie
from optimizer.search.layouts import op_layout, op_pipeline, op_two_level
from optimizer.search.recomputation import op_recompute


@dataclass
class MutationContext:
    n_devices: int
    max_shards_per_op: int
    rewrite_weights: dict[str, float] | None = None
    mates: list[Graph] = field(default_factory=list)  # crossover partners (the task's front)
    devices_per_node: int | None = None  # for node-aligned meshes (None: 8 where it divides)


@dataclass(frozen=True)
class Crossover(M.Move):
    """Lineage of a crossover child: the mate's digest and the ops whose shards came from it.
    (Not replayable from text alone: replaying needs the mate plan from the archive.)"""

    mate: str
    ops: tuple[str, ...]
    kind = "crossover"

    def __str__(self) -> str:
        return f"crossover{{mate={self.mate[:16]},ops=[{','.join(self.ops)}]}}"


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


def _mesh(rng: np.random.Generator, k: int, n: int) -> tuple[int, ...]:
    """k consecutive devices starting at a multiple of k (stays inside a node when k divides it)."""
    start = int(rng.integers(max(1, n // k))) * k if k <= n else 0
    return tuple((start + i) % n for i in range(k))


def _sizes(n: int, extent: int, cap: int) -> list[int]:
    opts = [k for k in (2, 4, 8, 16, 32, 64) if k <= min(n, extent, cap)]
    if n <= min(extent, cap) and n not in opts:
        opts.append(n)
    return opts


def op_rewrite(g: Graph, rng: np.random.Generator, ctx: MutationContext):
    return random_rewrite(g, rng, ctx.n_devices, ctx.rewrite_weights, ctx.max_shards_per_op)


def op_spread(g: Graph, rng: np.random.Generator, ctx: MutationContext):
    name = _pick(rng, list(g.ops))
    sig = g.signature(name)
    if not sig.dims:
        raise RewriteError(f"{name} has no index dims")
    d = int(rng.integers(len(sig.dims)))
    opts = _sizes(ctx.n_devices, sig.extents[d], ctx.max_shards_per_op)
    if not opts:
        raise RewriteError(f"{name}: dim {sig.dims[d]} too short to spread")
    k = _pick(rng, opts)
    parts = tuple(k if i == d else 1 for i in range(len(sig.dims)))
    move = M.Retile(name, parts, _mesh(rng, k, ctx.n_devices))
    return move.apply(g), move


def op_align(g: Graph, rng: np.random.Generator, ctx: MutationContext):
    name = _pick(rng, list(g.ops))
    o = g.ops[name]
    ext = g.signature(o).extents
    nbrs = [g.producers[t] for _, t in o.inputs if t in g.producers]
    nbrs += [c for c, _ in g.consumers.get(o.output, [])]
    nbrs = [n for n in nbrs if g.signature(n).extents == ext and g.ops[n].shards != o.shards]
    if not nbrs:
        raise RewriteError(f"{name} has no differently sharded neighbour with its index space")
    move = M.Align(name, _pick(rng, nbrs))
    return move.apply(g), move


def op_fuse_chain(g: Graph, rng: np.random.Generator, ctx: MutationContext):
    pairs = [(g.producers[t], r[0][0]) for t, r in g.consumers.items()
             if len(r) == 1 and t in g.producers and fusable(g, g.producers[t], r[0][0]) is None]
    if not pairs:
        raise RewriteError("nothing to fuse")
    p, c = _pick(rng, pairs)
    moves = [M.Fuse(p, c)]
    g = moves[0].apply(g)
    name = f"{p}+{c}"
    for _ in range(3):  # extend the chain while the next consumer is fusable
        readers = g.consumers.get(g.ops[name].output, [])
        if len(readers) != 1 or fusable(g, name, readers[0][0]) is not None:
            break
        moves.append(M.Fuse(name, readers[0][0]))
        g = moves[-1].apply(g)
        name = f"{name}+{readers[0][0]}"
    return g, (moves[0] if len(moves) == 1 else M.Sequence(tuple(moves)))


def op_reduce_spread(g: Graph, rng: np.random.Generator, ctx: MutationContext):
    cands = [n for n, o in g.ops.items() if o.kernel != "fused" and not o.params.get("split")
             and g.signature(n).reductions]
    if not cands:
        raise RewriteError("no splittable reduction")
    name = _pick(rng, cands)
    red = _pick(rng, list(g.signature(name).reductions))
    opts = [k for k in _sizes(ctx.n_devices, red.extent, ctx.max_shards_per_op) if red.extent % k == 0]
    if not opts:
        raise RewriteError(f"{name}: reduction {red.name} does not split evenly")
    k = _pick(rng, opts)
    g1 = M.SplitReduction(name, k, red.name).apply(g)
    ndim = len(g1.signature(name).dims)
    devs = _mesh(rng, k, ctx.n_devices)
    seq = M.Sequence((M.SplitReduction(name, k, red.name), M.Retile(name, (k,) + (1,) * (ndim - 1), devs)))
    return seq.apply(g), seq


def op_layout_all(g: Graph, rng: np.random.Generator, ctx: MutationContext):
    k = _pick(rng, _sizes(ctx.n_devices, ctx.n_devices, ctx.max_shards_per_op) or [1])
    devs = _mesh(rng, k, ctx.n_devices)
    moves = []
    for name in g.ops:
        sig = g.signature(name)
        if sig.dims and sig.extents[0] >= k > 1:
            moves.append(M.Retile(name, (k,) + (1,) * (len(sig.dims) - 1), devs))
    if not moves:
        raise RewriteError("no op can be spread")
    seq = M.Sequence(tuple(moves))
    return seq.apply(g), seq


def op_crossover(g: Graph, rng: np.random.Generator, ctx: MutationContext):
    mates = [m for m in ctx.mates if m is not g]
    if not mates:
        raise RewriteError("no crossover partner")
    mate = _pick(rng, mates)
    same = [n for n, o in g.ops.items() if n in mate.ops and o.shards != mate.ops[n].shards
            and _same_operation(o, mate.ops[n])]
    if not same:
        raise RewriteError("the partner shares no differently sharded operation")
    take = [n for n in same if rng.random() < 0.5] or [_pick(rng, same)]
    child = g.with_ops({n: g.ops[n].replace(shards=mate.ops[n].shards) for n in take})
    return child, Crossover(mate.digest, tuple(take))


def _same_operation(a, b) -> bool:
    return (a.kernel == b.kernel and a.params_key == b.params_key and a.inputs == b.inputs
            and a.output == b.output)


_COPY = re.compile(re.escape(SUFFIX) + r"(?:$|[.+])")  # a recomputed copy's name (``l3.ff1.re``, ``a.re+b``)
_PROGRAMS: OrderedDict[str, str] = OrderedDict()  # plan digest -> its program's digest (``unshard``)


def _program_digest(g: Graph) -> str:
    d = _PROGRAMS.get(g.digest)
    if d is None:
        d = _PROGRAMS[g.digest] = unshard(g).digest
        if len(_PROGRAMS) > 256:
            _PROGRAMS.popitem(last=False)
    return d


def _copy_family(ops: Mapping[str, object]) -> set[str]:
    """The recomputed copies among ``ops`` and their originals, by name, a fused op's parts
    apart (``a.re+b`` holds the copy ``a.re`` of ``a``; ``l3.ff1.re.acc`` is a copy's too)."""
    family: set[str] = set()
    for name in ops:
        if _COPY.search(name) is None:
            continue
        for part in name.split("+"):
            m = _COPY.search(part)
            if m is not None:
                family.update((part, part[:m.start()]))
    return family


def _touches_copies(parent: Mapping[str, object], child: Mapping[str, object]) -> bool:
    """Whether an op that differs between ``parent`` and ``child`` (replaced, added or removed) is
    a recomputed copy or an original of one, or holds or derives from one: a part of its name
    (split at ``+``) is one, or extends one at a dot (``l3.ff1.acc`` of the original ``l3.ff1``)."""
    changed = [n for n in parent.keys() | child.keys() if parent.get(n) is not child.get(n)]
    if not changed:
        return False
    family = _copy_family(parent) | _copy_family(child)
    for name in changed:
        for part in name.split("+"):
            prefix = part
            while True:
                if prefix in family:
                    return True
                cut = prefix.rfind(".")
                if cut < 0:
                    break
                prefix = prefix[:cut]
    return False


def keeps_program(parent: Graph, child: Graph) -> bool:
    """Whether ``child`` still computes ``parent``'s program, checked where a rewrite may not
    know: a structural child holding recomputed copies (``.re`` ops). The rewrites are meaning-
    preserving on their own (property-tested), but a copy fused, split or substituted after the
    recomputation, or an original renamed under its copy, can leave a plan ``unshard`` cannot
    map back; such a child is not a plan of the program. Shard moves, plans without copies and
    children whose changed ops leave every copy and its original alone (``_touches_copies``; three
    in four structural children of a recomputing llama search) pass unchecked (one ``unshard``
    costs ~10 ms at a thousand ops)."""
    e = child.edit
    if e is not None and e.parent() is parent and all(
            n in parent.ops and n in child.ops and _same_operation(parent.ops[n], child.ops[n]) for n in e.replaced):
        return True  # shards only
    if not any(map(_COPY.search, child.ops)):
        return True
    if not _touches_copies(parent.ops, child.ops):
        return True  # every copy and its original as they were: the rewrite alone preserves meaning
    try:
        return _program_digest(child) == _program_digest(parent)
    except Exception:  # noqa: BLE001 - any failure to recover the program rejects the child
        return False


def mutate(parent: Graph, op: str, rng: np.random.Generator, ctx: MutationContext,
           tied: bool = False) -> tuple[Graph, M.Move]:
    """One child of ``parent`` by operator ``op`` (``OPERATORS``), its move made in every layer
    of its class when ``tied`` (``ir.rewrites.tie``); raises ``RewriteError`` when the operator
    finds no move or the child does not keep the program (``keeps_program``)."""
    child, move = OPERATORS[op](parent, rng, ctx)
    if tied:
        child = tie(parent, child)
    if not keeps_program(parent, child):
        raise RewriteError(f"{move}: the child no longer computes the program (recomputed copies)")
    return child, move


Operator = Callable[[Graph, np.random.Generator, MutationContext], tuple[Graph, M.Move]]
OPERATORS: dict[str, Operator] = {
    "rewrite": op_rewrite, "spread": op_spread, "align": op_align, "fuse_chain": op_fuse_chain,
    "reduce_spread": op_reduce_spread, "layout_all": op_layout_all, "crossover": op_crossover,
    "layout": op_layout, "two_level": op_two_level, "pipeline": op_pipeline, "recompute": op_recompute,
}
DEFAULT_OPERATOR_WEIGHTS = {"rewrite": 4.0, "spread": 2.0, "align": 2.0, "fuse_chain": 0.7,
                            "reduce_spread": 0.8, "layout_all": 0.3, "crossover": 1.5, "layout": 2.0,
                            "two_level": 0.4, "pipeline": 0.3, "recompute": 0.3}


@dataclass
class AdaptiveWeights:
    """Operator choice by base weight × (wins + 1) / (tries + 2), with a floor so none starves."""

    base: dict[str, float]
    adaptive: bool = True
    tries: dict[str, int] = field(default_factory=dict)
    wins: dict[str, int] = field(default_factory=dict)
    floor: float = 0.05

    def probabilities(self) -> tuple[list[str], np.ndarray]:
        names = [k for k, w in self.base.items() if w > 0]
        w = np.array([self.base[k] for k in names], dtype=float)
        if self.adaptive:
            rate = np.array([(self.wins.get(k, 0) + 1) / (self.tries.get(k, 0) + 2) for k in names])
            w = w * rate
        p = w / w.sum()
        p = np.maximum(p, self.floor / len(names))
        return names, p / p.sum()

    def choose(self, rng: np.random.Generator) -> str:
        names, p = self.probabilities()
        return names[int(rng.choice(len(names), p=p))]

    def record(self, name: str, win: bool) -> None:
        self.tries[name] = self.tries.get(name, 0) + 1
        if win:
            self.wins[name] = self.wins.get(name, 0) + 1

    def merge_stats(self, tries: dict[str, int], wins: dict[str, int]) -> None:
        for k, v in tries.items():
            self.tries[k] = self.tries.get(k, 0) + int(v)
        for k, v in wins.items():
            self.wins[k] = self.wins.get(k, 0) + int(v)

    def to_json(self) -> dict:
        return {"base": self.base, "adaptive": self.adaptive, "tries": self.tries, "wins": self.wins}

    @classmethod
    def from_json(cls, d: dict) -> AdaptiveWeights:
        return cls(dict(d["base"]), bool(d["adaptive"]), dict(d["tries"]), dict(d["wins"]))
