"""The communication plan of a plan as plain data: which boxes move between which devices.

``transfer_plan(g, hw_or_n_devices)`` gives what the cost model's lowering
(``costmodel.lowering``) charges for, box by box, so that the device-aware executor
(``executor.device_run``) and the Dask grid runner (``optimizer.realrun.grid``) move exactly that data:

- **transfers**: for every produced tensor (producers in topological order), the producer's output
  boxes are intersected with the input boxes of *every* reader shard (all consumer ops and
  ports, each box clipped to the tensor as the lowering clips it). Across devices there is one
  transfer per (producer shard, destination device), in producer-shard then destination order,
  carrying the union of what that device's readers need from that shard. The union is given as
  pairwise-disjoint boxes, so the sum of their volumes is the transfer's size and a box needed by
  several readers on one device moves once. This is the order, and these are the bytes, of the
  lowering's transfer nodes (``Lowered.kind == 1``; ``tests/execution/test_transfer_plan.py``
  checks both on random plans).
- **residency**: graph inputs and parameters are resident before the run where their readers
  need them: per (tensor, device), the disjoint union of the boxes read there (the lowering's
  resident memory). A loop-carried state ``P`` (``Graph.carried``) is resident at its *home*
  instead: per device, the boxes the shards of ``P.next``'s producer write there.
- **state_transfers**: the reads of a loop-carried state away from its home (FSDP's
  all-gather), dicts ``{tensor, producer, shard, src, dst, boxes, bytes}`` where ``producer`` and
  ``shard`` name the home shard (a shard of ``P.next``'s producer) and ``tensor`` is ``P``. They
  happen before the step's first op (the state is at home when the step starts; no op produces
  it), states in the order of their next value's producer, then by (home shard, destination).
  The lowering's transfer nodes are ``transfers + state_transfers``, in that order.

Everything is plain data (``TransferPlan.to_json``): ``executor`` never imports ``costmodel``.
Boxes are ``(lo, hi)`` tuples of ints, half-open per dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costmodel.hardware import Hardware, HardwareError
from ir.graph import SOURCE_ROLES, Graph
from ir.kernels import ITEMSIZE
from ir.zspace import project_boxes

__all__ = ["TransferPlan", "transfer_plan", "disjoint_union", "box_volume"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class TransferPlan:
    """``transfers``: dicts ``{tensor, producer, shard, src, dst, boxes, bytes}`` (``producer`` is
    the producing op, ``shard`` its shard index, ``src``/``dst`` plan devices); ``residency``:
    dicts ``{tensor, device, boxes, bytes}``; ``state_transfers``: like ``transfers``, for the
    reads of loop-carried state away from its home (before the first op). ``n_devices``: the fleet
    size it was made for."""

    n_devices: int
    transfers: list[dict[str, Any]] = field(default_factory=list)
    residency: list[dict[str, Any]] = field(default_factory=list)
    state_transfers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def transfer_bytes(self) -> float:
        """Bytes of the transfers of produced tensors (``state_bytes``: those of state reads)."""
        return float(sum(t["bytes"] for t in self.transfers))

    @property
    def state_bytes(self) -> float:
        return float(sum(t["bytes"] for t in self.state_transfers))

    def resident_bytes(self) -> np.ndarray:
        """float64[n_devices]: bytes of graph inputs resident on each device."""
        out = np.zeros(self.n_devices)
        for r in self.residency:
            out[r["device"]] += r["bytes"]
        return out

    def to_json(self) -> dict[str, Any]:
        def boxes(bs: list[Box]) -> list[list[list[int]]]:
            return [[list(lo), list(hi)] for lo, hi in bs]

        return {"n_devices": self.n_devices,
                "transfers": [{**t, "boxes": boxes(t["boxes"])} for t in self.transfers],
                "residency": [{**r, "boxes": boxes(r["boxes"])} for r in self.residency],
                "state_transfers": [{**t, "boxes": boxes(t["boxes"])} for t in self.state_transfers]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TransferPlan":
        def boxes(bs: Any) -> list[Box]:
            return [(tuple(int(x) for x in lo), tuple(int(x) for x in hi)) for lo, hi in bs]

        return cls(int(d["n_devices"]), [{**t, "boxes": boxes(t["boxes"])} for t in d["transfers"]],
                   [{**r, "boxes": boxes(r["boxes"])} for r in d["residency"]],
                   [{**t, "boxes": boxes(t["boxes"])} for t in d.get("state_transfers", ())])


# ---------------------------------------------------------------------------------------------
# box helpers
# ---------------------------------------------------------------------------------------------


def box_volume(lo: Any, hi: Any) -> int:
    v = 1
    for a, b in zip(lo, hi):
        if b <= a:
            return 0
        v *= int(b) - int(a)
    return v


def _subtract(lo: tuple[int, ...], hi: tuple[int, ...], clo: tuple[int, ...], chi: tuple[int, ...]) -> list[Box]:
    """``[lo, hi)`` minus ``[clo, chi)`` as disjoint boxes (slabs below/above, dimension by dimension)."""
    if any(max(a, c) >= min(b, d) for a, b, c, d in zip(lo, hi, clo, chi)):
        return [(lo, hi)]
    out: list[Box] = []
    cur_lo, cur_hi = list(lo), list(hi)
    for d in range(len(lo)):
        if cur_lo[d] < clo[d]:
            h = list(cur_hi)
            h[d] = clo[d]
            out.append((tuple(cur_lo), tuple(h)))
        if cur_hi[d] > chi[d]:
            lo2 = list(cur_lo)
            lo2[d] = chi[d]
            out.append((tuple(lo2), tuple(cur_hi)))
        cur_lo[d] = max(cur_lo[d], clo[d])
        cur_hi[d] = min(cur_hi[d], chi[d])
    return out


def disjoint_union(lo: np.ndarray, hi: np.ndarray) -> list[Box]:
    """The union of boxes (rows of ``lo``/``hi``) as pairwise-disjoint non-empty boxes.

    Larger boxes first; exact duplicates and boxes inside an earlier one are dropped; the rest
    are cut against the boxes already taken. Deterministic for a given input.
    """
    lo = np.asarray(lo, np.int64)
    hi = np.asarray(hi, np.int64)
    if lo.shape[0] == 0:
        return []
    vol = np.prod(np.clip(hi - lo, 0, None), axis=1)
    order = np.argsort(-vol, kind="stable")
    taken: list[Box] = []
    for i in order:
        if vol[i] <= 0:
            continue
        b = (tuple(int(x) for x in lo[i]), tuple(int(x) for x in hi[i]))
        if any(all(tl <= bl and bh <= th for tl, th, bl, bh in zip(t[0], t[1], b[0], b[1])) for t in taken):
            continue
        pieces = [b]
        for t in taken:
            nxt: list[Box] = []
            for p in pieces:
                nxt.extend(_subtract(p[0], p[1], t[0], t[1]))
            pieces = nxt
            if not pieces:
                break
        taken.extend(pieces)
    return taken


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


def _n_devices(g: Graph, hw_or_n_devices: Any) -> int:
    if hw_or_n_devices is None:
        return 1 + max(g.devices, default=0)
    if isinstance(hw_or_n_devices, Hardware):
        n, name = hw_or_n_devices.n_devices, hw_or_n_devices.name
    else:
        n, name = int(hw_or_n_devices), f"{int(hw_or_n_devices)} devices"
    top = max(g.devices, default=0)
    if top >= n or min(g.devices, default=0) < 0:
        raise HardwareError(f"the plan places shards on devices up to {top}, but {name!r} has devices 0..{n - 1}")
    return n


def reader_boxes(g: Graph, op: str, port: str) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) int64[n, rank]: the box each shard of ``op`` reads through ``port``, clipped to
    the tensor as the lowering clips it (the part beyond the edge is zero padding, never data)."""
    o = g.ops[op]
    sig = g.signature(o)
    lo, hi = project_boxes(sig.inputs[port], o.shards.lo, o.shards.hi)
    shape = np.array(g.tensors[o.input_map[port]].shape, np.int64)
    lo = np.clip(lo, 0, shape)
    return lo, np.clip(hi, lo, shape)


