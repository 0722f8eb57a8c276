"""A plan in PyTorch DTensor words: per tensor, placements over a named 1-D or 2-D device mesh.

DTensor (``torch.distributed.tensor``) describes a tensor on an n-D device mesh by one placement
per mesh dim: ``Shard(d)`` (along that mesh dim, the devices hold equal contiguous chunks of
tensor dim ``d``, ``torch.chunk`` sizes), ``Replicate()`` (they all hold the same part) or
``Partial()`` (each holds a full-shape summand; the tensor is their sum). Several mesh dims
sharding one tensor dim split it outer mesh dim first (DTensor's default left-to-right order), as
``ir.rewrites.layout`` tiles it: a ``layout{mesh=2x2,use=b.t}`` plan (DP over the outer axis,
Megatron TP over the inner one) gives a column-parallel weight ``(Replicate(), Shard(1))`` and
its activations ``(Shard(0), Shard(1))`` over the ``(dp, tp)`` mesh.

``dtensor_placements(g, residency, mesh=None)`` reads, for every tensor, which box each plan
device holds:

- a produced tensor: the union of its producer's output boxes on that device;
- a graph input or parameter: the boxes resident there (``residency`` of the transfer plan);
- the partials ``p[k, ...]`` of a split reduction, one block along ``k`` per device of the mesh
  dims that shard ``k``: the accumulated tensor is ``Partial()`` over those mesh dims before its
  ``accumulate`` op (the all-reduce or reduce-scatter), recorded as ``<out>@before_accumulate``.

It then infers each mesh dim's placement from how the boxes change between neighbours along it
and checks the inference by recomputing every device's box from the placements (DTensor's
chunking). The mesh is given (an ``ir.mesh.Mesh`` over the plan's devices, or a shape), or chosen:
the 1-D mesh and every 2-D factorisation of the device count are tried and the one expressing
most tensors wins (fewer mesh dims on a tie). Axis names: ``dp``/``cp``/``tp`` when the caller
names the layout's uses, else ``ir.mesh``'s ``n0``/``g0`` style (``x`` for the default 1-D mesh).

Not expressible, with the reason recorded per tensor: a tensor held by only some of the mesh's
devices (pipeline stages: a sub-mesh would be needed per stage), several disjoint boxes per
device, a mesh dim along which the boxes change in more than one tensor dim (a retile whose
tiles are not a grid over the mesh), uneven chunks unlike ``torch.chunk``'s or chunks out of mesh
order, and plans whose devices are not the mesh's (a 2-D mesh needs a contiguous device range).
Halos (overlapping input boxes of convolutions) are included in the held boxes, so a halo'd
input is not expressible either (DTensor has no overlapping shards).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from executor.device_run import normalize_boxes
from ir.graph import Graph
from ir.mesh import Mesh, _ordered_factorisations
from ir.zspace import project_boxes

Box = tuple[tuple[int, ...], tuple[int, ...]]
USE_NAMES = {"b": "dp", "s": "cp", "t": "tp"}


def _bounding(boxes: list[Box]) -> Box | None:
    """The union of ``boxes`` when it is one box (else None)."""
    lo = tuple(min(b[0][k] for b in boxes) for k in range(len(boxes[0][0])))
    hi = tuple(max(b[1][k] for b in boxes) for k in range(len(boxes[0][0])))
    vol = int(np.prod([h - l for l, h in zip(lo, hi)]))
    total = sum(int(np.prod([h - l for l, h in zip(*b)])) for b in set(boxes))
    return (lo, hi) if vol == total else None  # disjoint boxes: equal volume <=> they tile it


def expected_box(shape: Sequence[int], placements: Sequence[str], shape_mesh: Sequence[int],
                 coord: Sequence[int]) -> Box:
    """The box DTensor gives the device at mesh ``coord`` (``torch.chunk`` per mesh dim, outer
    mesh dim first; ``Replicate()``/``Partial()`` keep the whole extent)."""
    lo, hi = [0] * len(shape), list(shape)
    for a, p in enumerate(placements):
        if not p.startswith("Shard("):
            continue
        k = int(p[6:-1])
        size = hi[k] - lo[k]
        chunk = -(-size // shape_mesh[a])
        base = lo[k]
        lo[k], hi[k] = base + min(coord[a] * chunk, size), base + min((coord[a] + 1) * chunk, size)
    return tuple(lo), tuple(hi)


def _placement(shape: tuple[int, ...], held: Mapping[int, list[Box]], devices: list[int],
               mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    if set(held) != set(devices):
        return {"expressible": False, "devices": sorted(held),
                "why": f"held by devices {sorted(held)} only, not by the whole mesh {devices} (a pipeline stage "
                       f"needs its own sub-mesh)"}
    boxes = {}
    for d in devices:
        b = _bounding(held[d])
        if b is None:
            return {"expressible": False, "why": f"device {d} holds several disjoint boxes"}
        boxes[d] = b
    grid = np.array(devices).reshape(mesh_shape)
    placements = []
    for a, m in enumerate(mesh_shape):
        changed: set[int] = set()
        for coord in np.ndindex(*mesh_shape):
            if coord[a] + 1 < m:
                nxt = coord[:a] + (coord[a] + 1,) + coord[a + 1:]
                b0, b1 = boxes[int(grid[coord])], boxes[int(grid[nxt])]
                changed |= {k for k in range(len(shape)) if (b0[0][k], b0[1][k]) != (b1[0][k], b1[1][k])}
        if len(changed) > 1:
            return {"expressible": False,
                    "why": f"along mesh dim {a} the boxes change in tensor dims {sorted(changed)}: one mesh dim "
                           f"shards one tensor dim"}
        placements.append(f"Shard({changed.pop()})" if changed else "Replicate()")
    for coord in np.ndindex(*mesh_shape):
        d = int(grid[coord])
        want = expected_box(shape, placements, mesh_shape, coord)
        if boxes[d] != want:
            return {"expressible": False, "placements_tried": placements,
                    "why": f"device {d} holds {_box_text(boxes[d])}, {placements} would give it {_box_text(want)} "
                           f"(uneven chunks unlike torch.chunk's, chunks out of mesh order, or a part missing)"}
    return {"expressible": True, "placements": placements}


def _box_text(b: Box) -> str:
    return "[" + ", ".join(f"{a}:{c}" for a, c in zip(*b)) + "]"


def _held(g: Graph, residency: Iterable[Mapping[str, Any]]) -> tuple[dict[str, dict[int, list[Box]]], dict[str, str]]:
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
    return held, partial_of


def _on_mesh(g: Graph, held: Mapping[str, dict[int, list[Box]]], partial_of: Mapping[str, str],
             devices: list[int], mesh_shape: tuple[int, ...], names: list[str]) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for name, t in g.tensors.items():
        if name not in held:
            continue
        p = _placement(t.shape, held[name], devices, mesh_shape)
        if name in partial_of and p["expressible"]:
            pl = p["placements"]
            blocks = int(np.prod([m for m, x in zip(mesh_shape, pl) if x == "Shard(0)"]))
            if blocks == t.shape[0] > 1:  # one partial sum per device along those mesh dims
                summed = ["Partial()" if x == "Shard(0)" else
                          f"Shard({int(x[6:-1]) - 1})" if x.startswith("Shard(") else x for x in pl]
                tensors[partial_of[name] + "@before_accumulate"] = {
                    "expressible": True, "placements": summed, "note": f"the partials {name} of a split reduction"}
                p = {**p, "note": "one partial sum per device: the accumulated tensor is Partial()"}
        tensors[name] = p
    bad = [n for n, p in tensors.items() if not p["expressible"]]
    return {"mesh": {"names": names, "shape": list(mesh_shape), "devices": devices,
                     **({"name": names[0]} if len(names) == 1 else {})},
            "expressible": not bad, "not_expressible": bad, "tensors": tensors}


def dtensor_placements(g: Graph, residency: Iterable[Mapping[str, Any]], mesh_name: str = "x",
                       mesh: Mesh | Sequence[int] | None = None,
                       axis_names: Sequence[str] | None = None) -> dict[str, Any]:
    """Placements JSON (plain data) for plan ``g``; see the module docstring.

    ``mesh``: an ``ir.mesh.Mesh`` (its devices ``offset ..``, row-major) or a mesh shape over the
    plan's devices in ascending order; None tries 1-D and every 2-D shape. ``axis_names``: one
    name per mesh dim, or layout uses (``b``, ``s``, ``t`` become ``dp``, ``cp``, ``tp``).
    """
    residency = list(residency)
    held, partial_of = _held(g, residency)
    plan_devices = sorted(g.devices | {int(r["device"]) for r in residency})
    if isinstance(mesh, Mesh):
        candidates = [(list(range(mesh.offset, mesh.offset + mesh.size)), mesh.shape, list(mesh.names))]
    elif mesh is not None:
        shape = tuple(int(x) for x in mesh)
        candidates = [(plan_devices, shape, [f"m{a}" for a in range(len(shape))])]
    else:
        n = len(plan_devices)
        candidates = [(plan_devices, (n,), [mesh_name])]
        if plan_devices == list(range(plan_devices[0], plan_devices[0] + n)):  # 2-D needs a device range
            candidates += [(plan_devices, s, ["m0", "m1"]) for s in _ordered_factorisations(n, 2) if len(s) == 2]
    best = None
    for devices, shape, names in candidates:
        if int(np.prod(shape)) != len(devices):
            raise ValueError(f"mesh shape {list(shape)} does not cover the {len(devices)} devices {devices}")
        if axis_names is not None:
            if len(axis_names) != len(shape):
                raise ValueError(f"axis_names {list(axis_names)} needs one name per mesh dim of {list(shape)}")
            names = [USE_NAMES.get(x, x) for x in axis_names]
        got = _on_mesh(g, held, partial_of, devices, tuple(shape), names)
        if best is None or len(got["not_expressible"]) < len(best["not_expressible"]):
            best = got
    return best
