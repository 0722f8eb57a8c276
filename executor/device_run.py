"""Device-aware execution: one buffer set per plan device, data moved only as the plan says.

``run_on_devices(g, transfers, residency)`` runs plan ``g`` the way a fleet would:

- every plan device has its own buffers: one full-shape array per tensor it touches, allocated
  lazily on that device's GPU (``cupy.cuda.Device(gpu)``; NumPy on the host), and a boolean
  *validity mask* per (device, tensor), kept in NumPy on the host;
- graph inputs are copied in only where ``residency`` puts them (``{tensor, device, boxes}``);
- ops run in dependency order, each shard on its device, reading only that device's buffers:
  a read of any cell not valid there raises :class:`IncompleteCommunication` naming the op,
  shard, device, tensor and the missing box (so an incomplete communication plan fails loudly
  instead of reading stale data);
- after an op, the transfers whose producer is that op (``{tensor, producer, shard, src, dst,
  boxes}``) copy exactly their boxes from ``src``'s buffer to ``dst``'s (NumPy: a slice copy;
  CuPy: a device-to-device copy under the destination device's context).

The transfer plan is plain data (lists of dicts): ``costmodel.transfers.transfer_plan(g, hw)``
makes it from the cost model's lowering, and ``executor`` never imports ``costmodel``.

Plan devices map onto GPUs round-robin (``device_map``, default ``d -> d % n_gpus``): several
plan devices may share one GPU and then run one after another. On NumPy all map to the host.

Timing (``timing=True``): after the checked run, ``warmup`` untimed and ``repeats`` timed runs
(without the mask bookkeeping); each shard and each transfer is timed by ``perf_counter`` on CPU
and by CUDA events recorded on the device's current stream on GPU, the whole plan by
``perf_counter`` between device synchronisations; every figure is the median over the repeats.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from executor.backend import exec_dtype, get_backend, to_numpy
from executor.run import random_inputs, read_box
from ir.graph import Graph
from ir.kernels import get_kernel
from ir.zspace import ZRange, project_boxes

__all__ = ["DeviceRunResult", "IncompleteCommunication", "DeviceMemory", "OpExec", "device_name", "prepare_ops",
           "run_on_devices", "compute_shard", "normalize_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


class IncompleteCommunication(RuntimeError):
    """A shard (or a transfer) read cells that are not valid on its device."""

    def __init__(self, op: str, shard: int, device: int, tensor: str, box: Box, reader: str = "op") -> None:
        self.op, self.shard, self.device, self.tensor, self.box = op, shard, device, tensor, box
        what = f"op {op!r} shard {shard}" if reader == "op" else f"the transfer of op {op!r} shard {shard}"
        super().__init__(
            f"incomplete communication: {what} on device {device} reads tensor {tensor!r} box "
            f"{_fmt(box)}, which is not on device {device} (no transfer or residency brings it there)")
        self._reader = reader

    def __reduce__(self) -> tuple:  # picklable (Dask re-raises it on the client)
        return (type(self), (self.op, self.shard, self.device, self.tensor, self.box, self._reader))


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(*box)) + "]"


def normalize_boxes(boxes: Iterable[Any]) -> list[Box]:
    """``[(lo, hi), ...]`` from tuples, lists (JSON) or ``ZRange`` objects."""
    out = []
    for b in boxes:
        if isinstance(b, ZRange):
            out.append((b.start, b.end))
        else:
            lo, hi = b
            out.append((tuple(int(x) for x in lo), tuple(int(x) for x in hi)))
    return out


def _slices(lo: Sequence[int], hi: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))


# ---------------------------------------------------------------------------------------------
# per op: what each shard reads and writes
# ---------------------------------------------------------------------------------------------


@dataclass
class OpExec:
    """One op ready to run shard by shard: kernel, params, signature and the boxes of each shard."""

    name: str
    kernel: Any
    params: Mapping[str, Any]
    sig: Any
    ports: dict[str, str]                       # port -> tensor
    in_boxes: dict[str, tuple[np.ndarray, np.ndarray]]    # unclipped (padding reads zeros)
    in_clipped: dict[str, tuple[np.ndarray, np.ndarray]]  # the cells that must be valid
    out_lo: np.ndarray
    out_hi: np.ndarray
    device: np.ndarray
    output: str
    lo: np.ndarray                              # the shards' index boxes
    hi: np.ndarray

    @property
    def n(self) -> int:
        return len(self.device)


def prepare_ops(g: Graph) -> dict[str, OpExec]:
    out = {}
    for name in g.topo_order:
        o = g.ops[name]
        sig = g.signature(o)
        k = get_kernel(o.kernel)
        params = o.params if o.kernel == "fused" else k.check_params(o.params)
        sh = o.shards
        ports = dict(o.inputs)
        in_boxes, clipped = {}, {}
        for port in sig.inputs:
            lo, hi = project_boxes(sig.inputs[port], sh.lo, sh.hi)
            shape = np.array(g.tensors[ports[port]].shape, np.int64)
            clo = np.clip(lo, 0, shape)
            in_boxes[port] = (lo, hi)
            clipped[port] = (clo, np.clip(hi, clo, shape))
        out_lo, out_hi = project_boxes(sig.output, sh.lo, sh.hi)
        out[name] = OpExec(name, k, params, sig, ports, in_boxes, clipped, out_lo, out_hi, sh.device, o.output, sh.lo,
                           sh.hi)
    return out


# ---------------------------------------------------------------------------------------------
# one plan device's memory
# ---------------------------------------------------------------------------------------------


class DeviceMemory:
    """The buffers of one plan device: full-shape arrays (on its GPU, or the host) and masks."""

    def __init__(self, xp: Any, device: int, gpu: int | None, specs: Mapping[str, tuple[tuple[int, ...], str]]):
        self.xp, self.device, self.gpu, self.specs = xp, device, gpu, specs
        self.buffers: dict[str, Any] = {}
        self.masks: dict[str, np.ndarray] = {}

    def ctx(self) -> Any:
        return self.xp.cuda.Device(self.gpu) if self.gpu is not None else contextlib.nullcontext()

    def buffer(self, t: str) -> Any:
        b = self.buffers.get(t)
        if b is None:
            shape, dtype = self.specs[t]
            with self.ctx():
                b = self.buffers[t] = self.xp.zeros(shape, dtype=exec_dtype(self.xp, dtype))
        return b

    def mask(self, t: str) -> np.ndarray:
        m = self.masks.get(t)
        if m is None:
            m = self.masks[t] = np.zeros(self.specs[t][0], dtype=bool)
        return m

    def reset(self) -> None:
        for m in self.masks.values():
            m[...] = False

    def missing(self, t: str, lo: Sequence[int], hi: Sequence[int]) -> Box | None:
        """The bounding box of the cells of ``[lo, hi)`` not valid here, or ``None``."""
        if any(b <= a for a, b in zip(lo, hi)):
            return None
        sub = self.mask(t)[_slices(lo, hi)]
        if sub.all():
            return None
        idx = np.nonzero(~sub)
        mlo = tuple(int(a) + int(i.min()) for a, i in zip(lo, idx))
        mhi = tuple(int(a) + int(i.max()) + 1 for a, i in zip(lo, idx))
        return mlo, mhi

    def mark(self, t: str, lo: Sequence[int], hi: Sequence[int]) -> None:
        self.mask(t)[_slices(lo, hi)] = True

    def write(self, t: str, lo: Sequence[int], hi: Sequence[int], block: Any, check: bool = True) -> None:
        self.buffer(t)[_slices(lo, hi)] = block
        if check:
            self.mark(t, lo, hi)


def compute_shard(xp: Any, op: OpExec, i: int, mem: DeviceMemory, check: bool = True) -> None:
    """Run shard ``i`` of ``op`` on ``mem``'s device: read its input boxes there (after checking
    that every cell is valid when ``check``), compute, write its output box there."""
    if check:
        for port, (clo, chi) in op.in_clipped.items():
            t = op.ports[port]
            miss = mem.missing(t, clo[i], chi[i])
            if miss is not None:
                raise IncompleteCommunication(op.name, i, mem.device, t, miss)
    blocks = {port: read_box(xp, mem.buffer(op.ports[port]), lo[i], hi[i]) for port, (lo, hi) in op.in_boxes.items()}
    y = op.kernel.run(xp, blocks, op.params, ZRange(op.lo[i], op.hi[i]), op.sig)
    want = tuple(int(b - a) for a, b in zip(op.out_lo[i], op.out_hi[i]))
    if tuple(y.shape) != want:
        raise ValueError(f"op {op.name} shard {i}: the kernel returned a block of shape {tuple(y.shape)}, its "
                         f"output box has shape {want}")
    mem.write(op.output, op.out_lo[i], op.out_hi[i], y, check)


# ---------------------------------------------------------------------------------------------
# clocks: perf_counter on CPU, CUDA events on GPU (resolved after one synchronisation)
# ---------------------------------------------------------------------------------------------


class _CpuClock:
    def start(self, gpu: int | None) -> float:
        return time.perf_counter()

    def stop(self, token: float, gpu: int | None) -> Callable[[], float]:
        dt = time.perf_counter() - token
        return lambda: dt

    def sync(self) -> None:
        pass


class _GpuClock:
    """Events recorded on the current stream of the shard's (or transfer's) GPU."""

    def __init__(self, xp: Any, gpus: Iterable[int]) -> None:
        self.xp, self.gpus = xp, sorted(set(gpus))

    def start(self, gpu: int) -> Any:
        with self.xp.cuda.Device(gpu):
            ev = self.xp.cuda.Event()
            ev.record()
        return ev

    def stop(self, token: Any, gpu: int) -> Callable[[], float]:
        with self.xp.cuda.Device(gpu):
            end = self.xp.cuda.Event()
            end.record()
        xp = self.xp

        def elapsed() -> float:
            end.synchronize()
            return xp.cuda.get_elapsed_time(token, end) / 1e3  # ms -> s

        return elapsed

    def sync(self) -> None:
        for gpu in self.gpus:
            with self.xp.cuda.Device(gpu):
                self.xp.cuda.Device(gpu).synchronize()


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


@dataclass
class DeviceRunResult:
    """Outputs (host NumPy arrays, assembled from the devices that produced them) and, with
    timing, medians: ``shards`` (``op``, ``shard``, ``device``, ``gpu``, ``seconds``), ``transfers``
    (``index``, ``tensor``, ``producer``, ``shard``, ``src``, ``dst``, ``cells``, ``bytes``,
    ``seconds``) and ``plan_seconds``; ``samples`` in each shard and transfer: its time in every
    timed run."""

    outputs: dict[str, np.ndarray]
    backend: str
    device_map: dict[int, int | None]
    shards: list[dict[str, Any]] = field(default_factory=list)
    transfers: list[dict[str, Any]] = field(default_factory=list)
    plan_seconds: float | None = None
    repeats: int = 0
    #: median over the timed runs of (run time - its shards and transfers): the executor's own time
    #: between them, which a plan time robust to other processes' time slices adds back
    gap_seconds: float | None = None


def _device_map(xp: Any, backend: str, devices: Iterable[int], device_map: Any) -> dict[int, int | None]:
    devices = sorted(set(int(d) for d in devices))
    if backend != "cupy":
        return {d: None for d in devices}
    n_gpus = int(xp.cuda.runtime.getDeviceCount())
    out: dict[int, int | None] = {}
    for d in devices:
        if device_map is None:
            gpu = d % n_gpus
        elif callable(device_map):
            gpu = device_map(d)
        elif isinstance(device_map, Mapping):
            gpu = device_map.get(d, d % n_gpus)
        else:
            gpu = list(device_map)[d]
        gpu = int(gpu)
        if not 0 <= gpu < n_gpus:
            raise ValueError(f"device_map sends plan device {d} to GPU {gpu}, but this machine has GPUs 0..{n_gpus - 1}")
        out[d] = gpu
    return out


def _normalize_transfers(g: Graph, transfers: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_op: dict[str, list[dict[str, Any]]] = {}
    for index, tr in enumerate(transfers):
        producer, tensor = tr["producer"], tr["tensor"]
        if producer not in g.ops:
            raise ValueError(f"transfer {index} names producer op {producer!r}, which the plan does not have")
        if g.ops[producer].output != tensor:
            raise ValueError(f"transfer {index} moves tensor {tensor!r}, but op {producer!r} produces "
                             f"{g.ops[producer].output!r}")
        boxes = normalize_boxes(tr["boxes"])
        cells = sum(int(np.prod([max(0, b - a) for a, b in zip(lo, hi)])) for lo, hi in boxes)
        by_op.setdefault(producer, []).append({
            "index": index, "tensor": tensor, "producer": producer, "shard": int(tr.get("shard", -1)),
            "src": int(tr["src"]), "dst": int(tr["dst"]), "boxes": boxes, "cells": cells,
            "bytes": tr.get("bytes")})
    return by_op


def _normalize_state_transfers(g: Graph, state_transfers: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for index, tr in enumerate(state_transfers):
        t = tr["tensor"]
        if t not in g.carried:
            raise ValueError(f"state transfer {index} moves tensor {t!r}, which is not loop-carried state of the plan")
        boxes = normalize_boxes(tr["boxes"])
        cells = sum(int(np.prod([max(0, b - a) for a, b in zip(lo, hi)])) for lo, hi in boxes)
        out.append({"index": index, "tensor": t, "producer": tr.get("producer", g.producers[g.carried[t]]),
                    "shard": int(tr.get("shard", -1)), "src": int(tr["src"]), "dst": int(tr["dst"]),
                    "boxes": boxes, "cells": cells, "bytes": tr.get("bytes"), "state": True})
    return out


def run_on_devices(g: Graph, transfers: Iterable[Mapping[str, Any]], residency: Iterable[Mapping[str, Any]],
                   backend: str = "numpy", device_map: Any = None, timing: bool = False, repeats: int = 3,
                   warmup: int = 1, inputs: Mapping[str, Any] | None = None, seed: int = 0,
                   state_transfers: Iterable[Mapping[str, Any]] = ()) -> DeviceRunResult:
    """Run ``g`` with one buffer set per plan device, moving only the given boxes.

    ``transfers``: dicts ``{tensor, producer, shard, src, dst, boxes}``; ``residency``: dicts
    ``{tensor, device, boxes}``; boxes are ``(lo, hi)`` pairs (see the module docstring).
    ``state_transfers``: reads of loop-carried state away from its home (FSDP's gathers, as
    ``TransferPlan.state_transfers`` lists them), moved before the first op of every run.
    ``inputs``: host arrays of the graph inputs (default: ``random_inputs(g, seed)``).
    ``device_map``: plan device -> GPU (a dict, a list or a function; CuPy only).
    Raises :class:`IncompleteCommunication` when a shard or transfer reads a cell that is not
    valid on its device.
    """
    xp = get_backend(backend)
    ops = prepare_ops(g)
    by_op = _normalize_transfers(g, transfers)
    gathers = _normalize_state_transfers(g, state_transfers)
    res = [{"tensor": r["tensor"], "device": int(r["device"]), "boxes": normalize_boxes(r["boxes"])}
           for r in residency]
    for r in res:
        if r["tensor"] not in g.tensors:
            raise ValueError(f"residency names tensor {r['tensor']!r}, which the plan does not have")
    host = dict(random_inputs(g, seed) if inputs is None else inputs)
    devices = set(g.devices) | {r["device"] for r in res} | {t["dst"] for ts in by_op.values() for t in ts} | {
        t["src"] for ts in by_op.values() for t in ts} | {t["src"] for t in gathers} | {t["dst"] for t in gathers}
    gpu_of = _device_map(xp, backend, devices, device_map)
    specs = {n: (t.shape, t.dtype) for n, t in g.tensors.items()}
    mems = {d: DeviceMemory(xp, d, gpu_of[d], specs) for d in sorted(devices)}
    clock: Any = _GpuClock(xp, [v for v in gpu_of.values() if v is not None]) if backend == "cupy" else _CpuClock()

    def load_residency() -> None:
        for r in res:
            t = r["tensor"]
            if t not in host:
                raise ValueError(f"residency puts tensor {t!r} on device {r['device']}, but no input array for it "
                                 f"was given")
            mem = mems[r["device"]]
            src = np.asarray(host[t])
            for lo, hi in r["boxes"]:
                sl = _slices(lo, hi)
                with mem.ctx():
                    mem.write(t, lo, hi, xp.asarray(src[sl]))

    def move(tr: dict[str, Any], check: bool) -> Callable[[], float] | None:
        src, dst = mems[tr["src"]], mems[tr["dst"]]
        t = tr["tensor"]
        if check:
            for lo, hi in tr["boxes"]:
                miss = src.missing(t, lo, hi)
                if miss is not None:
                    raise IncompleteCommunication(tr["producer"], tr["shard"], tr["src"], t, miss, reader="transfer")
        sbuf, dbuf = src.buffer(t), dst.buffer(t)
        if src.gpu is None or src.gpu == dst.gpu:  # host, or plan devices sharing one GPU
            with dst.ctx():
                tok = clock.start(dst.gpu)
                for lo, hi in tr["boxes"]:
                    sl = _slices(lo, hi)
                    dbuf[sl] = sbuf[sl]
                done = clock.stop(tok, dst.gpu)
        else:  # two GPUs: gather on the source, then a peer copy and scatter on the destination
            with src.ctx():
                tok = clock.start(src.gpu)
                blocks = [xp.ascontiguousarray(sbuf[_slices(lo, hi)]) for lo, hi in tr["boxes"]]
                gather = clock.stop(tok, src.gpu)
                xp.cuda.get_current_stream().synchronize()
            with dst.ctx():
                tok = clock.start(dst.gpu)
                for (lo, hi), blk in zip(tr["boxes"], blocks):
                    dbuf[_slices(lo, hi)] = xp.copy(blk)  # cupy.copy: onto the current device, peer to peer
                scatter = clock.stop(tok, dst.gpu)
            done = lambda: gather() + scatter()  # noqa: E731
        if check:
            for lo, hi in tr["boxes"]:
                dst.mark(t, lo, hi)
        return done

    def one_run(check: bool) -> tuple[list, list, float]:
        if check:
            for m in mems.values():
                m.reset()
            load_residency()
        clock.sync()
        t0 = time.perf_counter()
        shard_t, transfer_t = [], []
        for tr in gathers:  # the state is at home when the step starts; its gathers come first
            transfer_t.append(move(tr, check))
        for name in g.topo_order:
            op = ops[name]
            for i in range(op.n):
                mem = mems[int(op.device[i])]
                mem.buffer(op.output)  # allocation is not part of the shard
                with mem.ctx():
                    tok = clock.start(mem.gpu)
                    compute_shard(xp, op, i, mem, check)
                    shard_t.append(clock.stop(tok, mem.gpu))
            for tr in by_op.get(name, ()):
                transfer_t.append(move(tr, check))
        clock.sync()
        return shard_t, transfer_t, time.perf_counter() - t0

    one_run(True)
    outputs = {}
    for name, t in g.tensors.items():
        if t.role != "output" or name not in g.producers:
            continue
        op = ops[g.producers[name]]
        arr = np.zeros(t.shape, dtype=np.float32 if t.dtype == "bfloat16" else t.dtype)
        for i in range(op.n):
            mem = mems[int(op.device[i])]
            sl = _slices(op.out_lo[i], op.out_hi[i])
            arr[sl] = to_numpy(mem.buffer(name)[sl])
        outputs[name] = arr
    result = DeviceRunResult(outputs, backend, gpu_of)
    if not timing:
        return result
    for _ in range(max(0, warmup)):
        one_run(False)
    runs = [one_run(False) for _ in range(max(1, repeats))]
    shard_s = [[f() for f in r[0]] for r in runs]
    transfer_s = [[f() for f in r[1]] for r in runs]
    k = 0
    for name in g.topo_order:
        op = ops[name]
        for i in range(op.n):
            d = int(op.device[i])
            result.shards.append({"op": name, "shard": i, "device": d, "gpu": gpu_of[d],
                                  "seconds": statistics.median(s[k] for s in shard_s),
                                  "samples": [s[k] for s in shard_s]})
            k += 1
    k = 0
    for tr in gathers + [tr for name in g.topo_order for tr in by_op.get(name, ())]:
        result.transfers.append({key: tr[key] for key in ("index", "tensor", "producer", "shard", "src", "dst",
                                                          "cells", "bytes")}
                                | {"state": tr.get("state", False),
                                   "seconds": statistics.median(s[k] for s in transfer_s),
                                   "samples": [s[k] for s in transfer_s]})
        k += 1
    result.plan_seconds = statistics.median(r[2] for r in runs)
    result.gap_seconds = statistics.median(r[2] - sum(s) - sum(t) for r, s, t in zip(runs, shard_s, transfer_s))
    result.repeats = len(runs)
    return result


def device_name(backend: str, gpu: int | None = None) -> str:
    """A readable name of the device a backend runs on (the GPU's name, or the host CPU's)."""
    if backend == "cupy":
        xp = get_backend("cupy")
        gpu = xp.cuda.Device().id if gpu is None else gpu
        name = xp.cuda.runtime.getDeviceProperties(gpu)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    import platform

    cpu = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {cpu}"