def transfer_plan(g: Graph, hw_or_n_devices: Hardware | int | None = None) -> TransferPlan:
    """The transfers and input residency of plan ``g`` (see the module docstring)."""
    n_dev = _n_devices(g, hw_or_n_devices)
    order = g.topo_order
    readers: dict[str, list[tuple[str, str]]] = {}
    for name in order:
        for port, t in g.ops[name].inputs:
            readers.setdefault(t, []).append((name, port))
    tp = TransferPlan(n_dev)
    carried = g.carried
    state_of = {nxt: p for p, nxt in carried.items()}

    def moves(name: str, t: str, rd: list[tuple[str, str]], out: list[dict[str, Any]]) -> None:
        """What the readers ``rd`` of ``t`` need from the output boxes of op ``name``'s shards."""
        o = g.ops[name]
        sig = g.signature(o)
        p_lo, p_hi = project_boxes(sig.output, o.shards.lo, o.shards.hi)
        p_dev = o.shards.device
        boxes = [reader_boxes(g, r, port) for r, port in rd]
        c_lo = np.concatenate([b[0] for b in boxes])
        c_hi = np.concatenate([b[1] for b in boxes])
        c_dev = np.concatenate([g.ops[r].shards.device for r, _ in rd])
        itemsize = ITEMSIZE[g.tensors[t].dtype]
        for pi in range(len(p_dev)):
            ilo = np.maximum(p_lo[pi][None, :], c_lo)
            ihi = np.minimum(p_hi[pi][None, :], c_hi)
            hit = np.all(ihi > ilo, axis=1) & (c_dev != p_dev[pi])
            if not hit.any():
                continue
            for d in sorted(set(c_dev[hit].tolist())):
                sel = hit & (c_dev == d)
                parts = disjoint_union(ilo[sel], ihi[sel])
                vol = sum(box_volume(a, b) for a, b in parts)
                out.append({"tensor": t, "producer": name, "shard": int(pi), "src": int(p_dev[pi]),
                            "dst": int(d), "boxes": parts, "bytes": float(vol * itemsize)})

    for name in order:  # produced tensors, producers in topological order
        rd = readers.get(g.ops[name].output)
        if rd:
            moves(name, g.ops[name].output, rd, tp.transfers)
    for name in order:  # loop-carried state read away from its home
        p = state_of.get(g.ops[name].output)
        if p is not None and readers.get(p):
            moves(name, p, readers[p], tp.state_transfers)
    for t, rd in readers.items():  # graph inputs, in first-reader order
        if t in g.producers or t in carried or g.tensors[t].role not in SOURCE_ROLES:
            continue
        boxes = [reader_boxes(g, r, port) for r, port in rd]
        lo = np.concatenate([b[0] for b in boxes])
        hi = np.concatenate([b[1] for b in boxes])
        dev = np.concatenate([g.ops[r].shards.device for r, _ in rd])
        itemsize = ITEMSIZE[g.tensors[t].dtype]
        for d in sorted(set(dev.tolist())):
            parts = disjoint_union(lo[dev == d], hi[dev == d])
            if parts:
                vol = sum(box_volume(a, b) for a, b in parts)
                tp.residency.append({"tensor": t, "device": int(d), "boxes": parts, "bytes": float(vol * itemsize)})
    for name in order:  # homes of the loop-carried states
        p = state_of.get(g.ops[name].output)
        if p is None:
            continue
        o = g.ops[name]
        lo, hi = project_boxes(g.signature(o).output, o.shards.lo, o.shards.hi)
        shape = np.array(g.tensors[p].shape, np.int64)
        lo = np.clip(lo, 0, shape)
        hi = np.clip(hi, lo, shape)
        itemsize = ITEMSIZE[g.tensors[p].dtype]
        for d in sorted(set(o.shards.device.tolist())):
            parts = disjoint_union(lo[o.shards.device == d], hi[o.shards.device == d])
            if parts:
                vol = sum(box_volume(a, b) for a, b in parts)
                tp.residency.append({"tensor": p, "device": int(d), "boxes": parts, "bytes": float(vol * itemsize)})
    return tp
