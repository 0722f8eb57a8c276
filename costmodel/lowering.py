"""Lowering a plan + hardware to the simulator's flat arrays (struct of arrays).

- One compute node per shard: FLOPs and bytes from its boxes, duration from the roofline.
- For every (producer op, consumer op, port): producer shard ``p`` and consumer shard ``c`` whose
  boxes intersect give an edge ``p → c`` when on one device; across devices the data moves in
  one transfer per (``p``, destination device) carrying the *union* of what that device's
  shards need from ``p`` (halos and replicated reads counted exactly; a box needed by several
  shards on one device moves once), with edges ``p → transfer → c``.
- Graph inputs and weights are resident where their readers need them before the run: per
  device, the union of the boxes read there counts as resident memory and costs no time.

Everything per op and per edge is cached by the identity of the (immutable) ``Op`` objects,
which rewrites share between a parent plan and its child: re-lowering after a rewrite
recomputes only the touched op and its edges, then concatenates cached pieces.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from costmodel.hardware import Hardware
from costmodel.simulate import csr_from_edges
from ir.graph import SOURCE_ROLES, Graph, Op
from ir.kernels import ITEMSIZE, get_kernel
from ir.zspace import project_boxes


@dataclass(frozen=True)
class OpTasks:
    dev: np.ndarray        # int32[n]
    dur: np.ndarray        # float64[n]
    flops: np.ndarray      # float64[n]
    nbytes: np.ndarray     # float64[n] read + written
    out_lo: np.ndarray     # int64[n, r] output boxes
    out_hi: np.ndarray
    alloc: np.ndarray      # float64[n] output buffer bytes


@dataclass(frozen=True)
class EdgeData:
    local_src: np.ndarray   # same-device edges: producer shard -> consumer shard
    local_dst: np.ndarray
    t_src: np.ndarray       # transfers: producer shard, destination device, bytes, duration
    t_dst_dev: np.ndarray
    t_bytes: np.ndarray
    t_dur: np.ndarray
    tc_t: np.ndarray        # transfer (local index) -> consumer shard
    tc_c: np.ndarray


@dataclass
class Lowered:
    """The simulator's input arrays plus what the objectives and breakdowns need."""

    kind: np.ndarray
    dev: np.ndarray
    dst: np.ndarray
    dur: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray
    alloc: np.ndarray
    resident: np.ndarray
    n_devices: int
    op_names: list[str]
    op_offsets: np.ndarray   # compute nodes of op i: [op_offsets[i], op_offsets[i+1])
    flops: np.ndarray        # per compute node
    transfer_op: np.ndarray  # per transfer node: index (into op_names) of the consumer op


