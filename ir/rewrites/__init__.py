"""Meaning-preserving rewrites: pure functions graph -> graph, or ``RewriteError`` with a reason.

- ``split`` / ``merge`` / ``retile``: reshape an op's shards along index dims;
- ``place`` / ``move``: set shard devices; ``align``: copy a same-shaped op's shards;
- ``split_reduction`` / ``merge_reduction``: partial op + ``accumulate``, and back;
- ``fuse`` / ``unfuse``: producer + elementwise consumer as one op, and back;
- ``fuse_attention`` / ``unfuse_attention``: the scores → (scale, mask) → softmax → values
  pattern as one ``attention`` op (FlashAttention), and back;
- ``fuse_norm`` / ``unfuse_norm``: a layernorm/rmsnorm computed inside the contractions reading it;
- ``merge_matmuls`` / ``split_matmuls``: contractions sharing an input as one over concatenated
  weights (QKV, gate+up), and back;
- ``reassociate`` / ``unreassociate``: ``(A·B)·R`` as ``A·(B·R)`` where the extents favour it, and back;
- ``random_rewrite``: one random legal rewrite; ``unshard``: the logical program of a plan.
Moves (``ir.rewrites.moves``) are the same rewrites as printable, parseable data.
"""

from ir.rewrites.align import align
from ir.rewrites.canonical import unshard
from ir.rewrites.errors import RewriteError
from ir.rewrites.fusion import fusable, fuse, unfuse
from ir.rewrites.moves import MOVES, Move, parse_move
from ir.rewrites.random import DEFAULT_WEIGHTS, draw_move, random_rewrite, random_walk
from ir.rewrites.reduction import merge_reduction, split_reduction
from ir.rewrites.shard import merge, move, place, retile, split
from ir.rewrites.substitute_attention import fuse_attention, match_attention, unfuse_attention
from ir.rewrites.substitute_merge import merge_matmuls, split_matmuls
from ir.rewrites.substitute_norm import fuse_norm, unfuse_norm
from ir.rewrites.substitute_reassoc import reassociate, unreassociate

__all__ = ["DEFAULT_WEIGHTS", "align", "MOVES", "Move", "RewriteError", "draw_move", "fusable", "fuse",
           "fuse_attention", "fuse_norm", "match_attention", "merge", "merge_matmuls", "merge_reduction", "move",
           "parse_move", "place", "random_rewrite", "random_walk", "reassociate", "retile", "split",
           "split_matmuls", "split_reduction", "unfuse", "unfuse_attention", "unfuse_norm", "unreassociate",
           "unshard"]
