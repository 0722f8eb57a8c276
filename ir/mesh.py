"""Device meshes: the fleet (or a part of it) seen as a grid of named axes.

A ``Mesh`` of shape ``(8, 8)`` over 64 devices numbers devices row-major: mesh coordinate
``(i, j)`` is device ``8 i + j``. Devices are numbered node-major (device ``d`` sits on node
``d // devices_per_node``), so on 8 nodes of 8 the outer axis runs across nodes and the inner one
inside a node. A mesh is *node-aligned* when every axis lies wholly inside a node (its stride
times its size divides ``devices_per_node``) or strides over whole nodes (its stride is a multiple
of ``devices_per_node``): ``4x2x8`` on 8 nodes of 8 is aligned; ``16x4`` and ``64`` are not (an
axis of 16 consecutive devices straddles two nodes).

Axes are named by where they lie: ``n0, n1, ...`` across nodes, ``g0, g1, ...`` inside a node.

This module needs only device counts (``ir`` imports nothing from ``costmodel``); callers pass
``n_nodes`` and ``devices_per_node`` from the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod

import numpy as np


class MeshError(ValueError):
    """A mesh text that does not parse, or a mesh larger than the fleet."""


@dataclass(frozen=True)
class Mesh:
    """Axis sizes outer -> inner over devices ``offset .. offset + size - 1`` (row-major)."""

    shape: tuple[int, ...]
    devices_per_node: int = 8
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.shape or any(s < 1 for s in self.shape):
            raise MeshError(f"mesh shape {self.shape} needs one or more axis sizes >= 1")

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def strides(self) -> tuple[int, ...]:
        """Device-number stride of each axis."""
        return tuple(prod(self.shape[a + 1:]) for a in range(self.ndim))

    @cached_property
    def names(self) -> tuple[str, ...]:
        """``n<k>`` for axes across nodes, ``g<k>`` for axes inside a node (outer first)."""
        out, n, gk = [], 0, 0
        for a in range(self.ndim):
            if self.strides[a] >= self.devices_per_node and self.shape[a] > 1:
                out.append(f"n{n}")
                n += 1
            else:
                out.append(f"g{gk}")
                gk += 1
        return tuple(out)

    def crosses_nodes(self, axis: int) -> bool:
        return self.strides[axis] * (self.shape[axis] - 1) + (self.offset % self.devices_per_node) \
            >= self.devices_per_node

    def device(self, coords: np.ndarray) -> np.ndarray:
        """Device numbers of mesh coordinates (``(n, ndim)`` int array)."""
        return self.offset + np.asarray(coords, dtype=np.int64) @ np.asarray(self.strides, dtype=np.int64)

    @property
    def text(self) -> str:
        return "x".join(map(str, self.shape)) + (f"@{self.offset}" if self.offset else "")

    def __str__(self) -> str:
        return self.text


def node_aligned(shape: tuple[int, ...], devices_per_node: int) -> bool:
    """Every axis lies inside a node (its extent in device numbers divides ``devices_per_node``)
    or strides over whole nodes (its stride is a multiple of ``devices_per_node``)."""
    for a in range(len(shape)):
        stride = prod(shape[a + 1:])
        if devices_per_node % (stride * shape[a]) and stride % devices_per_node:
            return False
    return True


def parse_mesh(text: str, devices_per_node: int = 8) -> Mesh:
    """``"8x8"`` or ``"4x2x8"`` (optionally ``"8@16"``: 8 devices from device 16)."""
    body, _, off = str(text).partition("@")
    try:
        shape = tuple(int(x) for x in body.split("x"))
        offset = int(off) if off else 0
    except ValueError:
        raise MeshError(f"mesh {text!r} must look like 8x8 or 4x2x8 (axis sizes, outer first)") from None
    return Mesh(shape, devices_per_node, offset)


def _ordered_factorisations(n: int, max_axes: int) -> list[tuple[int, ...]]:
    """Ordered factorisations of ``n`` into at most ``max_axes`` factors >= 2."""
    if n == 1:
        return [()]
    if max_axes == 0:
        return []
    return [(f,) + rest for f in range(2, n + 1) if n % f == 0
            for rest in _ordered_factorisations(n // f, max_axes - 1)]


def enumerate_meshes(n_nodes: int, devices_per_node: int, max_axes: int = 3,
                     subsets: bool = True) -> list[Mesh]:
    """Node-aligned meshes of the whole fleet (and, with ``subsets``, of one node and of whole
    groups of nodes from device 0), each with 1 to ``max_axes`` axes of size >= 2."""
    total = n_nodes * devices_per_node
    sizes = [total]
    if subsets:
        sizes += [d for d in range(2, total) if total % d == 0
                  and (devices_per_node % d == 0 or d % devices_per_node == 0)]
    out = []
    for size in sorted(set(sizes)):
        for shape in _ordered_factorisations(size, max_axes):
            if shape and node_aligned(shape, devices_per_node):
                out.append(Mesh(shape, devices_per_node))
    return out


def mesh_for(n_nodes: int, devices_per_node: int) -> Mesh:
    """The natural two-level mesh: nodes x devices per node (one axis for a single node)."""
    if n_nodes == 1:
        return Mesh((devices_per_node,), devices_per_node)
    return Mesh((n_nodes, devices_per_node), devices_per_node)


__all__ = ["Mesh", "MeshError", "enumerate_meshes", "mesh_for", "node_aligned", "parse_mesh"]
