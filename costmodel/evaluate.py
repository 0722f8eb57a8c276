"""Objectives of a plan on a fleet: makespan, energy, peak memory, devices, bytes moved.

``Evaluator(hw)(g)`` lowers (incrementally, see ``costmodel.lowering``), simulates, and returns an
``Evaluation``; ``evaluate(g, hw)`` is the one-shot form. ``Evaluation.breakdown()`` (computed
only on request, from an evaluation made with ``keep=True``) splits the time per device (compute,
communication, idle) and per operation (shards, FLOPs, compute seconds, incoming transfers).

Lower bound (``lower_bound``): no plan of the same program on the same fleet can finish sooner
under this cost model. It is the larger of

- **total work over the fleet, plus one or two launches**: ``max(Σ_ops FLOPs / (peak·ce),
  program I/O bytes / (bw·me)) / n + launch`` (every FLOP runs somewhere; every byte of a source
  that launched kernels read whole, and of an output a launched kernel writes, is read or written
  at least once, while a source read only in part or through a slice, which may be a view, counts
  nothing; intermediates could be fused away, so they are not counted; the best efficiency
  factors of the hardware). The device with the most compute has at least the average and runs
  at least one shard, so it also pays at least one launch (the shortest: a multi-tensor kernel's
  where the program has one). Where ``every_kernel_waits``
  holds (``costmodel.bounds``: every produced tensor is read whole, and every op reads a tensor a
  launched kernel produces or is read only by launched kernels), a second launch is added:
  among the devices, count only the shards whose results are used (some kernel waits on them, or
  they write a graph output; they still cover every op, as the tensors are read whole); the one
  with the most of that work either runs a second kernel or runs one that waits for, or is
  waited on by, a launched kernel elsewhere. A chain split over the batch on every device meets
  this exactly (``tests/costmodel/test_bounds.py``); and
- **the critical path at full parallelism**: with every op spread over the whole fleet and
  pipelined, the compute along a path is already in the work term; what remains is that a chain
  of dependent ops still runs one shard of each after the other, each paying at least one
  launch. Elementwise ops that read a produced tensor might be fused into their producer, and a
  slice may be a view, so they add no launch.

Both terms are valid bounds. (Summing per-op roofline times along the longest path is not: a
fused op overlaps one stage's memory traffic with another's compute, a pipelined plan overlaps
the ops. Nor is the work over the fleet plus a launch for each op on the chain, though a plan
that runs every op on every device pays that: a device may skip ops while others run them. And
the second launch needs its condition: two independent ops, each alone on half the fleet, finish
in work/n + one launch.) For a training step the work term holds the forward, backward and
optimizer FLOPs.
Each term is the smallest over the program's substituted forms (``costmodel.bounds``: fused
attention and norms launch fewer kernels on the chain, a reassociated chain costs fewer FLOPs), so
the bound holds for plans that use substitutions too.

Memory floor (``ProgramFacts.memory_floor``): the loop-carried state (parameters, optimizer
states) of a training step must live somewhere for the whole step, so some device holds at least
``total state bytes / n_devices``; a program whose floor exceeds a device's capacity is
infeasible on that fleet however it is sharded (``Evaluation.feasible`` is then false).

Model FLOPs and MFU: ``model_flops`` is the FLOP count of the logical program (every op of the
step once, as the kernels declare it); ``mfu`` = model FLOPs / (makespan × peak of the devices
used), with each op's FLOPs taken at the peak of its dtype (for a one-dtype program exactly
``model_flops / (makespan · n_used · peak[dtype])``, the model FLOPs utilisation practitioners
compare, PaLM appendix B). A recomputation rewrite adds hardware FLOPs, not model FLOPs; a
reassociation that needs fewer is the model's cost (the cheapest substituted form's FLOPs).
``Evaluation.gap`` = makespan / lower bound (1.0 would be at the limit).
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, field
from typing import Any

import numpy as np

from costmodel.bounds import bound_over, lower_bound, program_forms
from costmodel.efficiency import Curves, curves_for
from costmodel.energy import energy_breakdown
from costmodel.gc_pacing import GcPacer
from costmodel.hardware import Hardware
from costmodel.hardware_io import load_hardware
from costmodel.lowering import Lowered, Lowerer, same_data_flow, program_key
from costmodel.lookahead import DEFAULT_WINDOW, lookahead_tiers
from costmodel.repetition import Repetition, repetition
from costmodel.simulate import Schedule
from ir.folding import fold_constants
from ir.graph import Graph
from ir.layers import GraphMemo, truncate
from ir.kernels import ITEMSIZE

OBJECTIVES = ("makespan", "energy", "peak_memory", "devices")

__all__ = ["OBJECTIVES", "Breakdown", "Evaluation", "Evaluator", "ProgramFacts", "breakdown", "evaluate",
           "lower_bound", "program_facts",
           "program_key", "serial_prediction"]


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
    hardware: Hardware | None = field(default=None, repr=False)
    model_flops: float = 0.0  # FLOPs of the logical program per step
    mfu: float = 0.0  # model FLOPs / (makespan x peak of the devices used)
    memory_floor: float = 0.0  # bytes: total loop-carried state / n_devices
    repetition: Repetition | None = field(default=None, repr=False)  # extended from two truncations

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
                "model_flops": self.model_flops, "mfu": self.mfu, "memory_floor": self.memory_floor,
                "peak_memory_per_device": self.peak_memory_per_device.tolist(),
                **({"simulated_layers": [len(self.repetition.small), len(self.repetition.big)],
                    "layers": self.repetition.layers} if self.repetition is not None else {})}

    def breakdown(self) -> "Breakdown":
        """Per-device and per-operation split of the schedule (needs ``keep=True``)."""
        return breakdown(self)


# ---------------------------------------------------------------------------------------------
# breakdown
# ---------------------------------------------------------------------------------------------


@dataclass
class Breakdown:
    """``devices``: one dict per device of the fleet: ``device``, ``used``, ``compute_s``
    (busy computing), ``egress_s``, ``ingress_s`` (port occupancy: the sum of ``bytes /
    bandwidth`` of the transfers it sends / receives; link latencies hold no port and are not
    included), ``comm_s`` (egress + ingress), ``idle_s`` (makespan − compute, for used devices; 0
    otherwise), ``shards``, ``peak_memory``, ``resident_memory``.

    ``ops``: one dict per operation in topological order: ``op``, ``shards``, ``flops``,
    ``compute_s`` (sum of its shard durations), ``transfers``, ``in_bytes``, ``in_s`` and
    ``in_latency_s`` (bytes, port seconds = bytes / bandwidth, and summed link latencies of the
    transfers bringing its inputs; ``in_s + in_latency_s`` is what they would take one after the
    other without pipelining; a transfer shared by several readers on one device is counted for
    the first of them), ``devices`` (sorted), ``start`` and ``finish`` (first shard start, last
    shard finish)."""

    makespan: float
    devices: list[dict[str, Any]]
    ops: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"makespan": self.makespan, "devices": self.devices, "ops": self.ops}


def breakdown(ev: Evaluation) -> Breakdown:
    low, s = ev.lowered, ev.schedule
    if low is None or s is None:
        raise ValueError("this evaluation kept no schedule; evaluate with keep=True (evaluate() does)")
    nc = low.n_compute
    n_dev = low.n_devices
    comp_dev = low.dev[:nc]
    shards = np.bincount(comp_dev, minlength=n_dev)
    devices = []
    for d in range(n_dev):
        used = bool(s.used[d])
        devices.append({
            "device": d, "used": used, "compute_s": float(s.busy_compute[d]), "egress_s": float(s.busy_egress[d]),
            "ingress_s": float(s.busy_ingress[d]), "comm_s": float(s.busy_egress[d] + s.busy_ingress[d]),
            "idle_s": float(s.makespan - s.busy_compute[d]) if used else 0.0, "shards": int(shards[d]),
            "peak_memory": float(s.peak_mem[d]), "resident_memory": float(low.resident[d])})
    k = len(low.op_names)
    t_op = low.transfer_op
    t_bytes = low.alloc[nc:]
    t_dur = low.dur[nc:]
    t_lat = low.lat[nc:]
    in_bytes = np.bincount(t_op, weights=t_bytes, minlength=k) if t_op.size else np.zeros(k)
    in_s = np.bincount(t_op, weights=t_dur, minlength=k) if t_op.size else np.zeros(k)
    in_lat = np.bincount(t_op, weights=t_lat, minlength=k) if t_op.size else np.zeros(k)
    n_in = np.bincount(t_op, minlength=k) if t_op.size else np.zeros(k, np.int64)
    ops = []
    for i, name in enumerate(low.op_names):
        a, b = int(low.op_offsets[i]), int(low.op_offsets[i + 1])
        ops.append({
            "op": name, "shards": b - a, "flops": float(low.flops[a:b].sum()), "compute_s": float(low.dur[a:b].sum()),
            "transfers": int(n_in[i]), "in_bytes": float(in_bytes[i]), "in_s": float(in_s[i]),
            "in_latency_s": float(in_lat[i]),
            "devices": sorted(set(low.dev[a:b].tolist())),
            "start": float(s.start[a:b].min()) if b > a else 0.0,
            "finish": float(s.finish[a:b].max()) if b > a else 0.0})
    return Breakdown(s.makespan, devices, ops)


# ---------------------------------------------------------------------------------------------
# evaluator
# ---------------------------------------------------------------------------------------------


class Evaluator:
    """Evaluates plans on one hardware; reuse it (its caches make re-evaluation incremental)."""

    def __init__(self, hw: Hardware | str, collectives: bool = True, curves: Any = "default",
                 lookahead: int = DEFAULT_WINDOW, gc_every: int = 2000, layers: str = "whole",
                 model_layers: int | None = None) -> None:
        """``collectives``: time the transfer groups that are NCCL collectives as such
        (``costmodel.collectives``); False: every transfer point to point. ``curves``: a
        ``costmodel.efficiency.Curves``, ``"default"`` (the default: the device's published
        curves, H100 and H200, unless the hardware carries its own factors; else none), or None
        (the hardware's constant factors only: the flat roofline). ``lookahead``: how many compute
        nodes a device may run ahead of program order (``costmodel.lookahead``; 0: unbounded).
        ``gc_every``: pace the garbage collector (``costmodel.gc_pacing``: freeze the caches, one
        full collection every ``gc_every`` evaluations; 0: leave the collector alone).
        ``layers``: ``whole`` simulates every layer; ``repeat`` evaluates a model of repeated
        layers from two truncations (``costmodel.repetition``: a few layers simulated, the
        objectives extended along the layers; plans it cannot cut, and ``keep=True``, whole).
        ``model_layers`` (with ``repeat``): plans are proxies of a model with this many layers,
        evaluated as that model (their middle layers copied up to it)."""
        if layers not in ("whole", "repeat"):
            raise ValueError(f"layers: expected 'whole' or 'repeat', got {layers!r}")
        self.layers = layers
        self.model_layers = model_layers
        self._gc = GcPacer(gc_every)
        self.lookahead = lookahead
        self.hw = load_hardware(hw) if not isinstance(hw, Hardware) else hw
        if isinstance(curves, str):
            if curves != "default":
                raise ValueError(f"curves: expected a Curves, 'default' or None, got {curves!r}")
            curves = curves_for(self.hw)
        # priced as a production runtime runs a plan (weights-only ops folded, slices as views)
        self.lowerer = Lowerer(self.hw, collectives=collectives, curves=curves, runtime=True)
        self._bounds: dict[int, ProgramFacts] = {}
        self._logical_facts: dict[tuple, ProgramFacts] = {}
        self._digest_facts: dict[str, ProgramFacts] = {}  # by the unsharded program's digest (exact)
        self._programs = GraphMemo()  # recent whole models' program numbers (layers="repeat")
        self._capacity = self.hw.device.mem_capacity
        # seconds spent per phase (truncate, lower, lookahead, simulate) when set to a dict: where
        # an evaluation goes, for benchmarks (scripts/bench_costmodel.py); None: not timed
        self.phase_seconds: dict[str, float] | None = None

    def _timed(self, phase: str, t0: float) -> float:
        """Add the time since ``t0`` to ``phase`` (when timing); return the clock now."""
        now = time.perf_counter()
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + now - t0
        return now

    def __call__(self, g: Graph, keep: bool = False) -> Evaluation:
        self._gc.tick()
        if self.layers == "repeat" and not keep:
            e = self._repeated(g)
            if e is not None:
                return e
        return self._whole(g, keep)

    def _repeated(self, g: Graph) -> Evaluation | None:
        """``g``'s evaluation extended from two truncations (``costmodel.repetition``), or None
        (evaluate it whole). A proxy (``model_layers``) that cannot be cut is refused: its own
        figures would stand for a model ten times its size, and a search would seek them out."""
        t0 = time.perf_counter() if self.phase_seconds is not None else 0.0
        rep = repetition(g, model_layers=self.model_layers)
        small = big = None
        if rep is not None:
            small, big = truncate(g, rep.small), truncate(g, rep.big)
        if self.phase_seconds is not None:
            self._timed("truncate", t0)
        if small is None or big is None:
            return self._refused(g) if self.model_layers is not None else None
        # the truncations' own program facts are needed only for a proxy (no whole program)
        es, eb = self._whole(small, True, rep.proxy), self._whole(big, True, rep.proxy)
        if rep.proxy:  # no whole program to take facts from: the truncations' programs, extended
            # (linear in the layers, except the lower bound: a max of two linear terms is convex, so
            # the line through two of its points stays below it beyond them: still a bound)
            fs, fb = self._facts(self._program_of(small), small), self._facts(self._program_of(big), big)
            facts = ProgramFacts(*(rep.extend(a, b) for a, b in zip(astuple(fs), astuple(fb))))
        else:
            facts = self._facts(self._program_of(g), g)

        def extend(a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray | float:
            return np.maximum(rep.extend(a, b), b)  # never below the larger truncation's

        peak = extend(es.peak_memory_per_device, eb.peak_memory_per_device)
        # every added layer's compute runs somewhere: no device can finish before its own busy time
        # grows by the layers (the line alone can be fooled by a middle layer that hides behind
        # the first or last one, which then dominates the makespan for a few layers only)
        busy = extend(es.schedule.busy_compute, eb.schedule.busy_compute)
        line = float(extend(es.makespan, eb.makespan))
        makespan = max(line, float(busy.max()) if busy.size else 0.0)
        used = max(es.devices, eb.devices)
        energy = float(extend(es.energy, eb.energy)) + self.hw.device.idle_power * used * (makespan - line)
        return Evaluation(
            makespan=makespan, energy=energy, peak_memory=float(peak.max()) if peak.size else 0.0, devices=used,
            bytes_moved=float(extend(es.bytes_moved, eb.bytes_moved)),
            feasible=bool((peak <= self._capacity).all()) and facts.memory_floor <= self._capacity,
            lower_bound=facts.lower_bound, peak_memory_per_device=peak, hardware=self.hw,
            model_flops=facts.model_flops, mfu=facts.ideal_seconds / (makespan * used) if makespan > 0 and used else 0.0,
            memory_floor=facts.memory_floor, repetition=rep)

    def _refused(self, g: Graph) -> Evaluation:
        """A proxy that cannot stand for its model: infeasible, with infinite objectives."""
        n = self.hw.n_devices
        return Evaluation(makespan=float("inf"), energy=float("inf"), peak_memory=float("inf"), devices=n,
                          bytes_moved=float("inf"), feasible=False, lower_bound=0.0,
                          peak_memory_per_device=np.full(n, np.inf), hardware=self.hw)

    def _program_of(self, g: Graph) -> int:
        """``Lowerer.program_of(g)``, inherited from the parent through an in-place edit that
        changed only shards (``Graph.edit``) or derived from the parent's (``Lowerer.program_from``),
        so a whole model, which is never lowered, is not keyed at every step."""
        number = self._programs.get(g)
        if number is None:
            parent = g.origin() if g.origin is not None else None
            known = self._programs.get(parent) if parent is not None else None
            if known is not None and g.edit is not None and g.edit.parent() is parent and all(
                    same_data_flow(g.ops[n], parent.ops[n]) for n in g.edit.replaced):
                number = known
            elif known is not None:
                number = self.lowerer.program_from(g, parent.ops, parent.tensors, known)
            if number is None:
                number = self.lowerer.program_of(g)
            self._programs.put(g, number)
        return number

    def _whole(self, g: Graph, keep: bool, facts: bool = True) -> Evaluation:
        """``g`` simulated whole. ``facts=False``: without its program's facts (bound, FLOPs,
        floor left at 0), for truncations whose own program facts nobody reads."""
        timing = self.phase_seconds is not None
        t = time.perf_counter() if timing else 0.0
        low = self.lowerer.lower(g)
        if timing:
            t = self._timed("lower", t)
        s = None
        # the first tier the data edges leave acyclic, on the graph lowered (weights-only ops folded)
        for ctl in lookahead_tiers(low, fold_constants(g), self.lookahead):
            if timing:
                t = self._timed("lookahead", t)
            s = low.simulate(ctl, cycle_ok=True)
            if timing:
                t = self._timed("simulate", t)
            if s is not None:
                break
        if s is None:  # a cycle in the data edges themselves
            s = low.simulate(ctl)  # raises SimulationError, naming one cycle
        nc = low.n_compute
        # = schedule_energy(s, hw, kind, dev, dst, alloc), with the per-transfer link energies from the lowering
        energy = energy_breakdown(s.makespan, s.busy_compute, s.used, self.hw.device, low.alloc[nc:],
                                  low.transfer_epb).total
        peak = s.peak_mem
        pf = self._facts(low.program, g) if facts else _NO_FACTS
        used = int(np.count_nonzero(s.used))
        mfu = pf.ideal_seconds / (s.makespan * used) if s.makespan > 0 and used else 0.0
        return Evaluation(
            makespan=s.makespan, energy=energy, peak_memory=float(peak.max()) if peak.size else 0.0,
            devices=used, bytes_moved=s.bytes_moved,
            feasible=bool((peak <= self._capacity).all()) and pf.memory_floor <= self._capacity,
            lower_bound=pf.lower_bound, peak_memory_per_device=peak, lowered=low if keep else None,
            schedule=s if keep else None, hardware=self.hw, model_flops=pf.model_flops, mfu=mfu,
            memory_floor=pf.memory_floor)

    def _facts(self, program: int, g: Graph) -> ProgramFacts:
        """The facts of ``g``'s logical program, memoised by the lowerer's program number and,
        behind it, by the logical program itself (``Lowerer.unsubstituted_key``, found without
        unsharding): plans that differ by substitutions (fused attention in some layers and not
        others) have different numbers but one logical program, and ``unshard`` plus
        ``program_facts`` of a whole training step cost tens of milliseconds. Those keys hold the
        program's source and output Tensor objects (``costmodel.lowering.Ends``), so a plan
        parsed afresh misses them; then the unsharded program's digest finds its facts."""
        facts = self._bounds.get(program)
        if facts is None:
            from ir.rewrites import unshard

            key = self.lowerer.unsubstituted_key(g)
            facts = self._logical_facts.get(key)
            if facts is None:
                program_g = unshard(g)
                facts = self._digest_facts.get(program_g.digest)
                if facts is None:
                    facts = self._digest_facts[program_g.digest] = program_facts(program_g, self.hw,
                                                                                 self.lowerer.curves)
                self._logical_facts[key] = facts
                for memo in (self._logical_facts, self._digest_facts):
                    if len(memo) > 64:
                        memo.pop(next(iter(memo)))
            self._bounds[program] = facts
            if len(self._bounds) > self.lowerer.PROGRAMS_CAP:  # numbers are never reused: drop the oldest
                self._bounds.pop(next(iter(self._bounds)))
        return facts

    def lower_bound(self, g: Graph) -> float:
        from ir.rewrites import unshard

        return lower_bound(unshard(g), self.hw, self.lowerer.curves)


