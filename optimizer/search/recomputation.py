"""Activation recomputation as a search move: what lets a model fit when its activations do not.

``recompute`` toggles recomputation in one layer of a training step (``ir.rewrites.recompute``):

- a layer without recomputed ops gets, most often, its whole forward recomputed and its weights'
  casts too (Megatron-LM's full recomputation with FSDP's ``reshard_after_forward``: only the
  layer's input is kept, a sharded weight is gathered again for the backward), otherwise one of
  its forward ops (selective recomputation, Korthikanti et al. 2022: recompute what is cheap to
  redo and costly to keep);
- a layer with recomputed ops has them all dropped (the inverse).

A search that ties layers (``local_search(..., tie_layers=True)``, the farm's workers) makes the
move in every layer of the chosen layer's class, so one move recomputes the repeated middle of a
model, as the ``…-recompute`` expert plans do.
"""

from __future__ import annotations

import numpy as np

from ir.graph import Graph
from ir.rewrites import RewriteError
from ir.rewrites import moves as M
from ir.rewrites.pipeline import op_layers
from ir.rewrites.recompute import SUFFIX, backward_ops

WHOLE_LAYER_P = 0.75  # share of recompute draws that take a whole layer (the rest: one op)


def op_recompute(g: Graph, rng: np.random.Generator, ctx: object) -> tuple[Graph, M.Move]:
    """Recompute a layer's forward (or one of its ops) in the backward, or undo a layer's
    recomputation (see the module doc). Raises ``RewriteError`` for a forward-only program or
    one without numbered layers."""
    layer_of, n_layers = op_layers(g)
    if n_layers == 0:
        raise RewriteError("recompute needs a model of numbered layers (ops named l<k>.…)")
    i = int(rng.integers(n_layers))
    prefixes = (f"l{i}.", f"l{i}_")
    if any(n.endswith(SUFFIX) and n.startswith(prefixes) for n in g.ops):
        moves = [M.Unrecompute(prefix=p) for p in prefixes]
    elif rng.random() < WHOLE_LAYER_P:
        moves = [M.Recompute(prefix=p) for p in prefixes]
    else:
        bwd = backward_ops(g)
        if not bwd:
            raise RewriteError("recompute needs a training step (no op reads a loss gradient)")
        cands = [n for n, o in g.ops.items() if layer_of.get(n) == i and n.startswith(prefixes[0]) and n not in bwd
                 and any(r in bwd for r, _ in g.consumers.get(o.output, []))]
        if not cands:
            raise RewriteError(f"layer {i} has no forward op read by the backward")
        moves = [M.Recompute(op=cands[int(rng.integers(len(cands)))])]
    out, done = g, []
    for m in moves:
        try:
            out = m.apply(out)
            done.append(m)
        except RewriteError:
            continue  # a layer with no weights of its own (``l<i>_``), or none recomputed there
    if not done:
        raise RewriteError(f"nothing to recompute or undo in layer {i}")
    return out, (done[0] if len(done) == 1 else M.Sequence(tuple(done)))
