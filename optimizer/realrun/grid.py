"""Running one plan across Dask workers: one plan device per worker, boxes moved as planned.

``run_plan_on_grid(g, client)`` maps plan device ``d`` to worker ``d mod n_workers`` (workers in
address order) and then, for each op in dependency order, submits one task per (op, device)
pinned to that device's worker. The task builds that device's memory (``executor.device_run``:
full-shape buffers plus validity masks) from exactly

- the *local pieces*: the results of earlier (op, device) tasks of the same device;
- the *transferred pieces*: one ``extract_box`` task per box of every transfer of
  ``costmodel.transfers.transfer_plan`` whose destination is this device, pinned on the worker
  of the transfer's source device, so Dask moves exactly those boxes between workers;
- the *resident pieces*: the boxes of graph inputs that the residency puts on this device
  (scattered from the driver to that worker),

computes its shards there (any read of a cell that none of these brought raises
``IncompleteCommunication`` on the worker, re-raised here), and returns its output boxes.
The driver gathers the output tensors and compares them with the unsharded original on the
same inputs (``executor.verify`` tolerances).

With ``backend="cupy"`` tasks ask for ``resources={"GPU": 1}`` (workers started with
``--resources GPU=1``) and compute on the worker's GPU; pieces travel between workers as host
arrays. Futures are dropped as soon as the outputs are gathered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------
# worker side (plain functions: importable by every worker)
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _graph(text: str) -> Any:
    from ir.serialize import loads

    return loads(text, "plan sent to the grid")  # validated: workers never compute on a broken plan


@lru_cache(maxsize=8)
def _ops(text: str) -> Any:
    from executor.device_run import prepare_ops

    return prepare_ops(_graph(text))


def extract_box(result: dict[str, Any], shard: int, lo: tuple[int, ...], hi: tuple[int, ...]) -> np.ndarray:
    """The box ``[lo, hi)`` of producer shard ``shard``'s output block (a copy, so only it moves)."""
    plo, _phi, block = result["shards"][shard]
    sl = tuple(slice(a - p, b - p) for a, b, p in zip(lo, hi, plo))
    return np.array(block[sl], copy=True)


def extract_piece(block: np.ndarray, plo: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> np.ndarray:
    """The box ``[lo, hi)`` of a resident piece that starts at ``plo`` (a copy: a state gather)."""
    return np.array(block[tuple(slice(a - p, b - p) for a, b, p in zip(lo, hi, plo))], copy=True)


def device_op_task(graph_text: str, op: str, device: int, backend: str, local: list[dict[str, Any]],
                   pieces: list[tuple[str, tuple[int, ...], tuple[int, ...], np.ndarray]]) -> dict[str, Any]:
    """Compute the shards of ``op`` placed on ``device`` from the given pieces only."""
    from executor.backend import get_backend, to_numpy
    from executor.device_run import DeviceMemory, compute_shard

    xp = get_backend(backend)
    g = _graph(graph_text)
    o = _ops(graph_text)[op]
    specs = {n: (t.shape, t.dtype) for n, t in g.tensors.items()}
    gpu = xp.cuda.Device().id if backend == "cupy" else None
    mem = DeviceMemory(xp, device, gpu, specs)
    with mem.ctx():
        for res in local:
            for lo, hi, block in res["shards"].values():
                mem.write(res["tensor"], lo, hi, xp.asarray(block))
        for tensor, lo, hi, block in pieces:
            mem.write(tensor, lo, hi, xp.asarray(block))
        shards = {}
        for i in range(o.n):
            if int(o.device[i]) != device:
                continue
            compute_shard(xp, o, i, mem)
            lo, hi = tuple(int(x) for x in o.out_lo[i]), tuple(int(x) for x in o.out_hi[i])
            shards[i] = (lo, hi, to_numpy(mem.buffer(o.output)[tuple(slice(a, b) for a, b in zip(lo, hi))]))
    return {"tensor": o.output, "device": device, "shards": shards}


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------


@dataclass
class GridReport:
    ok: bool
    max_rel_error: float
    tolerance: float
    per_output: dict[str, float]
    workers: list[str]
    device_worker: dict[int, str]
    op_tasks: int
    extract_tasks: int
    transfer_bytes: float
    resident_pieces: int
    seconds: float
    backend: str = "numpy"
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        rows = ", ".join(f"{k}: {v:.2e}" for k, v in self.per_output.items())
        return (f"{verdict}: max relative error {self.max_rel_error:.2e} (tolerance {self.tolerance:.0e}; {rows}); "
                f"{len(self.device_worker)} plan devices on {len(self.workers)} workers, {self.op_tasks} op tasks, "
                f"{self.extract_tasks} transferred boxes ({self.transfer_bytes:.0f} bytes), {self.seconds:.2f} s")

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "max_rel_error": self.max_rel_error, "tolerance": self.tolerance,
                "per_output": self.per_output, "workers": self.workers,
                "device_worker": {str(k): v for k, v in self.device_worker.items()}, "op_tasks": self.op_tasks,
                "extract_tasks": self.extract_tasks, "transfer_bytes": self.transfer_bytes,
                "resident_pieces": self.resident_pieces, "seconds": self.seconds, "backend": self.backend}


