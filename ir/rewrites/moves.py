"""Rewrite moves as data: frozen dataclasses that apply, print and parse.

``str(Split("fc1", "o", 4)) == "split{op=fc1,dim=o,parts=4}"`` and ``parse_move`` reverses it,
so a candidate's lineage is stored as text and can be replayed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import ClassVar

from ir.graph import Graph
from ir.mesh import MeshError, parse_mesh
from ir.zspace import MAX_DIM
from ir.rewrites import (fusion, hierarchical, layout, pipeline, recompute, reduction, shard, substitute_attention,
                         substitute_merge, substitute_norm, substitute_reassoc)
from ir.rewrites.align import align as align_shards
from ir.rewrites.errors import RewriteError


@dataclass(frozen=True)
class Move:
    kind: ClassVar[str]

    def apply(self, g: Graph) -> Graph:
        raise NotImplementedError

    def __str__(self) -> str:
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            parts.append(f"{f.name}=" + ("[" + ",".join(map(str, v)) + "]" if isinstance(v, tuple) else str(v)))
        return f"{self.kind}{{{','.join(parts)}}}"


@dataclass(frozen=True)
class Split(Move):
    op: str
    dim: str
    parts: int
    kind: ClassVar[str] = "split"

    def apply(self, g: Graph) -> Graph:
        return shard.split(g, self.op, self.dim, self.parts)


@dataclass(frozen=True)
class Merge(Move):
    op: str
    dim: str
    factor: int | None = None
    kind: ClassVar[str] = "merge"

    def apply(self, g: Graph) -> Graph:
        return shard.merge(g, self.op, self.dim, self.factor)


@dataclass(frozen=True)
class Retile(Move):
    op: str
    parts: tuple[int, ...]
    devices: tuple[int, ...] | None = None
    kind: ClassVar[str] = "retile"

    def apply(self, g: Graph) -> Graph:
        return shard.retile(g, self.op, self.parts, self.devices)


@dataclass(frozen=True)
class Place(Move):
    op: str
    devices: tuple[int, ...]
    kind: ClassVar[str] = "place"

    def apply(self, g: Graph) -> Graph:
        return shard.place(g, self.op, self.devices)


@dataclass(frozen=True)
class MoveShard(Move):
    op: str
    shard: int
    device: int
    kind: ClassVar[str] = "move"

    def apply(self, g: Graph) -> Graph:
        return shard.move(g, self.op, self.shard, self.device)


@dataclass(frozen=True)
class SplitReduction(Move):
    op: str
    parts: int
    reduction: str | None = None
    kind: ClassVar[str] = "split_reduction"

    def apply(self, g: Graph) -> Graph:
        return reduction.split_reduction(g, self.op, self.parts, self.reduction)


@dataclass(frozen=True)
class MergeReduction(Move):
    op: str
    kind: ClassVar[str] = "merge_reduction"

    def apply(self, g: Graph) -> Graph:
        return reduction.merge_reduction(g, self.op)


@dataclass(frozen=True)
class Fuse(Move):
    producer: str
    consumer: str
    kind: ClassVar[str] = "fuse"

    def apply(self, g: Graph) -> Graph:
        return fusion.fuse(g, self.producer, self.consumer)


@dataclass(frozen=True)
class Unfuse(Move):
    op: str
    kind: ClassVar[str] = "unfuse"

    def apply(self, g: Graph) -> Graph:
        return fusion.unfuse(g, self.op)


@dataclass(frozen=True)
class Align(Move):
    op: str
    like: str
    kind: ClassVar[str] = "align"

    def apply(self, g: Graph) -> Graph:
        return align_shards(g, self.op, self.like)


@dataclass(frozen=True)
class FuseAttention(Move):
    """Substitute the attention pattern whose scores op is ``op`` by one ``attention`` op."""

    op: str
    kind: ClassVar[str] = "fuse_attention"

    def apply(self, g: Graph) -> Graph:
        return substitute_attention.fuse_attention(g, self.op)


@dataclass(frozen=True)
class UnfuseAttention(Move):
    """Restore the ops an ``attention`` op replaced."""

    op: str
    kind: ClassVar[str] = "unfuse_attention"

    def apply(self, g: Graph) -> Graph:
        return substitute_attention.unfuse_attention(g, self.op)


@dataclass(frozen=True)
class Recompute(Move):
    """``recompute{op=l3.ff1}`` or a whole block ``recompute{prefix=l3.}`` (``ir.rewrites.recompute``)."""

    op: str | None = None
    prefix: str | None = None
    kind: ClassVar[str] = "recompute"

    def apply(self, g: Graph) -> Graph:
        if (self.op is None) == (self.prefix is None):
            raise RewriteError("recompute takes exactly one of op=NAME or prefix=NAME_PREFIX")
        return recompute.recompute(g, [self.op]) if self.op else recompute.recompute_block(g, self.prefix)


@dataclass(frozen=True)
class Unrecompute(Move):
    """``unrecompute{op=l3.ff1}``, or every recomputed op of a block ``unrecompute{prefix=l3.}``."""

    op: str | None = None
    prefix: str | None = None
    kind: ClassVar[str] = "unrecompute"

    def apply(self, g: Graph) -> Graph:
        if (self.op is None) == (self.prefix is None):
            raise RewriteError("unrecompute takes exactly one of op=NAME or prefix=NAME_PREFIX")
        if self.op:
            return recompute.unrecompute(g, [self.op])
        ops = [n for n in recompute.recomputed(g) if n.startswith(self.prefix)]
        if not ops:
            raise RewriteError(f"no recomputed op name starts with {self.prefix!r}")
        return recompute.unrecompute(g, ops)


@dataclass(frozen=True)
class FuseNorm(Move):
    """Fuse the layernorm/rmsnorm ``norm`` into its reader ``op`` (default: into every reader)."""

    norm: str
    op: str | None = None
    kind: ClassVar[str] = "fuse_norm"

    def apply(self, g: Graph) -> Graph:
        return substitute_norm.fuse_norm(g, self.norm, self.op)


@dataclass(frozen=True)
class UnfuseNorm(Move):
    """Restore the contraction (and norm) a ``norm_matmul`` op replaced."""

    op: str
    kind: ClassVar[str] = "unfuse_norm"

    def apply(self, g: Graph) -> Graph:
        return substitute_norm.unfuse_norm(g, self.op)


@dataclass(frozen=True)
class MergeMatmuls(Move):
    """Merge contractions that share their input into one over concatenated weights (QKV),
    stacked along the weight letter ``along`` (None: the first it can be)."""

    ops: tuple[str, ...]
    along: str | None = None
    kind: ClassVar[str] = "merge_matmuls"

    def apply(self, g: Graph) -> Graph:
        return substitute_merge.merge_matmuls(g, self.ops, self.along)


@dataclass(frozen=True)
class SplitMatmuls(Move):
    """Undo ``merge_matmuls`` on the merged op ``op``."""

    op: str
    kind: ClassVar[str] = "split_matmuls"

    def apply(self, g: Graph) -> Graph:
        return substitute_merge.split_matmuls(g, self.op)


@dataclass(frozen=True)
class Reassociate(Move):
    """``(A·B)·R -> A·(B·R)`` (``keep=a``) or ``(A·R)·B`` (``keep=b``) for the chain ending at ``op``."""

    op: str
    keep: str | None = None
    kind: ClassVar[str] = "reassociate"

    def apply(self, g: Graph) -> Graph:
        return substitute_reassoc.reassociate(g, self.op, self.keep or "a")


@dataclass(frozen=True)
class Unreassociate(Move):
    """Restore the chain a ``reassociate`` rewrote."""

    op: str
    kind: ClassVar[str] = "unreassociate"

    def apply(self, g: Graph) -> Graph:
        return substitute_reassoc.unreassociate(g, self.op)


@dataclass(frozen=True)
class Sequence(Move):
    """Several moves applied in order (structured search moves are sequences)."""

    moves: tuple[Move, ...]
    kind: ClassVar[str] = "seq"

    def apply(self, g: Graph) -> Graph:
        for m in self.moves:
            g = m.apply(g)
        return g

    def __str__(self) -> str:
        return "; ".join(str(m) for m in self.moves)


@dataclass(frozen=True)
class Layout(Move):
    """A region layout (``ir.rewrites.layout``): ``layout{ops=all,mesh=8x8,use=b.t,node=8}``."""

    ops: str
    mesh: str
    use: str  # one use per mesh axis, joined by dots: b.t
    node: int = 8  # devices per node (names the axes, decides two-level reductions)
    kind: ClassVar[str] = "layout"

    def apply(self, g: Graph) -> Graph:
        try:
            mesh = parse_mesh(self.mesh, self.node)
        except MeshError as e:
            raise RewriteError(f"{self}: {e}") from None
        return layout.layout(g, self.ops, mesh, self.use.split("."))


@dataclass(frozen=True)
class TwoLevel(Move):
    """A two-level reduction (``ir.rewrites.hierarchical``): ``two_level{op=fc2.acc,group=8}``."""

    op: str
    group: int
    kind: ClassVar[str] = "two_level"

    def apply(self, g: Graph) -> Graph:
        return hierarchical.two_level(g, self.op, self.group)


@dataclass(frozen=True)
class Stage(Move):
    """Layers ``A:B`` (inclusive) on devices ``D0:D1`` (``ir.rewrites.pipeline``):
    ``stage{layers=4:7,devices=16:32}``."""

    layers: str
    devices: str
    kind: ClassVar[str] = "stage"

    def apply(self, g: Graph) -> Graph:
        return pipeline.stage(g, self.layers, self.devices)


@dataclass(frozen=True)
class Pipeline(Move):
    """``stages`` equal layer ranges, stage ``s`` on devices ``s*group ..``: ``pipeline{stages=4,group=16}``."""

    stages: int
    group: int
    kind: ClassVar[str] = "pipeline"

    def apply(self, g: Graph) -> Graph:
        return pipeline.pipeline(g, self.stages, self.group)


@dataclass(frozen=True)
class Microbatch(Move):
    """The batch in ``m`` microbatches for the region ``ops``: ``microbatch{ops=all,m=8}``."""

    ops: str
    m: int
    kind: ClassVar[str] = "microbatch"

    def apply(self, g: Graph) -> Graph:
        return pipeline.microbatch(g, self.ops, self.m)


MOVES: dict[str, type[Move]] = {c.kind: c for c in (Split, Merge, Retile, Place, MoveShard, SplitReduction,
                                                      MergeReduction, Fuse, Unfuse, Align, FuseAttention,
                                                      UnfuseAttention, Recompute, Unrecompute, Layout, TwoLevel,
                                                      FuseNorm, UnfuseNorm, MergeMatmuls, SplitMatmuls,
                                                      Reassociate, Unreassociate, Stage, Pipeline, Microbatch)}
_MOVE_RE = re.compile(r"^\s*(\w+)\{(.*)\}\s*$")
_ARG_RE = re.compile(r"(\w+)=(\[[^\]]*\]|[^,\]]+)")


def _move_int(text: str, key: str, raw: str) -> int:
    """An integer argument of a move's text (at most ``MAX_DIM`` in size), or ``RewriteError``."""
    try:
        v = int(raw)
    except ValueError:
        raise RewriteError(f"cannot parse move {text!r}: {key} must be a whole number, got {raw!r}") from None
    if abs(v) > MAX_DIM:
        raise RewriteError(f"cannot parse move {text!r}: {key} = {v} is beyond any device or size (2**40)")
    return v


