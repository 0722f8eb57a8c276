"""Plans in the words practitioners use: per op, which index dims are split how many ways over
which mesh axis (DTensor's ``Shard(dim)`` per mesh axis).

``describe_op(g, "fc2", mesh)`` -> ``"kb(f)/8 over g0 (partial sums) · n/8 over n0"``:
the hidden reduction ``f`` of fc2 is split in 8 blocks along the in-node axis ``g0`` and its rows
in 8 along the cross-node axis ``n0``. A dim split over devices that no mesh axis explains says
so (``s/4 on [0, 9, 18, 27]``); irregular shardings (a two-level reduction's first level, hand
placements) print their shard and device counts.

``describe(g, mesh)`` is the whole plan, one line per op in the graph's text form with this
description in place of "N shards on [devices]". ``guess_mesh(g)`` picks nodes x 8 (or one
node) from the devices a plan uses when no hardware is given.
"""

from __future__ import annotations

from itertools import permutations
from math import prod

import numpy as np

from ir.graph import Graph
from ir.mesh import Mesh, enumerate_meshes
from ir.unique import distinct


def guess_mesh(g: Graph, devices_per_node: int = 8) -> Mesh:
    """The node-aligned mesh of the devices a plan uses (nodes of ``devices_per_node``) that
    explains the most split dims of its ops (ties: fewer axes)."""
    n = max(g.devices) + 1 if g.devices else 1
    if n > devices_per_node:
        n = -(-n // devices_per_node) * devices_per_node
    per = min(n, devices_per_node)
    cands = [m for m in enumerate_meshes(n // per, per, 3, subsets=False)] or [Mesh((n,), per)]
    sample = [x for x in g.topo_order if len(g.ops[x].shards) > 1][:200]
    best, score = cands[0], -1
    for m in sorted(cands, key=lambda m: m.ndim):
        sc = sum(_explained(g, x, m) for x in sample)
        if sc > score:
            best, score = m, sc
    return best


def _explained(g: Graph, op: str, mesh: Mesh) -> int:
    return sum(1 for _, _, axes in _dims(g, op, mesh)[0] if axes)


def _grid(lo: np.ndarray, hi: np.ndarray) -> tuple[list[int], np.ndarray] | None:
    """Parts per dim and each shard's tile coordinate, if the shards form a regular grid."""
    n, d = lo.shape
    parts, coords = [], np.zeros((n, d), np.int64)
    for c in range(d):
        starts = distinct(lo[:, c])
        parts.append(len(starts))
        coords[:, c] = np.searchsorted(starts, lo[:, c])
    if prod(parts) != n or len({tuple(r) for r in coords.tolist()}) != n:
        return None
    return parts, coords


def _dims(g: Graph, op: str, mesh: Mesh) -> tuple[list[tuple[str, int, tuple[int, ...] | None]], bool]:
    """(dim name, parts, mesh axes or None) per split dim, and whether the shards form a regular
    grid."""
    o = g.ops[op]
    sig = g.signature(o)
    sh = o.shards
    grid = _grid(sh.lo, sh.hi)
    if grid is None:
        return [], False
    parts, coords = grid
    rel = sh.device - mesh.offset
    inside = bool(np.all((rel >= 0) & (rel < mesh.size)))
    mc = np.stack(np.unravel_index(np.clip(rel, 0, mesh.size - 1), mesh.shape), axis=1) if inside else None
    out: list[tuple[str, int, tuple[int, ...] | None]] = []
    used: set[int] = set()
    for c, p in enumerate(parts):
        if p == 1:
            continue
        name = f"kb({sig.split_from.name})" if c == 0 and sig.split_from is not None else sig.dims[c]
        axes = None
        if mc is not None:
            free = [a for a in range(mesh.ndim) if a not in used]
            for k in (1, 2, 3):
                for combo in permutations(free, k):
                    if prod(mesh.shape[a] for a in combo) != p:
                        continue
                    code = np.zeros(len(sh), np.int64)
                    for a in combo:
                        code = code * mesh.shape[a] + mc[:, a]
                    if np.array_equal(code, coords[:, c]):
                        axes = combo
                        break
                if axes:
                    break
        if axes:
            used.update(axes)
        out.append((name, p, axes))
    return out, True


def describe_op(g: Graph, op: str, mesh: Mesh) -> str:
    """One op's layout: ``b/8 over n0 · h/8 over g0  [64 shards on 64 devices]``."""
    sh = g.ops[op].shards
    devs = sorted(set(sh.device.tolist()))
    if len(sh) == 1:
        return f"whole on device {devs[0]}"
    dims, regular = _dims(g, op, mesh)
    if not regular:
        return f"irregular: {len(sh)} shards on {len(devs)} devices"
    words = []
    for name, p, axes in dims:
        tail = " (partial sums)" if name.startswith("kb(") else ""
        over = f" over {'×'.join(mesh.names[a] for a in axes)}" if axes else " (no mesh axis)"
        words.append(f"{name}/{p}{over}{tail}")
    where = f"{len(devs)} devices" if len(devs) > 8 else f"{devs}"
    return (" · ".join(words) or "one box") + f"  [{len(sh)} shards on {where}]"


def describe(g: Graph, mesh: Mesh | None = None) -> str:
    """The plan's text form (``str(g)``, one line per op) with each op's layout on ``mesh`` in
    place of its shard count."""
    mesh = mesh or guess_mesh(g)
    lines = [f"# mesh {mesh.text}: {' × '.join(f'{n}={s}' for n, s in zip(mesh.names, mesh.shape))}"]
    for line, n in zip(str(g).split("\n"), g.topo_order):
        head = line.rsplit("  # ", 1)[0]
        lines.append(f"{head}  # {n}: {describe_op(g, n, mesh)}")
    return "\n".join(lines)


__all__ = ["describe", "describe_op", "guess_mesh"]