@dataclass(frozen=True)
class ProgramFacts:
    """What a logical program implies on a fleet, whatever the plan: ``lower_bound`` (s),
    ``model_flops``, ``ideal_seconds`` (Σ op FLOPs / peak of its dtype on one device: the
    numerator of MFU in device-seconds), ``state_bytes`` (loop-carried state) and
    ``memory_floor`` = ``state_bytes / n_devices``."""

    lower_bound: float
    model_flops: float
    ideal_seconds: float
    state_bytes: float
    memory_floor: float


_NO_FACTS = ProgramFacts(0.0, 0.0, 0.0, 0.0, 0.0)


def program_facts(program: Graph, hw: Hardware, curves: Curves | None = None) -> ProgramFacts:
    """:class:`ProgramFacts` of ``program`` (the unsharded logical program) on ``hw``, whose
    shards are timed with ``curves`` (``costmodel.efficiency``; None: the flat roofline). The
    model FLOPs are those of its cheapest substituted form (``costmodel.bounds``: a reassociated
    low-rank chain needs fewer; the scores a fused attention's backward recomputes are hardware
    FLOPs, not model FLOPs), so MFU stays at most 1."""
    # (past bounds.FORMS_CAP reassociated forms the model FLOPs are the program's forms' alone: a
    # plan in a cheaper unexplored order may show an MFU above 1; its bound stays valid)
    forms, loose = program_forms(program)
    flops, ideal = min(_flops(f, hw) for f in forms)
    bound = bound_over(forms, hw, curves, loose)
    state = sum(float(np.prod(program.tensors[p].shape, dtype=np.float64)) * ITEMSIZE[program.tensors[p].dtype]
                for p in program.carried)
    return ProgramFacts(bound, flops, ideal, state, state / hw.n_devices)


