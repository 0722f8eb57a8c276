"""Two-level reductions: sum partials inside each group of devices first, then across groups.

``two_level(g, "fc2.acc", 8)`` on an accumulate of 64 partials, partial ``i`` on device ``i``
(8 nodes of 8)::

    fc2.acc:     y[n, o] = Σ_{i<64} p[i, n, o]                     (64-way sharded; 56 of the 63
                                                                      partials it reads cross nodes)
 -> fc2.acc:     q[j, n, o] = Σ_{i in 8j..8j+7} p[i, n, o]           (block j on node j, its rows
                                                                      split over node j's 8 GPUs)
    fc2.acc.acc: y[n, o] = Σ_{j<8} q[j, n, o]                       (the old 64-way sharding)

It is ``split_reduction`` of the accumulate over its block dim (``accumulate`` declares that dim
a splittable reduction), plus a placement: block ``j`` of the first level runs on the devices
that produce its partials, split among them (a reduce-scatter inside the group) along the dim the
final sum is split along, so that each second-level shard (the accumulate's old shards) reads one
piece per group, from the same position in every node (rail-aligned). Inter-node traffic
falls from ``(k-1)/k`` of the tensor per device to ``(G-1)/k`` (``G`` groups), as in NCCL's
two-level reduce-scatter. ``merge_reduction(g, "fc2.acc")`` undoes it.

Where each group's partials already lie on its devices as pieces of the output (one device's
microbatch partials, cut over columns by tensor parallelism: ``pipeline.microbatch``), the first
level keeps those pieces where they are (``own_boxes``): each device sums its own slice in place
and no partial crosses a link (Megatron-LM's ``main_grad`` accumulation across microbatches).
"""

from __future__ import annotations

import numpy as np

from ir.graph import Graph, Shards
from ir.rewrites.errors import RewriteError
from ir.rewrites.reduction import split_reduction
from ir.rewrites.shard import get_op
from ir.zspace import Projection, ZRange, partition_problem, project_boxes, split_points


def block_owners(shards: Shards, col: int, k: int) -> list[list[int]]:
    """For each block ``i < k`` along index column ``col`` of a partial op's shards, the devices
    computing it (in shard order)."""
    out: list[list[int]] = [[] for _ in range(k)]
    for lo, hi, d in zip(shards.lo[:, col], shards.hi[:, col], shards.device):
        for i in range(max(0, int(lo)), min(k, int(hi))):
            if int(d) not in out[i]:
                out[i].append(int(d))
    return out


def split_dim(final: Shards, out_ext: tuple[int, ...]) -> int | None:
    """The output dim the first level splits along: the first one the final sum is split along
    (so each second-level shard reads one piece per group), else the longest."""
    for c in range(final.ndim):
        if final.lo[:, c].min() != final.lo[:, c].max():
            return c
    return int(np.argmax(out_ext)) if out_ext else None


def stage_one_shards(owners: list[list[int]], group: int, out_ext: tuple[int, ...], fallback: int,
                     d: int | None) -> Shards:
    """First-level shards: block ``j`` (partials ``j*group .. (j+1)*group - 1``) on the devices that
    own those partials, split among them along output dim ``d`` (whole when None)."""
    n_groups = len(owners) // group
    lo_rows, hi_rows, devs = [], [], []
    for j in range(n_groups):
        members: list[int] = []
        for i in range(j * group, (j + 1) * group):
            members += [x for x in owners[i] if x not in members]
        members = members or [fallback]
        parts = 1 if d is None else max(1, min(len(members), out_ext[d]))
        cuts = split_points(0, out_ext[d], parts) if d is not None else [0, 0]
        for p in range(parts):
            lo = [j] + [0] * len(out_ext)
            hi = [j + 1] + list(out_ext)
            if d is not None:
                lo[1 + d], hi[1 + d] = cuts[p], cuts[p + 1]
            lo_rows.append(lo)
            hi_rows.append(hi)
            devs.append(members[p])
    n = len(devs)
    return Shards(np.array(lo_rows, np.int64).reshape(n, -1), np.array(hi_rows, np.int64).reshape(n, -1), devs)


