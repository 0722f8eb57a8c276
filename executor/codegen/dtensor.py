"""A plan in PyTorch DTensor words: per tensor, placements over a named 1-D device mesh.

DTensor (``torch.distributed.tensor``) describes a tensor on a mesh by one placement per mesh
dim: ``Shard(d)`` (device k holds the k-th of equal contiguous chunks along tensor dim ``d``),
``Replicate()`` (every device holds all of it) or ``Partial()`` (every device holds a full-shape
summand; the tensor is their sum). ``dtensor_placements(g, residency)`` reads, for every tensor,
which box each plan device holds:

- a produced tensor: the union of its producer's output boxes on that device;
- a graph input or parameter: the boxes resident there (``residency`` of the transfer plan);
- the partials ``p[k, ...]`` of a split reduction, one block per device along ``k``: the
  accumulated tensor is ``Partial()`` before its ``accumulate`` op (the all-reduce).

Not expressible, with the reason recorded per tensor: a tensor held by only some of the mesh's
devices (pipeline stages: a sub-mesh would be needed per stage), uneven or out-of-order chunks,
several boxes per device, tiles split along more than one dim (needs a 2-D mesh whose axes the
plan does not name), and halos (overlapping input boxes of convolutions). The mesh is 1-D over
the plan's devices in ascending order, named ``("dp",)`` style by the caller (default ``"x"``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from executor.device_run import normalize_boxes
from ir.graph import Graph
from ir.zspace import project_boxes

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _bounding(boxes: list[Box]) -> Box | None:
    """The union of ``boxes`` when it is one box (else None)."""
    lo = tuple(min(b[0][k] for b in boxes) for k in range(len(boxes[0][0])))
    hi = tuple(max(b[1][k] for b in boxes) for k in range(len(boxes[0][0])))
    vol = int(np.prod([h - l for l, h in zip(lo, hi)]))
    total = sum(int(np.prod([h - l for l, h in zip(*b)])) for b in boxes)
    return (lo, hi) if vol == total else None  # disjoint producer boxes: equal volume <=> they tile it


def _placement(shape: tuple[int, ...], held: Mapping[int, list[Box]], mesh: list[int]) -> dict[str, Any]:
    whole = (tuple(0 for _ in shape), tuple(shape))
    if set(held) != set(mesh):
        return {"expressible": False, "devices": sorted(held),
                "why": f"held by devices {sorted(held)} only, not by the whole mesh {mesh} (a pipeline stage "
                       f"needs its own sub-mesh)"}
    boxes = {}
    for d in mesh:
        b = _bounding(held[d])
        if b is None:
            return {"expressible": False, "why": f"device {d} holds several disjoint boxes"}
        boxes[d] = b
    if all(b == whole for b in boxes.values()):
        return {"expressible": True, "placements": ["Replicate()"]}
    varying = [k for k in range(len(shape)) if len({b[0][k] for b in boxes.values()}) > 1
               or any(b[0][k] != 0 or b[1][k] != shape[k] for b in boxes.values())]
    if len(varying) != 1:
        return {"expressible": False, "why": f"split along dims {varying}: a 1-D mesh shards one dim"}
    k = varying[0]
    n = len(mesh)
    chunk = -(-shape[k] // n)  # torch.chunk sizes: ceil, the last chunk shorter
    for i, d in enumerate(mesh):
        lo, hi = boxes[d][0][k], boxes[d][1][k]
        if (lo, hi) != (min(i * chunk, shape[k]), min((i + 1) * chunk, shape[k])):
            return {"expressible": False,
                    "why": f"dim {k} is split unevenly or out of mesh order (device {d} holds {lo}:{hi})"}
    return {"expressible": True, "placements": [f"Shard({k})"]}


def dtensor_placements(g: Graph, residency: Iterable[Mapping[str, Any]], mesh_name: str = "x") -> dict[str, Any]:
    """Placements JSON (plain data) for plan ``g``; see the module docstring."""
    mesh = sorted(g.devices | {int(r["device"]) for r in residency})
    held: dict[str, dict[int, list[Box]]] = {}
    for r in residency:
        for lo, hi in normalize_boxes(r["boxes"]):
            held.setdefault(r["tensor"], {}).setdefault(int(r["device"]), []).append((lo, hi))
    partial_of: dict[str, str] = {}
    for name in g.topo_order:
        o = g.ops[name]
        sig = g.signature(o)
        lo, hi = project_boxes(sig.output, o.shards.lo, o.shards.hi)
        shape = np.array(g.tensors[o.output].shape)
        for i, d in enumerate(o.shards.device.tolist()):
            b = (tuple(np.clip(lo[i], 0, shape).tolist()), tuple(np.clip(hi[i], 0, shape).tolist()))
            held.setdefault(o.output, {}).setdefault(int(d), []).append(b)
        if o.kernel == "accumulate":
            partial_of[o.inputs[0][1]] = o.output
    tensors: dict[str, Any] = {}
    for name, t in g.tensors.items():
        if name not in held:
            continue
        if name in partial_of:
            p = _placement(t.shape, held[name], mesh)
            if p.get("placements") == ["Shard(0)"] and t.shape[0] == len(mesh):
                tensors[partial_of[name] + "@before_accumulate"] = {"expressible": True, "placements": ["Partial()"],
                                                                   "note": f"the partials {name} of a split reduction"}
                p = {**p, "note": "one partial sum per device: the accumulated tensor is Partial()"}
            tensors[name] = p
            continue
        tensors[name] = _placement(t.shape, held[name], mesh)
    bad = [n for n, p in tensors.items() if not p["expressible"]]
    return {"mesh": {"name": mesh_name, "shape": [len(mesh)], "devices": mesh},
            "expressible": not bad, "not_expressible": bad, "tensors": tensors}

