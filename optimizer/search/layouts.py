"""Mesh-layout mutation operators: one move to TP x DP, DP x CP, FSDP, ... from any plan.

- ``layout``: a node-aligned mesh of the fleet (or of a node, or of whole nodes), one use per
  axis (``b`` batch, ``s`` sequence, ``t`` tensor), and a region: every op (``all``, so every
  layer alike), the ops of one layer (``l3.*``), or a topological range of ops;
- ``two_level``: reduce an accumulate's partials inside groups of devices first (a node), then
  across groups;
- ``pipeline``: layout on a mesh of ``n / pp`` devices, ``pp`` stages of contiguous layers,
  ``m`` microbatches (``ir.rewrites.pipeline``), one move (models with ``l<k>.`` layers).

Meshes are drawn from ``ir.mesh.enumerate_meshes`` for the fleet's nodes; the hardware's
``devices_per_node`` arrives in ``MutationContext.devices_per_node``.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from ir.graph import Graph
from ir.mesh import Mesh, enumerate_meshes
from ir.rewrites import RewriteError
from ir.rewrites import moves as M
from ir.rewrites.layout import USES, has_experts
from ir.rewrites.pipeline import op_layers

_LAYER = re.compile(r"^(l\d+)\.")
TEMPLATE_P = 0.35  # share of layout draws that take an expert's uses (see draw_layout)


def devices_per_node(ctx: object) -> int:
    """The context's devices per node (8 on fleets of multiples of 8 when it does not say)."""
    n = int(getattr(ctx, "n_devices"))
    d = getattr(ctx, "devices_per_node", None)
    return int(d) if d else (8 if n % 8 == 0 else n)


@lru_cache(maxsize=64)
def meshes_for(n_devices: int, per_node: int, max_axes: int = 3) -> tuple[Mesh, ...]:
    """Node-aligned meshes of the fleet, of a node and of whole groups of nodes (from device 0)."""
    nodes = max(1, n_devices // per_node)
    return tuple(enumerate_meshes(nodes, min(per_node, n_devices), max_axes))


def _layers(g: Graph) -> list[str]:
    seen: dict[str, None] = {}
    for n in g.ops:
        m = _LAYER.match(n)
        if m:
            seen.setdefault(m.group(1), None)
    return list(seen)


def draw_layout(g: Graph, rng: np.random.Generator, n_devices: int, per_node: int) -> M.Layout:
    """A random layout move: mesh (whole fleet more often), uses, region."""
    meshes = meshes_for(n_devices, per_node)
    full = [m for m in meshes if m.size == n_devices]
    pool = full if (full and rng.random() < 0.7) else list(meshes)
    mesh = pool[int(rng.integers(len(pool)))]
    # the expert-parallel use only where the program has experts (elsewhere it is ``b``)
    uses = USES if has_experts(g) else tuple(u for u in USES if u != "e")
    if rng.random() < TEMPLATE_P:
        # an expert's shape: batch across nodes and one of batch / tensor / sequence (/ experts)
        # inside a node (FSDP, Megatron TP x DP, DP x CP, EP x DP), so those plans are one likely
        # move away
        inners = "bts" + ("e" if "e" in uses else "")
        inner = inners[int(rng.integers(len(inners)))]
        use = tuple("b" if mesh.crosses_nodes(a) else inner for a in range(mesh.ndim))
    else:
        use = tuple(uses[int(rng.integers(len(uses)))] for _ in range(mesh.ndim))
    r = rng.random()
    layers = _layers(g)
    if r < 0.6:
        region = "all"
    elif r < 0.8 and layers:
        region = f"{layers[int(rng.integers(len(layers)))]}.*"
    else:
        order = g.topo_order
        i = int(rng.integers(len(order)))
        j = min(len(order) - 1, i + int(rng.integers(1, 12)))
        region = f"{order[i]}:{order[j]}"
    return M.Layout(region, mesh.text, ".".join(use), per_node)


def op_layout(g: Graph, rng: np.random.Generator, ctx: object) -> tuple[Graph, M.Move]:
    move = draw_layout(g, rng, int(getattr(ctx, "n_devices")), devices_per_node(ctx))
    return move.apply(g), move


def op_two_level(g: Graph, rng: np.random.Generator, ctx: object) -> tuple[Graph, M.Move]:
    per_node = devices_per_node(ctx)
    cands = []
    for n, o in g.ops.items():
        if o.kernel == "accumulate" and not o.params.get("split"):
            k = g.tensors[o.inputs[0][1]].shape[0]
            groups = [x for x in (per_node, 2, 4, 8) if 2 <= x < k and k % x == 0]
            if groups:
                cands.append((n, groups))
    if not cands:
        raise RewriteError("no accumulate of four or more partials")
    name, groups = cands[int(rng.integers(len(cands)))]
    move = M.TwoLevel(name, groups[0] if rng.random() < 0.6 else groups[int(rng.integers(len(groups)))])
    return move.apply(g), move


def draw_pipeline(g: Graph, rng: np.random.Generator, n_devices: int, per_node: int) -> M.Sequence:
    """A random pipelined plan in one move: a layout of every op on a mesh of ``n / pp``
    devices, ``pp`` stages of contiguous layers on consecutive device groups, ``m``
    microbatches (``pp``, ``2·pp`` or ``4·pp``) — Megatron-LM's TP x DP x PP and its neighbours."""
    _, n_layers = op_layers(g)
    pps = [k for k in (2, 4, 8, 16) if k <= n_layers and n_devices % k == 0]
    if not pps:
        raise RewriteError("pipeline: fewer than two layers, or the fleet does not split into stages")
    pp = pps[int(rng.integers(len(pps)))]
    group = n_devices // pp
    meshes = [m for m in meshes_for(n_devices, per_node) if m.size == group]
    moves: list[M.Move] = []
    if meshes:
        mesh = meshes[int(rng.integers(len(meshes)))]
        use = tuple("t" if (rng.random() < 0.6 and not mesh.crosses_nodes(a)) else USES[int(rng.integers(2))]
                    for a in range(mesh.ndim))
        moves.append(M.Layout("all", mesh.text, ".".join(use), per_node))
    m = pp * int(rng.choice([1, 2, 4]))
    moves += [M.Pipeline(pp, group), M.Microbatch("all", m)]
    return M.Sequence(tuple(moves))


def op_pipeline(g: Graph, rng: np.random.Generator, ctx: object) -> tuple[Graph, M.Move]:
    move = draw_pipeline(g, rng, int(getattr(ctx, "n_devices")), devices_per_node(ctx))
    return move.apply(g), move


__all__ = ["devices_per_node", "draw_layout", "draw_pipeline", "meshes_for", "op_layout", "op_pipeline",
           "op_two_level"]
