"""Sharding and placement rewrites: split, merge, retile, place, move.

All keep the op's index space partitioned exactly and only rebuild the touched op's shards.

``split(g, "fc1", "o", 2)``: each shard of fc1 is cut in two along ``o``::

    fc1: [0:8, 0:32]@0              ->  fc1: [0:8, 0:16]@0, [0:8, 16:32]@0
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ir.graph import Graph, Op, Shards
from ir.kernels import SignatureError
from ir.rewrites.errors import RewriteError
from ir.zspace import split_points


def get_op(g: Graph, op: str) -> Op:
    try:
        return g.ops[op]
    except KeyError:
        raise RewriteError(f"no operation {op!r}; operations are {list(g.ops)}") from None


def dim_of(g: Graph, o: Op, dim: str | int) -> int:
    try:
        return g.signature(o).dim_index(dim)
    except SignatureError as e:
        raise RewriteError(f"{o.name}: {e}") from None


def _with_shards(g: Graph, o: Op, shards: Shards) -> Graph:
    return g.with_ops({o.name: o.replace(shards=shards)})


def split(g: Graph, op: str, dim: str | int, parts: int) -> Graph:
    """Cut every shard of ``op`` into ``parts`` near-equal pieces along index ``dim``."""
    o = get_op(g, op)
    d = dim_of(g, o, dim)
    sh = o.shards
    if not isinstance(parts, (int, np.integer)) or parts < 2:
        raise RewriteError(f"split needs parts >= 2, got {parts!r}")
    ext = sh.hi[:, d] - sh.lo[:, d]
    if ext.min() < parts:
        i = int(np.argmin(ext))
        raise RewriteError(f"{op}: shard {i} spans only {int(ext[i])} along {g.signature(o).dims[d]!r}, "
                           f"cannot cut it into {parts}")
    base, extra = np.divmod(ext, parts)
    p = np.arange(parts + 1)
    cuts = sh.lo[:, d, None] + p[None, :] * base[:, None] + np.minimum(p[None, :], extra[:, None])
    lo = np.repeat(sh.lo, parts, axis=0)
    hi = np.repeat(sh.hi, parts, axis=0)
    lo[:, d] = cuts[:, :-1].reshape(-1)
    hi[:, d] = cuts[:, 1:].reshape(-1)
    return _with_shards(g, o, Shards(lo, hi, np.repeat(sh.device, parts)))


def merge(g: Graph, op: str, dim: str | int, factor: int | None = None) -> Graph:
    """Join shards that are neighbours along ``dim`` and agree on every other dim.

    ``factor=None`` joins whole runs; ``factor=k`` joins consecutive groups of ``k``. The merged
    shard keeps the device of its first piece.
    """
    o = get_op(g, op)
    d = dim_of(g, o, dim)
    sh = o.shards
    others = [k for k in range(sh.ndim) if k != d]
    key = np.concatenate([sh.lo[:, others], sh.hi[:, others]], axis=1)
    order = np.lexsort((sh.lo[:, d],) + tuple(key[:, k] for k in reversed(range(key.shape[1]))))
    lo, hi, dev, key = sh.lo[order], sh.hi[order], sh.device[order], key[order]
    join = np.zeros(len(order), dtype=bool)
    join[1:] = np.all(key[1:] == key[:-1], axis=1) & (lo[1:, d] == hi[:-1, d])
    run_id = np.cumsum(~join)
    if factor is not None:
        if factor < 2:
            raise RewriteError(f"merge factor must be >= 2, got {factor}")
        run_start = np.maximum.accumulate(np.where(~join, np.arange(len(join)), 0))
        pos = np.arange(len(join)) - run_start
        run_id = run_id * (len(join) + 1) + pos // factor
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = run_id[1:] != run_id[:-1]
    if starts.all():
        raise RewriteError(f"{op}: no neighbouring shards to merge along {g.signature(o).dims[d]!r}")
    first = np.nonzero(starts)[0]
    last = np.append(first[1:] - 1, len(order) - 1)
    new_lo, new_hi = lo[first].copy(), hi[first].copy()
    new_hi[:, d] = hi[last, d]
    return _with_shards(g, o, Shards(new_lo, new_hi, dev[first]))


def retile(g: Graph, op: str, parts: Sequence[int], devices: Sequence[int] | None = None) -> Graph:
    """Replace ``op``'s shards by a regular grid of ``parts[k]`` near-equal tiles per dim.

    Tiles are numbered row-major and placed round-robin on ``devices`` (default: all on 0).
    """
    o = get_op(g, op)
    sig = g.signature(o)
    if len(parts) != len(sig.dims):
        raise RewriteError(f"{op}: retile needs one part count per index dim {list(sig.dims)}, got {list(parts)}")
    for k, (p, e) in enumerate(zip(parts, sig.extents)):
        if not 1 <= p <= e:
            raise RewriteError(f"{op}: cannot cut extent {e} of {sig.dims[k]!r} into {p} tiles")
    cuts = [np.array(split_points(0, e, p)) for p, e in zip(parts, sig.extents)]
    grids = np.meshgrid(*[np.arange(p) for p in parts], indexing="ij")
    idx = np.stack([x.reshape(-1) for x in grids], axis=1) if parts else np.zeros((1, 0), int)
    lo = np.stack([cuts[k][idx[:, k]] for k in range(len(parts))], axis=1).reshape(len(idx), len(parts))
    hi = np.stack([cuts[k][idx[:, k] + 1] for k in range(len(parts))], axis=1).reshape(len(idx), len(parts))
    devs = np.zeros(len(idx), dtype=np.int64) if not devices else np.resize(np.asarray(devices), len(idx))
    _check_devices(op, devs)
    return _with_shards(g, o, Shards(lo, hi, devs))


def _check_devices(op: str, devs: np.ndarray) -> None:
    if devs.size and devs.min() < 0:
        raise RewriteError(f"{op}: device numbers must be >= 0, got {int(devs.min())}")


def place(g: Graph, op: str, devices: Sequence[int]) -> Graph:
    """Put shard ``i`` of ``op`` on ``devices[i % len(devices)]`` (shards in order)."""
    o = get_op(g, op)
    if len(devices) == 0:
        raise RewriteError(f"{op}: place needs at least one device")
    devs = np.resize(np.asarray(devices, dtype=np.int64), len(o.shards))
    _check_devices(op, devs)
    if np.array_equal(devs, o.shards.device):
        raise RewriteError(f"{op}: already placed on {list(devices)}")
    return _with_shards(g, o, o.shards.with_devices(devs))


def move(g: Graph, op: str, shard: int, device: int) -> Graph:
    """Put one shard of ``op`` on ``device``."""
    o = get_op(g, op)
    if not 0 <= shard < len(o.shards):
        raise RewriteError(f"{op}: no shard {shard}; it has {len(o.shards)}")
    if device < 0:
        raise RewriteError(f"{op}: device numbers must be >= 0, got {device}")
    if o.shards.device[shard] == device:
        raise RewriteError(f"{op}: shard {shard} is already on device {device}")
    devs = o.shards.device.copy()
    devs[shard] = device
    return _with_shards(g, o, o.shards.with_devices(devs))
