"""Objectives of a plan on a fleet: makespan, energy, peak memory, devices, bytes moved.

``Evaluator(hw)(g)`` lowers (incrementally, see ``costmodel.lowering``), simulates, and returns an
``Evaluation``. ``evaluate(g, hw)`` is the one-shot form. A lower bound on the makespan (the
larger of the whole fleet's roofline time for the program's total work and the critical path
with every op spread over the whole fleet) lets every report say how far a plan is from the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costmodel.energy import schedule_energy
from costmodel.hardware import Hardware, load_hardware
from costmodel.lowering import Lowered, Lowerer
from costmodel.simulate import Schedule, simulate_arrays
from ir.graph import SOURCE_ROLES, Graph
from ir.kernels import ITEMSIZE, get_kernel

OBJECTIVES = ("makespan", "energy", "peak_memory", "devices")


@dataclass
class Evaluation:
    makespan: float
    energy: float
    peak_memory: float
    devices: int
    bytes_moved: float
    feasible: bool
    lower_bound: float
    peak_memory_per_device: np.ndarray = field(repr=False)
    lowered: Lowered | None = field(default=None, repr=False)
    schedule: Schedule | None = field(default=None, repr=False)

    @property
    def gap(self) -> float:
        """Makespan over the lower bound (1.0 = at the limit)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else float("inf")

    def objectives(self) -> dict[str, float]:
        return {"makespan": self.makespan, "energy": self.energy, "peak_memory": self.peak_memory,
                "devices": float(self.devices), "bytes_moved": self.bytes_moved}

    def vector(self, names: tuple[str, ...] | list[str] = OBJECTIVES) -> np.ndarray:
        o = self.objectives()
        return np.array([o[n] for n in names], dtype=np.float64)

    def to_json(self) -> dict[str, Any]:
        return {**self.objectives(), "feasible": self.feasible, "lower_bound": self.lower_bound, "gap": self.gap,
                "peak_memory_per_device": self.peak_memory_per_device.tolist()}


def program_key(g: Graph) -> tuple:
    """Identity of the logical program behind a plan, cheap to compute (no unsharding)."""
    logical = []
    for o in g.ops.values():
        if o.kernel == "fused":
            logical.extend((s["op"], s["kernel"]) for s in o.params["stages"])
        elif o.kernel == "accumulate" and o.name.endswith(".acc") and o.name[:-4] in g.ops:
            continue
        else:
            logical.append((o.name, o.kernel))
    io = tuple(sorted((n, t.shape, t.dtype) for n, t in g.tensors.items() if t.role in SOURCE_ROLES + ("output",)))
    return tuple(sorted(logical)), io


class Evaluator:
    """Evaluates plans on one hardware; reuse it (its caches make re-evaluation incremental)."""

    def __init__(self, hw: Hardware | str) -> None:
        self.hw = load_hardware(hw) if not isinstance(hw, Hardware) else hw
        self.lowerer = Lowerer(self.hw)
        self._bounds: dict[tuple, float] = {}

    def __call__(self, g: Graph, keep: bool = False) -> Evaluation:
        low = self.lowerer.lower(g)
        s = simulate_arrays(low.kind, low.dev, low.dst, low.dur, low.succ_ptr, low.succ_idx, low.alloc,
                            low.resident, low.n_devices)
        energy = schedule_energy(s, self.hw, low.kind, low.dev, low.dst, low.alloc).total
        peak = s.peak_mem
        return Evaluation(
            makespan=s.makespan, energy=energy, peak_memory=float(peak.max()) if peak.size else 0.0,
            devices=int(s.used.sum()), bytes_moved=s.bytes_moved,
            feasible=bool(np.all(peak <= self.hw.device.mem_capacity)),
            lower_bound=self.lower_bound(g), peak_memory_per_device=peak,
            lowered=low if keep else None, schedule=s if keep else None)

    def lower_bound(self, g: Graph) -> float:
        key = program_key(g)
        lb = self._bounds.get(key)
        if lb is None:
            from ir.rewrites import unshard

            lb = self._bounds[key] = lower_bound(unshard(g), self.hw)
        return lb


def op_min_time(g: Graph, hw: Hardware, name: str, n: int) -> float:
    """Least time of an op spread evenly over ``n`` devices, whatever the plan does to it.

    Compute at effective peak; memory traffic only for the parameters and graph inputs it reads
    (intermediates can be fused away, so their traffic is not a bound). No launch overhead:
    fusion can merge launches.
    """
    o = g.ops[name]
    sig = g.signature(o)
    lo = np.zeros((1, len(sig.dims)), np.int64)
    hi = np.array([sig.extents], np.int64)
    flops = float(sig.flops(lo, hi)[0])
    src_bytes = sum(float(np.prod(g.tensors[t].shape)) * ITEMSIZE[g.tensors[t].dtype]
                    for _, t in o.inputs if g.tensors[t].role in SOURCE_ROLES)
    ce, me = hw.efficiency_for(get_kernel(o.kernel).kernel_class)
    dtype = g.tensors[o.output].dtype
    return max(flops / (n * hw.peak_flops(dtype) * ce), src_bytes / (n * hw.device.mem_bandwidth * me))


def lower_bound(program: Graph, hw: Hardware) -> float:
    """max(total work over the fleet, critical path with each op spread over the fleet) + one launch.

    ``program`` is the unsharded logical program (``ir.rewrites.unshard``). Work counts every op's
    FLOPs at peak and only the program's own inputs and outputs as memory traffic (everything else
    could be fused away). Valid for every plan the rewrites can reach.
    """
    n = hw.n_devices
    work_time, io_bytes = 0.0, 0.0
    finish: dict[str, float] = {}
    for name in program.topo_order:
        o = program.ops[name]
        sig = program.signature(o)
        dtype = program.tensors[o.output].dtype
        lo = np.zeros((1, len(sig.dims)), np.int64)
        work_time += float(sig.flops(lo, np.array([sig.extents], np.int64))[0]) / hw.peak_flops(dtype)
        start = max((finish[program.producers[t]] for _, t in o.inputs if t in program.producers), default=0.0)
        finish[name] = start + op_min_time(program, hw, name, n)
    for t in program.tensors.values():
        if t.role in SOURCE_ROLES or t.role == "output":
            io_bytes += float(np.prod(t.shape)) * ITEMSIZE[t.dtype]
    work = max(work_time / n, io_bytes / (n * hw.device.mem_bandwidth))
    launch = min(hw.launch_overhead_for(k) for k in set(hw.efficiency) | {"default"})
    return max(work, max(finish.values(), default=0.0)) + launch


def evaluate(g: Graph, hw: Hardware | str, keep: bool = True) -> Evaluation:
    """One-shot evaluation of ``g`` on ``hw`` (a ``Hardware``, preset name or YAML path)."""
    return Evaluator(hw)(g, keep=keep)
