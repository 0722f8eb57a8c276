"""Device meshes: node-aligned factorisations with named axes; text form and refusals."""

from __future__ import annotations

import numpy as np
import pytest

from ir.mesh import Mesh, MeshError, enumerate_meshes, node_aligned, parse_mesh


def test_meshes_of_64_are_node_aligned_factorisations():
    texts = {m.text for m in enumerate_meshes(8, 8, max_axes=3, subsets=False)}
    assert {"8x8", "4x2x8", "2x4x8", "8x2x4", "8x4x2"} <= texts
    assert "16x4" not in texts  # its outer axis would mix devices inside and across nodes
    assert not {"64", "2x32", "4x16"} & texts  # an axis of 16 or more devices straddles nodes (use 8x8)
    for m in enumerate_meshes(8, 8):
        assert node_aligned(m.shape, 8) and m.size in (2, 4, 8, 16, 32, 64)


def test_axis_names_and_device_numbers():
    m = parse_mesh("4x2x8")
    assert m.names == ("n0", "n1", "g0") and m.strides == (16, 8, 1)
    assert [m.crosses_nodes(a) for a in range(3)] == [True, True, False]
    assert m.device(np.array([[1, 1, 3]])).tolist() == [16 + 8 + 3]
    assert parse_mesh("8", 8).names == ("g0",)
    assert parse_mesh("2x4@8").device(np.array([[0, 0]])).tolist() == [8]


@pytest.mark.parametrize("bad", ["8y8", "x", "8x-1", ""])
def test_bad_mesh_text_is_refused(bad):
    with pytest.raises(MeshError):
        parse_mesh(bad)


def test_mesh_rejects_empty_shape():
    with pytest.raises(MeshError, match="axis sizes"):
        Mesh(())