def parse_move(text: str) -> Move:
    """Parse ``"split{op=fc1,dim=o,parts=4}"`` (or ``a; b`` sequences) back into a move."""
    if ";" in text:
        return Sequence(tuple(parse_move(t) for t in text.split(";") if t.strip()))
    m = _MOVE_RE.match(text)
    if not m or m.group(1) not in MOVES:
        raise RewriteError(f"cannot parse move {text!r}; moves look like split{{op=fc1,dim=o,parts=4}} "
                           f"with kinds {sorted(MOVES)}")
    if "{" in m.group(2) or "}" in m.group(2):
        raise RewriteError(f"cannot parse move {text!r}: one move per text; separate moves with ';' "
                           f"(split{{op=fc1,dim=o,parts=4}}; place{{op=fc1,devices=[0,1,2,3]}})")
    cls = MOVES[m.group(1)]
    types = {f.name: str(f.type) for f in fields(cls)}
    args = {}
    for key, raw in _ARG_RE.findall(m.group(2)):
        if key not in types:
            raise RewriteError(f"move {cls.kind} has no argument {key!r}; it takes {list(types)}")
        listed = "tuple" in types[key]
        if raw.startswith("["):
            items = [x.strip() for x in raw[1:-1].split(",") if x.strip()]
            if "str" in types[key]:  # a list of op names, e.g. merge_matmuls{ops=[q_proj,k_proj]}
                args[key] = tuple(items)
                continue
            args[key] = tuple(_move_int(text, key, x) for x in items)
        elif listed and "str" not in types[key]:
            raise RewriteError(f"cannot parse move {text!r}: {key} must be a list such as [0,1], got {raw}")
        elif "int" in types[key] and "str" not in types[key]:
            args[key] = _move_int(text, key, raw)
        else:
            args[key] = raw
    try:
        return cls(**args)
    except TypeError as e:
        raise RewriteError(f"cannot parse move {text!r}: {e}") from None
