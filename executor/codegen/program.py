"""Generate a standalone Python program that runs a plan: one process per plan device.

``generate_program(g, transfers, residency, order)`` returns the program's source text:

- one function per device step, named after the op and shard (``fc1__s0``), which reads its
  input boxes from that device's buffers, runs the kernel's block function on its index box, and
  writes its output box;
- one function per device (``device_0``, ...) that calls its steps in ``order`` (the simulated
  schedule's order when the caller has one; else the plan's topological order), *sends* each
  transfer right after the step that produced it and *receives* it at the same point of one
  global order of all steps (a topological order of the steps under each device's order and
  the transfers' producer-to-first-reader edges). Every device posts its sends and receives in
  that one order, so even blocking, in-order point-to-point links (NCCL's, which ignore tags)
  cannot deadlock or mismatch: the globally first unfinished transfer always has both of its
  ends waiting at it;
- the transfers are exactly the given ones (``costmodel.transfers.transfer_plan``: per producer
  shard and destination, disjoint boxes), the residency says which input boxes each device holds
  before the run: nothing else moves, and a step reading a cell nobody brought raises;
- a training step's loop-carried state starts at its home (residency) and its reads elsewhere
  (``state_transfers``, FSDP's gathers) are sent as each device starts;
- ``main`` starts one process per device (``multiprocessing``, spawn), collects the output boxes,
  and with ``--check`` compares them with the unsharded program run by tapestry's executor.

The plan reaches the generator as plain data (``executor`` never imports ``costmodel``). Kernels'
block functions come from ``ir.kernels`` (the same code the executor and the farm verify), so the
program needs the ``tapestry`` package installed, not the farm. Backends (``--backend``):

- ``numpy`` (default): processes on the host, transfers through ``multiprocessing`` queues;
- ``cupy``: device ``d`` on GPU ``d % n_gpus``, transfers staged through host memory;
- ``torch``: transfers by ``torch.distributed`` point-to-point ``isend``/``recv`` of each
  transfer's boxes packed into one byte tensor, one rank per plan device: gloo with NumPy compute
  on the host, or NCCL with CuPy compute when CUDA has a GPU per plan device (or
  ``--dist nccl``). Rank ``r`` is the ``r``-th plan device in ascending order.
"""

from __future__ import annotations

import json
import keyword
import re
from typing import Any, Iterable, Mapping, Sequence

from executor.device_run import normalize_boxes, prepare_ops
from ir.graph import Graph
from ir.serialize import dumps

Box = tuple[tuple[int, ...], tuple[int, ...]]


class CodegenError(ValueError):
    """The plan or its transfer plan cannot be turned into a program (the message says why)."""


def _ident(text: str, used: set[str]) -> str:
    base = re.sub(r"\W", "_", text)
    if not base or base[0].isdigit() or keyword.iskeyword(base):
        base = "op_" + base
    name, k = base, 1
    while name in used:
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    return name


def _tup(a: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


def _box_text(lo: Sequence[int], hi: Sequence[int]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi)) + "]"


def _intersects(a: Box, lo: Sequence[int], hi: Sequence[int]) -> bool:
    return all(max(x, y) < min(u, v) for x, y, u, v in zip(a[0], lo, a[1], hi))


def default_order(g: Graph) -> dict[int, list[tuple[str, int]]]:
    """Each device's shards in the plan's topological order (op order, then shard index)."""
    out: dict[int, list[tuple[str, int]]] = {}
    for name in g.topo_order:
        for i, d in enumerate(g.ops[name].shards.device.tolist()):
            out.setdefault(int(d), []).append((name, i))
    return out