def union_volumes(lo: np.ndarray, hi: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """Exact volume of the union of the boxes in each group (one coordinate compression for all).

    Fast paths: a group of one box, or of identical boxes, is that box's volume.
    """
    out = np.zeros(n_groups)
    vol = np.prod(np.clip(hi - lo, 0, None), axis=1).astype(np.float64)
    keep = vol > 0
    if not keep.any():
        return out
    lo, hi, group, vol = lo[keep], hi[keep], group[keep], vol[keep]
    counts = np.bincount(group, minlength=n_groups)
    first = np.full(n_groups, -1)
    first[group[::-1]] = np.arange(len(group))[::-1]
    same = np.all(lo == lo[first[group]], axis=1) & np.all(hi == hi[first[group]], axis=1)
    simple = np.bincount(group, weights=same.astype(np.float64), minlength=n_groups) == counts
    out[simple] = np.where(counts[simple] > 0, vol[first[simple]], 0.0)
    hard = ~simple[group]
    if not hard.any():
        return out
    lo, hi, group = lo[hard], hi[hard], group[hard]
    r = lo.shape[1]
    axes = [np.unique(np.concatenate([lo[:, k], hi[:, k]])) for k in range(r)]
    clo = np.stack([np.searchsorted(axes[k], lo[:, k]) for k in range(r)], axis=1)
    chi = np.stack([np.searchsorted(axes[k], hi[:, k]) for k in range(r)], axis=1)
    groups = np.unique(group)
    slot = np.searchsorted(groups, group)
    cover = np.zeros((len(groups),) + tuple(len(a) - 1 for a in axes), dtype=bool)
    for i in range(len(lo)):
        cover[(slot[i],) + tuple(slice(a, b) for a, b in zip(clo[i], chi[i]))] = True
    cell = np.ones(cover.shape[1:])
    for k, a in enumerate(axes):
        shape = [1] * r
        shape[k] = len(a) - 1
        cell = cell * np.diff(a).astype(np.float64).reshape(shape)
    out[groups] = (cover * cell).reshape(len(groups), -1).sum(axis=1)
    return out


def union_volume(lo: np.ndarray, hi: np.ndarray) -> float:
    """Exact volume of a union of boxes."""
    return float(union_volumes(lo, hi, np.zeros(len(lo), np.int64), 1)[0])


class Lowerer:
    """Lowers plans on one ``Hardware``; keeps per-op and per-edge caches across calls."""

    def __init__(self, hw: Hardware, cache_size: int = 20000) -> None:
        self.hw = hw
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, tuple[Any, tuple]] = OrderedDict()

    def _cached(self, key: tuple, keep: tuple, fn: Callable[[], Any]) -> Any:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit[0]
        val = fn()
        self._cache[key] = (val, keep)  # keep the ops alive so their ids stay unique
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return val

    # -- per op --------------------------------------------------------------------------
    def op_tasks(self, g: Graph, o: Op) -> OpTasks:
        return self._cached(("op", id(o)), (o,), lambda: self._op_tasks(g, o))

    def _op_tasks(self, g: Graph, o: Op) -> OpTasks:
        sig = g.signature(o)
        sh = o.shards
        flops = sig.flops(sh.lo, sh.hi)
        read, written = sig.io_bytes(sh.lo, sh.hi)
        k = get_kernel(o.kernel)
        kclass = k.kernel_class
        if o.kernel == "fused":
            kclass = get_kernel(o.params["stages"][0]["kernel"]).kernel_class
        dtype = g.tensors[o.output].dtype
        dur = self.hw.shard_time(flops, read + written, dtype, kclass)
        out_lo, out_hi = project_boxes(sig.output, sh.lo, sh.hi)
        dev = sh.device.astype(np.int32)
        if dev.size and dev.max() >= self.hw.n_devices:
            from costmodel.hardware import HardwareError

            raise HardwareError(f"op {o.name!r} places a shard on device {int(dev.max())}, but "
                                f"{self.hw.name!r} has devices 0..{self.hw.n_devices - 1}")
        return OpTasks(dev, np.asarray(dur, np.float64), flops, read + written, out_lo, out_hi, written)

    def input_boxes(self, g: Graph, o: Op, port: str) -> tuple[np.ndarray, np.ndarray]:
        def compute():
            sig = g.signature(o)
            lo, hi = project_boxes(sig.inputs[port], o.shards.lo, o.shards.hi)
            shape = np.array(g.tensors[o.input_map[port]].shape)
            lo = np.clip(lo, 0, shape)
            return lo, np.clip(hi, lo, shape)

        return self._cached(("in", id(o), port), (o,), compute)

    # -- per edge ------------------------------------------------------------------------
    def edge(self, g: Graph, p: Op, c: Op, port: str) -> EdgeData:
        return self._cached(("edge", id(p), id(c), port), (p, c), lambda: self._edge(g, p, c, port))

    def _edge(self, g: Graph, p: Op, c: Op, port: str) -> EdgeData:
        pt = self.op_tasks(g, p)
        clo, chi = self.input_boxes(g, c, port)
        itemsize = ITEMSIZE[g.tensors[p.output].dtype]
        ilo = np.maximum(pt.out_lo[:, None, :], clo[None, :, :])
        ihi = np.minimum(pt.out_hi[:, None, :], chi[None, :, :])
        vol = np.prod(np.clip(ihi - ilo, 0, None), axis=2)
        pi, ci = np.nonzero(vol > 0)
        pdev, cdev = pt.dev[pi], c.shards.device[ci].astype(np.int32)
        same = pdev == cdev
        remote = ~same
        rp, rc = pi[remote], ci[remote]
        rdev = cdev[remote]
        n_dev = self.hw.n_devices
        key = rp.astype(np.int64) * n_dev + rdev
        groups, t_of_pair = np.unique(key, return_inverse=True)
        t_src = (groups // n_dev).astype(np.int64)
        t_dst = (groups % n_dev).astype(np.int32)
        t_vol = union_volumes(ilo[rp, rc], ihi[rp, rc], t_of_pair, len(groups))
        t_bytes = t_vol * itemsize
        t_dur = self.hw.transfer_time(pt.dev[t_src], t_dst, t_bytes) if len(groups) else np.zeros(0)
        return EdgeData(pi[same], ci[same], t_src, t_dst, t_bytes, np.asarray(t_dur, np.float64),
                        t_of_pair.astype(np.int64), rc)

    # -- sources -------------------------------------------------------------------------
    def resident(self, g: Graph, tensor: str, readers: list[tuple[Op, str]]) -> np.ndarray:
        key = ("res", tensor) + tuple((id(o), port) for o, port in readers)
        return self._cached(key, tuple(o for o, _ in readers), lambda: self._resident(g, tensor, readers))

    def _resident(self, g: Graph, tensor: str, readers: list[tuple[Op, str]]) -> np.ndarray:
        itemsize = ITEMSIZE[g.tensors[tensor].dtype]
        boxes = [self.input_boxes(g, o, port) for o, port in readers]
        lo = np.concatenate([b[0] for b in boxes])
        hi = np.concatenate([b[1] for b in boxes])
        dev = np.concatenate([o.shards.device for o, _ in readers])
        return union_volumes(lo, hi, dev, self.hw.n_devices) * itemsize

    # -- whole plan ----------------------------------------------------------------------
    def lower(self, g: Graph) -> Lowered:
        order = g.topo_order
        ops = [g.ops[n] for n in order]
        index = {n: i for i, n in enumerate(order)}
        tasks = [self.op_tasks(g, o) for o in ops]
        sizes = np.array([len(t.dev) for t in tasks], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        n_compute = int(offsets[-1])
        e_src, e_dst = [], []
        t_src, t_dst, t_bytes, t_dur, t_op = [], [], [], [], []
        tc_src, tc_dst = [], []
        n_t = 0
        resident = np.zeros(self.hw.n_devices)
        sources: dict[str, list[tuple[Op, str]]] = {}
        for ci, c in enumerate(ops):
            for port, t in c.inputs:
                pname = g.producers.get(t)
                if pname is None:
                    sources.setdefault(t, []).append((c, port))
                    continue
                pi = index[pname]
                e = self.edge(g, g.ops[pname], c, port)
                if len(e.local_src):
                    e_src.append(e.local_src + offsets[pi])
                    e_dst.append(e.local_dst + offsets[ci])
                if len(e.t_src):
                    t_src.append(e.t_src + offsets[pi])
                    t_dst.append(e.t_dst_dev)
                    t_bytes.append(e.t_bytes)
                    t_dur.append(e.t_dur)
                    t_op.append(np.full(len(e.t_src), ci, dtype=np.int64))
                    tc_src.append(e.tc_t + n_t)
                    tc_dst.append(e.tc_c + offsets[ci])
                    n_t += len(e.t_src)
        for t, readers in sources.items():
            if g.tensors[t].role in SOURCE_ROLES:
                resident += self.resident(g, t, readers)
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        T_src, T_dst = cat(t_src, np.int64), cat(t_dst, np.int32)
        n = n_compute + n_t
        kind = np.zeros(n, np.int8)
        kind[n_compute:] = 1
        dev = np.concatenate([cat([t.dev for t in tasks], np.int32), cat([t.dev for t in tasks], np.int32)[T_src]])
        dst = np.concatenate([np.full(n_compute, -1, np.int32), T_dst])
        dur = np.concatenate([cat([t.dur for t in tasks], np.float64), cat(t_dur, np.float64)])
        alloc = np.concatenate([cat([t.alloc for t in tasks], np.float64), cat(t_bytes, np.float64)])
        src_all = np.concatenate([cat(e_src, np.int64), T_src, cat(tc_src, np.int64) + n_compute])
        dst_all = np.concatenate([cat(e_dst, np.int64), np.arange(n_compute, n, dtype=np.int64),
                                  cat(tc_dst, np.int64)])
        ptr, idx = csr_from_edges(n, src_all, dst_all)
        return Lowered(kind, dev, dst, dur, ptr, idx, alloc, resident, self.hw.n_devices, list(order), offsets,
                       cat([t.flops for t in tasks], np.float64), cat(t_op, np.int64))
