"""``random_rewrite``: draw one legal rewrite (the search calls this millions of times).

Draws a move kind by weight, builds a concrete move from cheap facts about the graph, and
applies it; an illegal draw is retried (bounded). Returns the new graph and the move.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ir.graph import Graph
from ir.rewrites import moves as M
from ir.rewrites.errors import RewriteError
from ir.rewrites.fusion import fusable
from ir.rewrites.substitute_attention import attention_sites, fused_attentions
from ir.rewrites.substitute_merge import merge_sites, merged_matmuls, stack_letters
from ir.rewrites.substitute_norm import fused_norms, norm_sites
from ir.rewrites.substitute_reassoc import reassociated, reassociation_sites

DEFAULT_WEIGHTS: dict[str, float] = {
    "split": 3.0, "merge": 1.5, "place": 2.0, "move": 1.0, "split_reduction": 0.6,
    "merge_reduction": 0.3, "fuse": 0.6, "unfuse": 0.3, "fuse_attention": 0.4, "unfuse_attention": 0.1,
    "fuse_norm": 0.2, "unfuse_norm": 0.05, "merge_matmuls": 0.1, "split_matmuls": 0.05,
    "reassociate": 0.1, "unreassociate": 0.03,
}


def _reducible(g: Graph) -> list[str]:
    return [n for n, o in g.ops.items() if o.kernel != "fused" and not o.params.get("split")
            and g.signature(n).reductions]


def _split(g: Graph) -> list[str]:
    return [n for n, o in g.ops.items() if o.params.get("split")]


def _fused(g: Graph) -> list[str]:
    return [n for n, o in g.ops.items() if o.kernel == "fused"]


def _fusable(g: Graph) -> list[tuple[str, str]]:
    return [(g.producers[t], r[0][0]) for t, r in g.consumers.items()
            if len(r) == 1 and t in g.producers and fusable(g, g.producers[t], r[0][0]) is None]


#: each candidate list of :class:`Structure` and the function that finds it
_FINDERS = {
    "reducible": _reducible, "split": _split, "fused": _fused, "fusable": _fusable,
    "attention_sites": attention_sites, "attentions": fused_attentions, "norm_sites": norm_sites,
    "norms": fused_norms, "merge_sites": merge_sites, "merged": merged_matmuls,
    "reassoc_sites": reassociation_sites, "reassociated": reassociated,
}


class Structure:
    """Candidates of the structural moves (the lists named in ``_FINDERS``). They depend on the
    ops' kernels, params and tensors, never on shards; every structural rewrite (fuse, unfuse,
    reduction split and merge, substitutions) makes a new tensor table, so the table object
    identifies the structure and keys this cache. Each list is found on first use: a draw needs
    one of them, and after a structural move the next draw meets a new structure (finding all of
    them took ~0.3 s on a GPT-2 small training step, most of a search step)."""

    def __init__(self, g: Graph) -> None:
        self.g = g

    def __getattr__(self, name: str) -> list:
        finder = _FINDERS.get(name)
        if finder is None:
            raise AttributeError(name)
        value = finder(self.g)
        setattr(self, name, value)  # found once: later reads hit the instance dict
        return value


_STRUCTURES: dict[int, tuple[object, Structure]] = {}


def structure(g: Graph) -> Structure:
    hit = _STRUCTURES.get(id(g.tensors))
    if hit is not None and hit[0] is g.tensors:
        return hit[1]
    if len(_STRUCTURES) > 256:
        _STRUCTURES.clear()
    st = _STRUCTURES[id(g.tensors)] = (g.tensors, Structure(g))  # holding the table keeps its id unique
    return st[1]


def _choice(rng: np.random.Generator, seq: list):
    return seq[int(rng.integers(len(seq)))]


def draw_move(g: Graph, rng: np.random.Generator, n_devices: int, kind: str,
              max_shards_per_op: int) -> M.Move | None:
    """A concrete move of ``kind`` for ``g``, or ``None`` when none is possible."""
    names = list(g.ops)
    if kind in ("split", "merge", "place", "move"):
        o = g.ops[_choice(rng, names)]
        sig = g.signature(o)
        sh = o.shards
        if not sig.dims and kind in ("split", "merge"):  # a 0-d index space can still be placed
            return None
        d = int(rng.integers(len(sig.dims))) if sig.dims else 0
        if kind == "split":
            ext = int((sh.hi[:, d] - sh.lo[:, d]).min())
            room = max_shards_per_op // len(sh)
            options = [p for p in (2, 2, 3, 4, 8) if p <= min(ext, room)]
            return M.Split(o.name, sig.dims[d], _choice(rng, options)) if options else None
        if kind == "merge":
            split_dims = [k for k in range(sh.ndim) if len(sh) > 1 and sh.lo[:, k].min() != sh.lo[:, k].max()]
            if not split_dims:
                return None
            d = split_dims[int(rng.integers(len(split_dims)))]
            return M.Merge(o.name, sig.dims[d], None if rng.random() < 0.5 else 2)
        if kind == "place":
            k = min(len(sh), n_devices)
            start = int(rng.integers(n_devices))
            stride = 1 if rng.random() < 0.8 else max(1, n_devices // k)
            return M.Place(o.name, tuple((start + i * stride) % n_devices for i in range(k)))
        return M.MoveShard(o.name, int(rng.integers(len(sh))), int(rng.integers(n_devices)))
    if kind == "split_reduction":
        cands = structure(g).reducible
        if not cands:
            return None
        n = _choice(rng, cands)
        red = _choice(rng, list(g.signature(n).reductions))
        parts = [p for p in (2, 4, 8) if red.extent % p == 0 and p <= n_devices * 2]
        return M.SplitReduction(n, _choice(rng, parts), red.name) if parts else None
    if kind == "merge_reduction":
        cands = structure(g).split
        return M.MergeReduction(_choice(rng, cands)) if cands else None
    if kind == "fuse":
        pairs = structure(g).fusable
        return M.Fuse(*_choice(rng, pairs)) if pairs else None
    if kind == "unfuse":
        cands = structure(g).fused
        return M.Unfuse(_choice(rng, cands)) if cands else None
    if kind == "fuse_attention":
        cands = structure(g).attention_sites
        return M.FuseAttention(_choice(rng, cands)) if cands else None
    if kind == "unfuse_attention":
        cands = structure(g).attentions
        return M.UnfuseAttention(_choice(rng, cands)) if cands else None
    if kind == "fuse_norm":
        cands = structure(g).norm_sites
        return M.FuseNorm(_choice(rng, cands)) if cands else None
    if kind == "unfuse_norm":
        cands = structure(g).norms
        return M.UnfuseNorm(_choice(rng, cands)) if cands else None
    if kind == "merge_matmuls":
        cands = structure(g).merge_sites
        if not cands:
            return None
        ops = _choice(rng, cands)
        return M.MergeMatmuls(ops, _choice(rng, stack_letters(g, ops[0])))
    if kind == "split_matmuls":
        cands = structure(g).merged
        return M.SplitMatmuls(_choice(rng, cands)) if cands else None
    if kind == "reassociate":
        cands = structure(g).reassoc_sites
        return M.Reassociate(*_choice(rng, cands)) if cands else None
    if kind == "unreassociate":
        cands = structure(g).reassociated
        return M.Unreassociate(_choice(rng, cands)) if cands else None
    raise ValueError(f"unknown move kind {kind!r}; kinds are {sorted(DEFAULT_WEIGHTS)}")


def random_rewrite(g: Graph, rng: np.random.Generator, n_devices: int,
                   weights: Mapping[str, float] | None = None, max_shards_per_op: int | None = None,
                   tries: int = 40) -> tuple[Graph, M.Move]:
    """Apply one randomly drawn legal rewrite; raises ``RewriteError`` if none was found."""
    w = dict(DEFAULT_WEIGHTS if weights is None else weights)
    kinds = [k for k, v in w.items() if v > 0]
    p = np.array([w[k] for k in kinds], dtype=float)
    p /= p.sum()
    cap = max_shards_per_op or max(8, 4 * n_devices)
    for _ in range(tries):
        kind = kinds[int(rng.choice(len(kinds), p=p))]
        move = draw_move(g, rng, n_devices, kind, cap)
        if move is None:
            continue
        try:
            return move.apply(g), move
        except RewriteError:
            continue
    raise RewriteError(f"no legal rewrite found in {tries} draws")


def random_walk(g: Graph, rng: np.random.Generator, n_devices: int, steps: int, **kwargs: object) -> Graph:
    """``g`` after up to ``steps`` random legal rewrites (``random_rewrite``; ``kwargs`` go to it);
    the walk ends early where no legal rewrite is found."""
    for _ in range(steps):
        try:
            g, _move = random_rewrite(g, rng, n_devices, **kwargs)  # type: ignore[arg-type]
        except RewriteError:
            break
    return g