def _flops(program: Graph, hw: Hardware) -> tuple[float, float]:
    """(FLOPs of every op of ``program``, seconds of them at the peak of each op's dtype)."""
    flops = ideal = 0.0
    for o in program.ops.values():
        sig = program.signature(o)
        f = float(np.prod(sig.extents, dtype=np.float64)) * sig.flops_per_point
        flops += f
        ideal += f / hw.peak_flops(program.tensors[o.output].dtype)
    return flops, ideal


def serial_prediction(g: Graph, hw: Hardware) -> float:
    """Model seconds to run every shard of ``g`` one after another on one device of ``hw`` (how
    one machine executes a plan; what sampled real executions are compared with)."""
    one = hw.replace(n_nodes=1, devices_per_node=max(hw.devices_per_node, 1 + max(g.devices)))
    low = Lowerer(one).lower(g)
    return float(low.dur[: int(low.op_offsets[-1])].sum())  # the compute nodes: one per shard


def evaluate(g: Graph, hw: Hardware | str, keep: bool = True, collectives: bool = True,
             curves: Any = "default") -> Evaluation:
    """One-shot evaluation of ``g`` on ``hw`` (a ``Hardware``, preset name or YAML path)."""
    return Evaluator(hw, collectives=collectives, curves=curves)(g, keep=keep)