def generate_program(g: Graph, transfers: Iterable[Mapping[str, Any]], residency: Iterable[Mapping[str, Any]],
                     order: Mapping[int, Sequence[tuple[str, int]]] | None = None, title: str = "",
                     state_transfers: Iterable[Mapping[str, Any]] = (), program: Graph | None = None) -> str:
    """The source of a program that runs plan ``g`` with exactly ``transfers`` (see the module
    docstring). ``order``: per device, its ``(op, shard)`` steps in the order to run them.
    ``state_transfers`` (a training step's reads of loop-carried state away from its home, whose
    homes are in ``residency``) are sent when each device starts and received before their first
    reader, like any transfer. ``program``: the program the plan derives from, embedded for
    ``--check`` (without it, ``--check`` compares with the plan's own unsharded form, which shows
    the sharding consistent, not the program computed)."""
    ops = prepare_ops(g)
    order = {int(d): [(str(o), int(i)) for o, i in steps] for d, steps in (order or default_order(g)).items()}
    seen = {(o, i) for steps in order.values() for o, i in steps}
    want = {(n, i) for n in g.ops for i in range(len(g.ops[n].shards))}
    if seen != want:
        missing = sorted(want - seen)[:3]
        raise CodegenError(f"the step order must list every shard once; missing {missing}")
    for d, steps in order.items():
        for o, i in steps:
            if int(ops[o].device[i]) != d:
                raise CodegenError(f"the step order runs {o} shard {i} on device {d}, the plan on {ops[o].device[i]}")
    transfers = [dict(t, boxes=normalize_boxes(t["boxes"]), index=k) for k, t in enumerate(transfers)]
    states = [dict(t, boxes=normalize_boxes(t["boxes"]), index=len(transfers) + k)
              for k, t in enumerate(state_transfers)]
    for t in states:
        if t["tensor"] not in g.carried:
            raise CodegenError(f"state transfer {t['index']} moves {t['tensor']!r}, which is no loop-carried state")
    residency = [dict(r, boxes=normalize_boxes(r["boxes"])) for r in residency]
    devices = sorted(set(order) | {t["src"] for t in transfers + states} | {t["dst"] for t in transfers + states}
                     | {int(r["device"]) for r in residency})

    # where each transfer is sent (after its producer shard) and received (before its first reader)
    send_after: dict[tuple[str, int], list[dict]] = {}
    for t in transfers:
        if g.ops.get(t["producer"]) is None or g.ops[t["producer"]].output != t["tensor"]:
            raise CodegenError(f"transfer {t['index']} names producer {t['producer']!r} of tensor {t['tensor']!r}, "
                               f"which the plan does not have")
        send_after.setdefault((t["producer"], int(t["shard"])), []).append(t)
    first_reader: dict[int, tuple[str, int]] = {}
    for t in transfers + states:
        first = None
        for o, i in order.get(int(t["dst"]), []):
            op = ops[o]
            for port, (clo, chi) in op.in_clipped.items():
                if op.ports[port] == t["tensor"] and any(_intersects(b, clo[i], chi[i]) for b in t["boxes"]):
                    first = (o, i)
                    break
            if first:
                break
        if first is None:
            raise CodegenError(f"transfer {t['index']} ({t['tensor']} to device {t['dst']}) has no reader there")
        first_reader[t["index"]] = first
    steps_in_order = global_order(order, [((t["producer"], int(t["shard"])), first_reader[t["index"]])
                                          for t in transfers])

    used: set[str] = {"main", "Device", "run_device", "np", "json", "argparse", "os", "sys", "mp", "time"}
    step_fn = {key: _ident(f"{key[0]}__s{key[1]}", used) for key in sorted(want)}
    lines = [_HEADER.format(title=title or f"plan {g.digest[:12]}", n_dev=len(devices), n_shards=g.n_shards,
                            n_transfers=len(transfers) + len(states))]
    lines.append(f"PLAN = json.loads(r'''{dumps(g, indent=None)}''')\n")
    prog = f"json.loads(r'''{dumps(program, indent=None)}''')" if program is not None else "None"
    lines.append(f"PROGRAM = {prog}  # the program the plan derives from (--check compares with it)\n")
    res = {d: [] for d in devices}
    for r in residency:
        res[int(r["device"])].append((r["tensor"], [[list(lo), list(hi)] for lo, hi in r["boxes"]]))
    lines.append(f"RESIDENCY = {json.dumps({str(d): v for d, v in res.items()})}\n")
    lines.append(f"OUTPUTS = {json.dumps([n for n, t in g.tensors.items() if t.role == 'output'])}\n")
    lines.append(f"DEVICES = {devices}\n\n")
    lines.append("# ---- device steps: one function per shard -------------------------------------------\n")
    for name in g.topo_order:
        op = ops[name]
        kern = g.ops[name].kernel
        for i in range(op.n):
            lo, hi = _tup(op.lo[i]), _tup(op.hi[i])
            reads = "".join(f"        {port!r}: dev.read({op.ports[port]!r}, {_tup(l[i])}, {_tup(h[i])}),\n"
                            for port, (l, h) in op.in_boxes.items())
            lines.append(f"def {step_fn[(name, i)]}(dev):\n"
                         f'    """{name} ({kern}) shard {i} on device {int(op.device[i])}: index box '
                         f'{_box_text(lo, hi)}."""\n'
                         f"    blocks = {{\n{reads}    }}\n"
                         f"    y = dev.run({name!r}, blocks, {lo}, {hi})\n"
                         f"    dev.write({op.output!r}, {_tup(op.out_lo[i])}, {_tup(op.out_hi[i])}, y)\n\n\n")
    lines.append("# ---- devices: steps in schedule order, with their sends and receives --------------------\n")
    device_of = {key: d for d, steps in order.items() for key in steps}
    for d in devices:
        body = []
        for t in states:  # first in the global order, as each device starts
            if int(t["src"]) == d:
                body.append(f"    dev.send({t['index']}, {t['dst']}, {t['tensor']!r}, {_boxes_text(t['boxes'])})"
                            f"  # state transfer {t['index']}: from its home")
            if int(t["dst"]) == d:
                body.append(f"    dev.recv({t['index']}, {t['src']}, {t['tensor']!r}, {_boxes_text(t['boxes'])})"
                            f"  # state transfer {t['index']}, read by {first_reader[t['index']][0]}")
        for key in steps_in_order:
            if device_of[key] == d:
                body.append(f"    {step_fn[key]}(dev)")
            for t in send_after.get(key, []):
                if int(t["src"]) == d:
                    body.append(f"    dev.send({t['index']}, {t['dst']}, {t['tensor']!r}, "
                                f"{_boxes_text(t['boxes'])})  # transfer {t['index']}")
                if int(t["dst"]) == d:
                    body.append(f"    dev.recv({t['index']}, {t['src']}, {t['tensor']!r}, "
                                f"{_boxes_text(t['boxes'])})  # transfer {t['index']}, read by "
                                f"{first_reader[t['index']][0]}")
        n_steps = len(order.get(d, []))
        lines.append(f"def device_{d}(dev):\n    \"\"\"Device {d}: {n_steps} steps.\"\"\"\n"
                     + ("\n".join(body) if body else "    pass") + "\n\n\n")
    lines.append(f"STEPS = {{{', '.join(f'{d}: device_{d}' for d in devices)}}}\n")
    lines.append(_RUNTIME)
    return "".join(lines)