def own_boxes(partials: Shards, proj: Projection, group: int, out_ext: tuple[int, ...]) -> Shards | None:
    """First-level shards that read only local partials, or None: block ``j`` as the pieces of
    the output its partials' shards hold (``proj``: the partial op's output projection, block dim
    first), each on its shard's device, when every group's pieces partition the output exactly
    (a device's microbatch partials under tensor parallelism: each device sums its own column
    slice). Partials that each cover the whole output on different devices (data parallelism)
    overlap: None, and ``stage_one_shards`` splits the sum among their owners instead."""
    lo, hi = project_boxes(proj, partials.lo, partials.hi)
    if np.any(hi[:, 0] - lo[:, 0] != 1):
        return None  # a shard holding several blocks
    whole = ZRange((0,) * len(out_ext), out_ext)
    rows_lo, rows_hi, devs = [], [], []
    by_group: dict[int, dict[tuple, int]] = {}
    for b, l_, h_, d in zip(lo[:, 0], lo[:, 1:], hi[:, 1:], partials.device):
        piece = by_group.setdefault(int(b) // group, {})
        if piece.setdefault((tuple(l_), tuple(h_)), int(d)) != d:
            return None  # one piece's partials on several devices: no device sums it alone
    r = len(out_ext)
    for j in range(len(by_group)):
        pieces = by_group.get(j)
        if not pieces:
            return None
        box_lo = np.array([p[0] for p in pieces], np.int64).reshape(len(pieces), r)
        box_hi = np.array([p[1] for p in pieces], np.int64).reshape(len(pieces), r)
        if partition_problem((box_lo, box_hi), whole) is not None:
            return None  # the group's pieces overlap or leave a gap
        for (l_, h_), d in pieces.items():
            rows_lo.append((j, *l_))
            rows_hi.append((j + 1, *h_))
            devs.append(d)
    n = len(devs)
    return Shards(np.array(rows_lo, np.int64).reshape(n, 1 + r), np.array(rows_hi, np.int64).reshape(n, 1 + r), devs)


def two_level(g: Graph, acc: str, group: int) -> Graph:
    """Reduce ``acc``'s partials in groups of ``group`` consecutive blocks, then across groups."""
    o = get_op(g, acc)
    if o.kernel != "accumulate":
        raise RewriteError(f"{acc}: two_level applies to accumulate ops, not {o.kernel}")
    if o.params.get("split"):
        raise RewriteError(f"{acc}: already reduced in two levels")
    k = g.tensors[o.inputs[0][1]].shape[0]
    if not isinstance(group, (int, np.integer)) or group < 2 or k % group or group >= k:
        raise RewriteError(f"{acc}: {k} partials do not fall into groups of {group} (need 2 <= group < {k}, "
                           f"dividing {k})")
    producer = g.producers.get(o.inputs[0][1])
    owners: list[list[int]] = [[] for _ in range(k)]
    local = None
    if producer is not None:
        proj = g.signature(producer).output
        col = next((c for c, v in enumerate(proj.A[0]) if v), None)
        if col is not None:
            owners = block_owners(g.ops[producer].shards, col, k)
            out_ext = tuple(g.tensors[o.inputs[0][1]].shape[1:])
            local = own_boxes(g.ops[producer].shards, proj, group, out_ext)
    old = o.shards
    g = split_reduction(g, acc, k // group)
    sig = g.signature(acc)  # (kb, *out dims)
    out_ext = sig.extents[1:]
    first = local if local is not None else stage_one_shards(owners, group, out_ext, int(old.device[0]),
                                                             split_dim(old, out_ext))
    return g.with_ops({acc: g.ops[acc].replace(shards=first)})


__all__ = ["block_owners", "own_boxes", "split_dim", "stage_one_shards", "two_level"]
