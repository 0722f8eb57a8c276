"""Build real DTensors from a placements spec on a CPU gloo mesh, one process per mesh device,
and check that each device's local shard is the box the plan gives it.

    python dtensor_gloo_check.py SPEC.json

SPEC: ``{"mesh": {"shape": [2, 2], "names": [...]}, "tensors": [{"name", "shape", "placements",
"boxes": {rank: [lo, hi]}}], "partials": [{"name", "shape" (of the partials, K first),
"placements" (of the summed tensor), "boxes": {rank: [lo, hi] in the partials}}]}``.
A sharded tensor: ``distribute_tensor(full)`` (scattered from rank 0) must give each rank
``full[box]``. A Partial one: each rank's partial block, put together with ``DTensor.from_local``,
must sum (``full_tensor()``, an all-reduce) to the partials' sum. Prints ``OK <n>`` and exits 0.
"""

from __future__ import annotations

import json
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh


def _placement(text: str):
    if text.startswith("Shard("):
        return Shard(int(text[6:-1]))
    return Partial() if text == "Partial()" else Replicate()


def _full(name: str, shape: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))  # the same tensor on every rank
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _sl(box):
    return tuple(slice(a, b) for a, b in zip(*box))


def _worker(rank: int, world: int, port: int, spec: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", tuple(spec["mesh"]["shape"]), mesh_dim_names=tuple(spec["mesh"]["names"]))
    n = 0
    for t in spec["tensors"]:
        full = _full(t["name"], t["shape"])
        local = distribute_tensor(full, mesh, [_placement(p) for p in t["placements"]]).to_local()
        want = full[_sl(t["boxes"][str(rank)])]
        assert torch.equal(local, want), f"{t['name']} {t['placements']}: rank {rank} holds {tuple(local.shape)}, " \
                                          f"the plan gives it {tuple(want.shape)} or other values"
        n += 1
    for t in spec["partials"]:
        p = _full(t["name"], t["shape"])
        local = p[_sl(t["boxes"][str(rank)])][0].contiguous()
        summed = DTensor.from_local(local, mesh, [_placement(x) for x in t["placements"]],
                                    shape=p.shape[1:], stride=p[0].contiguous().stride()).full_tensor()
        assert torch.allclose(summed, p.sum(0)), f"{t['name']}: the Partial() placement does not sum the partials"
        n += 1
    dist.barrier()
    if rank == 0:
        print(f"OK {n}")
    dist.destroy_process_group()


def main(path: str) -> int:
    with open(path) as f:
        spec = json.load(f)
    world = 1
    for s in spec["mesh"]["shape"]:
        world *= s
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_worker, args=(world, port, spec), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