class GridError(RuntimeError):
    """The cluster cannot run the plan (no workers, no GPU workers for CuPy)."""


def _workers(client: Any, backend: str) -> list[str]:
    info = client.scheduler_info()
    workers = info.get("workers", {})
    if not workers:
        raise GridError("the Dask cluster has no workers; start some with 'dask worker ADDR'")
    if backend == "cupy":
        gpu = sorted(a for a, w in workers.items() if (w.get("resources") or {}).get("GPU", 0) >= 1)
        if not gpu:
            raise GridError("backend 'cupy' needs workers with a GPU, started with 'dask worker ADDR "
                            "--resources GPU=1'; none of this cluster's workers has one")
        return gpu
    return sorted(workers)


def run_plan_on_grid(g: Any, client: Any, backend: str = "numpy", seed: int = 0,
                     transfers: Any = None, reference: Any = None) -> GridReport:
    """Run plan ``g`` on the cluster of ``client`` (see the module docstring).

    ``transfers``: a ``TransferPlan`` to use instead of the plan's own (tests drop boxes from it
    to check that an incomplete communication plan fails). ``reference``: the program whose
    outputs the plan's must match (default: the plan's own unsharded form, which shows only
    that the sharding is consistent).
    """
    from costmodel.transfers import transfer_plan
    from executor.run import execute, outputs, random_inputs
    from executor.verify import TOLERANCE, rel_error
    from ir.rewrites import unshard
    from ir.serialize import dumps

    t0 = time.perf_counter()
    workers = _workers(client, backend)
    tp = transfers if transfers is not None else transfer_plan(g)
    devices = sorted(set(g.devices) | {r["device"] for r in tp.residency} | {t["dst"] for t in tp.transfers}
                     | {t["dst"] for t in tp.state_transfers})
    device_worker = {d: workers[d % len(workers)] for d in devices}
    kw: dict[str, Any] = {"allow_other_workers": False, "pure": False}
    if backend == "cupy":
        kw["resources"] = {"GPU": 1}

    ref_graph = unshard(g) if reference is None else reference
    inputs = random_inputs(ref_graph, seed)
    text = dumps(g)
    # the plan goes to every worker once (it is small next to the data)
    gfut = client.scatter(text, broadcast=True, hash=False)

    pieces: dict[int, list[Any]] = {d: [] for d in devices}  # per device: (tensor, lo, hi, future)
    resident = 0
    n_extract = 0
    for d in devices:
        blocks, meta = [], []
        for r in tp.residency:
            if r["device"] != d:
                continue
            src = np.asarray(inputs[r["tensor"]])
            for lo, hi in r["boxes"]:
                blocks.append(np.ascontiguousarray(src[tuple(slice(a, b) for a, b in zip(lo, hi))]))
                meta.append((r["tensor"], tuple(lo), tuple(hi)))
        if blocks:
            futs = client.scatter(blocks, workers=[device_worker[d]], hash=False)
            pieces[d].extend((t, lo, hi, f) for (t, lo, hi), f in zip(meta, futs))
            resident += len(blocks)

    # Loop-carried state starts at its home (a resident piece there); gathers copy boxes of it from
    # the home worker to the readers' workers before any op runs.
    for tr in tp.state_transfers:
        home = [(lo, hi, f) for t, lo, hi, f in pieces[tr["src"]] if t == tr["tensor"]]
        for lo, hi in tr["boxes"]:
            plo, _, f = next(p for p in home if all(a <= x and y <= b for a, b, x, y in zip(p[0], p[1], lo, hi)))
            box = client.submit(extract_piece, f, plo, tuple(lo), tuple(hi), workers=[device_worker[tr["src"]]], **kw)
            pieces[tr["dst"]].append((tr["tensor"], tuple(lo), tuple(hi), box))
            n_extract += 1

    by_producer: dict[str, list[dict[str, Any]]] = {}
    for tr in tp.transfers:
        by_producer.setdefault(tr["producer"], []).append(tr)
    results: dict[tuple[str, int], Any] = {}  # (op, device) -> future
    produced_on: dict[str, dict[int, Any]] = {}  # tensor -> device -> future of its (op, device) task
    for name in g.topo_order:
        o = g.ops[name]
        for d in sorted(set(o.shards.device.tolist())):
            local = []
            for _, t in o.inputs:
                fut = produced_on.get(t, {}).get(d)
                if fut is not None and all(fut is not x for x in local):
                    local.append(fut)
            reads = {t for _, t in o.inputs}
            mine = [p for p in pieces[d] if p[0] in reads]
            fut = client.submit(device_op_task, gfut, name, d, backend, local, mine, workers=[device_worker[d]], **kw)
            results[(name, d)] = fut
            produced_on.setdefault(o.output, {})[d] = fut
        for tr in by_producer.get(name, ()):
            src_fut = results[(name, tr["src"])]
            for lo, hi in tr["boxes"]:
                box = client.submit(extract_box, src_fut, tr["shard"], tuple(lo), tuple(hi),
                                    workers=[device_worker[tr["src"]]], **kw)
                pieces.setdefault(tr["dst"], []).append((tr["tensor"], tuple(lo), tuple(hi), box))
                n_extract += 1

    out_names = outputs(ref_graph)
    want = {(g.producers[t], d): results[(g.producers[t], d)] for t in out_names
            for d in set(g.ops[g.producers[t]].shards.device.tolist())}
    gathered = client.gather(list(want.values()))
    assembled: dict[str, np.ndarray] = {}
    for (op, _d), res in zip(want, gathered):
        t = g.ops[op].output
        arr = assembled.setdefault(t, np.zeros(g.tensors[t].shape, np.float32 if g.tensors[t].dtype == "bfloat16"
                                               else g.tensors[t].dtype))
        for lo, hi, block in res["shards"].values():
            arr[tuple(slice(a, b) for a, b in zip(lo, hi))] = block
    # drop every future now (held futures are recomputed when a worker dies)
    del want, gathered
    results.clear()
    produced_on.clear()
    pieces.clear()
    del gfut

    ref = execute(ref_graph, inputs, "numpy")
    per = {n: rel_error(assembled[n], np.asarray(ref[n])) for n in out_names}
    tol = max((TOLERANCE[ref_graph.tensors[n].dtype] for n in per), default=TOLERANCE["float32"])
    worst = max(per.values(), default=0.0)
    n_ops = sum(len(set(o.shards.device.tolist())) for o in g.ops.values())
    return GridReport(bool(worst <= tol), float(worst), tol, per, workers, device_worker, n_ops, n_extract,
                      tp.transfer_bytes, resident, time.perf_counter() - t0, backend)