def global_order(order: Mapping[int, Sequence[tuple[str, int]]],
                 edges: Iterable[tuple[tuple[str, int], tuple[str, int]]]) -> list[tuple[str, int]]:
    """One order of all steps that keeps each device's ``order`` and puts every ``(a, b)`` edge's
    ``a`` (a transfer's producer shard) before ``b`` (its first reader on the destination).

    Kahn's algorithm, taking the ready step earliest in its device's order (then the lowest
    device) first, so that the result interleaves the devices as a schedule would. Raises
    ``CodegenError`` when the device orders and the transfers form a cycle (no schedule runs
    them: some device would wait for a step that waits for it)."""
    import heapq

    pos = {key: (k, d) for d, steps in order.items() for k, key in enumerate(steps)}
    succ: dict[tuple[str, int], list[tuple[str, int]]] = {key: [] for key in pos}
    indeg = dict.fromkeys(pos, 0)
    for d, steps in order.items():
        for a, b in zip(steps, steps[1:]):
            succ[a].append(b)
            indeg[b] += 1
    for a, b in edges:
        if a != b and pos[a][1] != pos[b][1]:  # same-device edges are already in the device order
            succ[a].append(b)
            indeg[b] += 1
    ready = [(pos[k], k) for k, n in indeg.items() if n == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, key = heapq.heappop(ready)
        out.append(key)
        for b in succ[key]:
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(ready, (pos[b], b))
    if len(out) != len(pos):
        stuck = sorted(k for k, n in indeg.items() if n > 0)[:3]
        raise CodegenError(f"the devices' step orders and the transfers form a cycle (no schedule runs them); "
                           f"steps that can never start include {stuck}")
    return out


def _boxes_text(boxes: list[Box]) -> str:
    return "[" + ", ".join(f"({list(lo)}, {list(hi)})" for lo, hi in boxes) + "]"


_HEADER = '''#!/usr/bin/env python3
"""{title}: {n_dev} devices, {n_shards} shards, {n_transfers} transfers. Generated by `tapestry codegen`.

Run:  python THIS_FILE.py [--check] [--values program.npz] [--seed 0] [--backend numpy|cupy|torch]

Each plan device is one process. ``device_<d>`` runs that device's steps in the schedule's order;
each step (``<op>__s<k>``) computes one shard: it reads its input boxes from the device's own
buffers, runs the kernel's block function and writes its output box. ``dev.send`` and ``dev.recv``
move exactly the plan's transfer boxes between processes (``--backend torch``: by
torch.distributed, gloo on the host or NCCL between GPUs); a read of a cell that no step,
transfer or resident input put on the device raises. ``--check`` compares the outputs with the
program the plan derives from (embedded below; tapestry's executor runs it). Needs the ``tapestry`` package (for the kernels' block
functions).
"""

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time

import numpy as np

'''

_RUNTIME = r'''

# ---- runtime --------------------------------------------------------------------------------

class Device:
    """One plan device: full-shape buffers, a validity mask per tensor, and its link."""

    def __init__(self, d, xp, link):
        from ir.kernels import TensorSpec, get_kernel
        from ir.zspace import ZRange

        self.d, self.xp, self.link = d, xp, link
        self.specs = {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in PLAN["tensors"]}
        self.ops = {o["name"]: o for o in PLAN["ops"]}
        self.buf, self.valid, self.pending = {}, {}, {}
        self._k, self._spec, self._zr = get_kernel, TensorSpec, ZRange
        self._sigs = {}

    def _buffer(self, t):
        if t not in self.buf:
            shape, dtype = self.specs[t]
            dt = "float32" if dtype == "bfloat16" else dtype
            self.buf[t] = self.xp.zeros(shape, dtype=dt)
            self.valid[t] = np.zeros(shape, dtype=bool)
        return self.buf[t]

    def write(self, t, lo, hi, block):
        sl = tuple(slice(a, b) for a, b in zip(lo, hi))
        self._buffer(t)[sl] = block
        self.valid[t][sl] = True

    def read(self, t, lo, hi):
        """The box [lo, hi) of tensor t (zeros beyond its edges: conv and pooling halos)."""
        buf = self._buffer(t)
        shape = buf.shape
        clo = [min(max(a, 0), n) for a, n in zip(lo, shape)]
        chi = [max(min(b, n), c) for b, n, c in zip(hi, shape, clo)]
        sl = tuple(slice(a, b) for a, b in zip(clo, chi))
        if not self.valid[t][sl].all():
            raise RuntimeError(f"device {self.d} reads {t}{[f'{a}:{b}' for a, b in zip(clo, chi)]}, which is "
                               f"not on this device (a missing transfer)")
        block = buf[sl]
        pad = [(a - l, h - b) for l, a, b, h in zip(lo, clo, chi, hi)]
        return self.xp.pad(block, pad) if any(p != (0, 0) for p in pad) else block

    def run(self, op, blocks, lo, hi):
        o = self.ops[op]
        k = self._k(o["kernel"])
        sig = self._sigs.get(op)
        if sig is None:
            specs = {p: self._spec(*self.specs[t]) for p, t in o["inputs"].items()}
            sig = self._sigs[op] = k.signature(specs, o["params"])
        params = o["params"] if o["kernel"] == "fused" else k.check_params(o["params"])
        return k.run(self.xp, blocks, params, self._zr(lo, hi), sig)

    def send(self, index, dst, t, boxes):
        for lo, hi in boxes:
            sl = tuple(slice(a, b) for a, b in zip(lo, hi))
            if not self.valid[t][sl].all():
                raise RuntimeError(f"device {self.d} sends transfer {index} of {t}, but part of it is not here")
        self.link.send(index, dst, [self.buf[t][tuple(slice(a, b) for a, b in zip(lo, hi))] for lo, hi in boxes])

    def recv(self, index, src, t, boxes):
        self._buffer(t)
        shapes = [tuple(b - a for a, b in zip(lo, hi)) for lo, hi in boxes]
        for (lo, hi), block in zip(boxes, self.link.recv(index, src, shapes, self.buf[t].dtype)):
            self.write(t, lo, hi, block)

    def _host(self, a):
        return a.get() if hasattr(a, "get") else np.ascontiguousarray(a)


class QueueLink:
    """Transfers through multiprocessing queues (host memory): sends never block."""

    def __init__(self, d, xp, inboxes):
        self.xp, self.inbox, self.outboxes, self.pending = xp, inboxes[d], inboxes, {}

    def send(self, index, dst, blocks):
        self.outboxes[dst].put((index, [b.get() if hasattr(b, "get") else np.ascontiguousarray(b) for b in blocks]))

    def recv(self, index, src, shapes, dtype):
        while index not in self.pending:
            k, blocks = self.inbox.get(timeout=600)
            self.pending[k] = blocks
        return [self.xp.asarray(b) for b in self.pending.pop(index)]

    def close(self):
        pass


class TorchLink:
    """Transfers by torch.distributed point-to-point: each transfer's boxes packed into one byte
    tensor, ``isend`` after its producer, ``recv`` at the same point of the global order (so
    NCCL, which matches a pair's messages in posting order and ignores tags, pairs them right).
    gloo moves host tensors (NumPy compute), NCCL moves CUDA tensors (CuPy compute, zero-copy
    through DLPack)."""

    def __init__(self, d, xp, dist_backend, port):
        import datetime

        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.xp, self.nccl = torch, dist, xp, dist_backend == "nccl"
        self.rank = {dev: r for r, dev in enumerate(DEVICES)}
        if self.nccl:
            torch.cuda.set_device(xp.cuda.Device().id)
        dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=self.rank[d],
                                world_size=len(DEVICES), timeout=datetime.timedelta(seconds=600))
        self.in_flight = []  # (work, tensor): a send's tensor must live until it completes

    def send(self, index, dst, blocks):
        xp = self.xp
        flat = xp.concatenate([xp.ascontiguousarray(b).reshape(-1).view(xp.uint8) for b in blocks])
        if self.nccl:
            xp.cuda.Stream.null.synchronize()  # the blocks are computed before NCCL's stream reads them
            tensor = self.torch.from_dlpack(flat)
        else:
            tensor = self.torch.from_numpy(flat)
        self.in_flight.append((self.dist.isend(tensor, dst=self.rank[dst], tag=index), tensor))

    def recv(self, index, src, shapes, dtype):
        sizes = [int(np.prod(s)) * np.dtype(dtype).itemsize for s in shapes]
        tensor = self.torch.empty(sum(sizes), dtype=self.torch.uint8, device="cuda" if self.nccl else "cpu")
        self.dist.recv(tensor, src=self.rank[src], tag=index)
        if self.nccl:
            self.torch.cuda.synchronize()
            flat = self.xp.from_dlpack(tensor)
        else:
            flat = tensor.numpy()
        blocks, at = [], 0
        for shape, n in zip(shapes, sizes):
            blocks.append(flat[at:at + n].view(dtype).reshape(shape))
            at += n
        return blocks

    def close(self):
        for work, _ in self.in_flight:
            work.wait()
        self.dist.barrier()
        self.dist.destroy_process_group()


def run_device(d, backend, dist_backend, port, host_inputs, inboxes, results):
    try:
        if backend == "cupy" or dist_backend == "nccl":
            import cupy as xp
            xp.cuda.Device(d % xp.cuda.runtime.getDeviceCount()).use()
        else:
            xp = np
        link = TorchLink(d, xp, dist_backend, port) if backend == "torch" else QueueLink(d, xp, inboxes)
        dev = Device(d, xp, link)
        for t, boxes in RESIDENCY.get(str(d), []):
            for lo, hi in boxes:
                sl = tuple(slice(a, b) for a, b in zip(lo, hi))
                dev.write(t, lo, hi, xp.asarray(host_inputs[t][sl]))
        t0 = time.perf_counter()
        STEPS[d](dev)
        link.close()
        seconds = time.perf_counter() - t0
        written = {t: dev._host(dev.buf[t]) for t in OUTPUTS if t in dev.buf}
        masks = {t: dev.valid[t] for t in written}
        results.put((d, None, written, masks, seconds))
    except BaseException as e:  # report to the parent instead of dying silently
        import traceback
        results.put((d, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", {}, {}, 0.0))


def host_inputs(seed, values_file):
    """Seeded random inputs per tensor name (tapestry's executor.run.random_inputs), then the
    parameter values of an imported program where given."""
    from executor.run import random_inputs
    from ir.serialize import from_json

    g = from_json(PLAN, "generated plan")
    inputs = random_inputs(g, seed)
    if values_file:
        with np.load(values_file) as z:
            inputs.update({k: z[k] for k in z.files if k in inputs})
    return g, inputs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the unsharded program")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--values", default=None, help=".npz of parameter values (tapestry import writes one)")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "cupy", "torch"],
                    help="numpy: host processes and queues; cupy: GPUs, transfers through the host; "
                         "torch: torch.distributed send/recv (gloo on the host, NCCL between GPUs)")
    ap.add_argument("--dist", default="auto", choices=["auto", "gloo", "nccl"],
                    help="torch.distributed backend for --backend torch (auto: NCCL when CUDA has a GPU "
                         "per plan device, else gloo)")
    ap.add_argument("--out", default=None, help="write the outputs to this .npz")
    args = ap.parse_args(argv)
    dist_backend, port = None, None
    if args.backend == "torch":
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            sys.stderr.write("--backend torch needs PyTorch (pip install 'tapestry[torch]'); "
                             "use --backend numpy without it\n")
            return 2
        dist_backend = args.dist
        if dist_backend == "auto":
            dist_backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= len(DEVICES) else "gloo"
        if not (dist.is_available() and (dist.is_gloo_available() if dist_backend == "gloo"
                                         else dist.is_nccl_available())):
            sys.stderr.write(f"--dist {dist_backend}: this PyTorch build has no {dist_backend} backend\n")
            return 2
        with socket.socket() as s:  # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        print(f"torch.distributed: {dist_backend}, {len(DEVICES)} ranks")
    if args.values and not os.path.isfile(args.values):
        sys.stderr.write(f"--values {args.values}: no such file (the .npz 'tapestry import' writes)\n")
        return 2
    if args.seed < 0:
        sys.stderr.write(f"--seed must be >= 0, got {args.seed}\n")
        return 2
    g, inputs = host_inputs(args.seed, args.values)
    ctx = mp.get_context("spawn")
    inboxes = {d: ctx.Queue() for d in DEVICES} if args.backend != "torch" else {}
    results = ctx.Queue()
    procs = [ctx.Process(target=run_device, args=(d, args.backend, dist_backend, port, inputs, inboxes, results))
             for d in DEVICES]
    for p in procs:
        p.start()
    outputs = {t: np.zeros(g.tensors[t].shape, dtype=np.float32 if g.tensors[t].dtype == "bfloat16"
                           else g.tensors[t].dtype) for t in OUTPUTS}
    filled = {t: np.zeros(g.tensors[t].shape, dtype=bool) for t in OUTPUTS}
    failed = []
    for _ in DEVICES:
        d, err, written, masks, seconds = results.get(timeout=900)
        if err:  # the others may wait forever for its sends: stop them all
            failed.append(f"device {d}: {err}")
            for p in procs:
                p.terminate()
            break
        print(f"device {d}: {seconds * 1e3:.1f} ms")
        for t, arr in written.items():
            m = masks[t]
            outputs[t][m] = arr[m]
            filled[t] |= m
    for p in procs:
        p.join(timeout=60)
    if failed:
        sys.stderr.write("\n".join(failed) + "\n")
        return 1
    for t in OUTPUTS:
        if not filled[t].all():
            sys.stderr.write(f"output {t} was not fully computed by any device\n")
            return 1
    if args.out:
        np.savez(args.out, **outputs)
    if args.check:
        from executor.run import execute
        from executor.verify import TOLERANCE, interface_problems, rel_error
        from ir.rewrites import unshard
        from ir.serialize import from_json

        if PROGRAM is not None:
            program, what = from_json(PROGRAM, "embedded program"), "the program the plan derives from"
        else:
            program, what = unshard(g), "the plan's own unsharded form (no program embedded: the sharding, not the program)"
        problems = interface_problems(g, program)
        if problems:
            print(f"FAIL: the plan does not read and write the program's tensors: {'; '.join(problems)}")
            return 1
        ref = execute(program, inputs)
        worst = 0.0
        for t in OUTPUTS:
            err = rel_error(outputs[t], np.asarray(ref[t]))
            worst = max(worst, err)
            print(f"{t}: max relative error {err:.2e}")
        tol = max(TOLERANCE[g.tensors[t].dtype] for t in OUTPUTS)
        if worst <= tol:
            print(f"PASS: the outputs match {what} within {tol:.0e}")
        else:
            print(f"FAIL: max relative error {worst:.2e} > {tol:.0e} against {what}")
        return 0 if worst <= tol else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
