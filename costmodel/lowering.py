"""Lowering a plan + hardware to the simulator's flat arrays (struct of arrays).

What a plan becomes
-------------------
- **Compute nodes**, one per shard, numbered op by op in topological order: FLOPs from the shard's
  index box, bytes = the projected input boxes (clipped to their tensors) + its output box, time
  from the roofline (:meth:`Hardware.shard_time`), output buffer = its output box.
- **Transfers.** For every produced tensor, the producer's output boxes are intersected with the
  input boxes of *every* reader shard (all consumer ops and ports of the tensor). A non-empty
  intersection on one device is a dependence edge; across devices, one transfer per (producer
  shard, destination device) carries the *union* of what that device's readers need from that
  shard: halos and replicated reads are counted exactly, and a box needed by several shards (or
  several ops) on one device moves once. Edges: producer shard → transfer → each reader shard.
  Its ``dur`` is ``bytes / bandwidth`` of the link it crosses (NVLink inside a node, the NIC
  across nodes: the time it holds the sender's egress and the receiver's ingress port) and its
  ``lat`` the link's latency (added before the data is available, holding no port; see
  ``costmodel.simulate``). Transfer nodes follow the compute nodes, tensor by tensor in producer
  order, then by (producer shard, destination device).
- **Graph inputs and weights** are resident where their readers need them before the run: per
  device, the union of the boxes read there counts as resident memory (replication costs memory,
  not time). Outputs stay where they are produced. With ``Lowerer(runtime=True)`` (the
  ``Evaluator``'s), ops computed from such weights alone (a merged Q/K/V's stacked weight) are
  folded first (``ir.folding``: they run once at load time, their outputs are weights), a
  contiguous slice is a view (no kernel), and optimizer updates and the casts of fp32 master
  weights pay a 36th of a launch each (``multi_tensor``: PyTorch's foreach/fused AdamW, apex's
  FusedAdam).
- **Loop-carried state** (``Graph.carried``: a parameter or state ``P`` whose next value
  ``P.next`` the step produces) is different: ``P`` lives where the shards of ``P.next``'s
  producer write it (its *home*, box by box: the update op's sharding is the state's layout), and
  that home counts as resident memory on its device for the whole step. ``P.next``'s producer
  writes into that buffer (its compute nodes allocate nothing: the next state replaces the state,
  it is not counted twice). A reader of ``P`` is treated like a reader of a produced tensor whose
  producer shards are the home boxes: on the home device the read is free; elsewhere one transfer
  per (home shard, destination device) carries the union of what that device reads from it
  (FSDP's all-gather), with no predecessor (the state is there when the step starts), received
  into a buffer that lives until its last reader ends. These *state transfers* follow the
  transfers of produced tensors, state by state in the order of ``P.next``'s producer. Home boxes
  of one state never overlap: every cell of ``P.next`` has exactly one producer shard.

Incremental lowering
--------------------
Rewrites share unchanged ``Op`` objects between a parent plan and its child. The lowerer keeps
the last few lowered plans (*states*) and, for a new plan with the same operations and tensors,
finds the state it differs least from (by ``is`` on the ops), recomputes only the touched ops,
the tensors they read or write and the inputs they read, and re-assembles the arrays in one
compiled pass. Pieces are also cached by what they are computed from (an op's signature, shards
and input roles; a group's boxes and devices, by content), so plans reached by other paths, and
the ops a structural move re-creates unchanged, reuse them too. A structural rewrite (fusion,
reduction split) gets its structure (``costmodel.structure``: program order and data flow as
arrays) derived from that of the plan it was made from (``Graph.origin``)
when that plan is a recent state, else built (and cached by op names, kernels and data flow); it
takes from that state (or the recent one closest in size) every piece whose ops it kept, matched
by arrays rather than cache keys, and runs of its concatenated arrays as slices (``_derive``). The
pieces are deterministic functions of their ops, and fresh and incremental lowering run the same
assembly, so both give bit-identical arrays (``tests/costmodel/test_lowering.py`` checks this on
random rewrite sequences).
"""

from __future__ import annotations

import itertools
import weakref

from collections import OrderedDict, deque
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not, itemgetter, ne
from typing import Any, Callable, Mapping

import numpy as np

from costmodel import _kernels as K
from costmodel import collectives as C
from costmodel import efficiency as E
from costmodel.hardware import Hardware, HardwareError, class_family
from costmodel.lookahead import fetch_readers
from costmodel.structure import Structure, build_structure, derive_structure
from ir.folding import fold_constants
from ir.graph import SOURCE_ROLES, Graph, Op, array_digest
from ir.kernels import ITEMSIZE, get_kernel
from ir.kernels.base import Signature
from ir.kernels.optim import StateUpdate


#: Largest index-space volume and tensor size in bytes the lowering accepts: box volumes are int64
#: and byte counts float64, exact below 2**53; a larger plan would silently wrap around (a 1e11-wide
#: MLP gave a negative peak memory), so it is refused instead.
SIZE_LIMIT = 2**53


class PlanSizeError(ValueError):
    """A plan whose tensors or index spaces are too large to count exactly (see ``SIZE_LIMIT``)."""


def check_tensor_size(t: Any) -> None:
    """Raise :class:`PlanSizeError` when tensor ``t``'s bytes (Python integers, no overflow)
    reach ``SIZE_LIMIT``."""
    cells = 1
    for e in t.shape:
        cells *= int(e)
    if cells * ITEMSIZE[t.dtype] >= SIZE_LIMIT:
        raise PlanSizeError(
            f"tensor {t.name!r} of shape {list(t.shape)} ({t.dtype}) holds {cells * ITEMSIZE[t.dtype]:.3e} bytes, "
            f"beyond what the cost model counts exactly (2**53 = {SIZE_LIMIT:.3e}); use smaller sizes "
            "(workload parameters such as widths, batch, seq, d_model)")


def check_op_size(name: str, extents: Any) -> None:
    """Raise :class:`PlanSizeError` when an op's index space has ``SIZE_LIMIT`` points or more."""
    pts = 1
    for e in extents:
        pts *= int(e)
    if pts >= SIZE_LIMIT:
        raise PlanSizeError(
            f"op {name!r} has {pts:.3e} index points, beyond what the cost model counts exactly "
            f"(2**53 = {SIZE_LIMIT:.3e}); use smaller sizes (workload parameters such as widths, batch, seq)")


def check_sizes(g: Graph) -> None:
    """Raise :class:`PlanSizeError` naming the first tensor or op of ``g`` too large to count."""
    for t in g.tensors.values():
        check_tensor_size(t)
    for o in g.ops.values():
        check_op_size(o.name, g.signature(o).extents)


class Lowered:
    """The simulator's input arrays plus what the objectives and breakdowns need.

    Nodes ``[0, n_compute)`` are compute nodes (op ``i``'s shards are
    ``[op_offsets[i], op_offsets[i+1])``, ops in ``op_names`` order), the rest transfers.

    ``kind`` int8[n], ``dev`` int32[n] (transfer: source device), ``dst`` int32[n] (transfer:
    destination, compute: -1), ``dur`` float64[n] seconds of occupancy (compute: the roofline
    time; transfer: bytes / link bandwidth, the time it holds the two ports), ``lat`` float64[n]
    seconds of latency (transfer: the link's latency, which delays the data's arrival without
    holding the ports; compute: 0), ``elapsed`` = ``dur + lat`` (start to output available);
    ``succ_ptr`` int64[n+1] and ``succ_idx`` int32[m] (CSR successors), ``alloc`` float64[n]
    (bytes of the buffer each node produces; for a transfer, the bytes moved), ``resident``
    float64[n_devices]; per compute node
    ``flops`` and ``nbytes`` (read + written); per transfer ``transfer_op`` (index into
    ``op_names`` of the first reader needing it), ``transfer_src_op`` (the producer) and
    ``transfer_epb`` (link energy per byte). ``program``: equal tokens mean the same logical
    program (for caching lower bounds).

    With ``Lowerer(collectives=True)`` the transfers of a group that are NCCL collectives are one
    node of kind 2 per independent exchange instead (``costmodel.collectives``; a set of devices
    that send to or receive from one another): ``alloc`` = the bytes its point-to-point form
    moves, ``dur``/``lat`` = NCCL's bandwidth and latency terms, participants in ``part_ptr``,
    ``part_dev``, ``part_alloc`` (bytes each receives); ``link`` int8[n] = the ports a node uses
    (transfer: 0 NVLink, 1 NIC; collective: mask 1 NVLink, 2 NIC). The "transfer" arrays above
    cover every non-compute node. :meth:`simulate` passes all of it to the simulator.
    """

    __slots__ = ("kind", "dev", "dst", "dur", "lat", "alloc", "succ_ptr", "succ_idx", "resident", "n_devices",
                 "op_names", "program", "_ints", "_flts", "link", "part_ptr", "part_dev", "part_alloc", "contention",
                 "acc", "flow", "op_reads", "op_split", "_topo")

    def __init__(self, kind, i32, f64, succ_ptr, succ_idx, resident, ints, flts, n_devices: int,
                 op_names: tuple[str, ...], program: int = 0, link=None, part_ptr=None, part_dev=None,
                 part_alloc=None) -> None:
        self.kind, self.dev, self.dst = kind, i32[0], i32[1]
        self.dur, self.alloc, self.lat = f64[0], f64[1], f64[2]
        self.succ_ptr, self.succ_idx, self.resident = succ_ptr, succ_idx, resident
        self.n_devices, self.op_names, self.program = n_devices, op_names, program
        self._ints, self._flts = ints, flts
        self.link, self.part_ptr, self.part_dev, self.part_alloc = link, part_ptr, part_dev, part_alloc
        self.contention = 1.0  # the hardware's compute slowdown under communication (set by Lowerer.lower)
        self.acc = None  # bool[n]: accumulate nodes, whose local inputs are added in place (set by Lowerer.lower)
        # (producer op, reader CSR, state flag) of each group of the structure, ``op_names`` numbering
        # (``Structure.g_prod, g_rptr, g_rop, g_state``; set by Lowerer.lower): the data flow between ops
        self.flow = None
        self.op_reads = None  # int64 per op: how many inputs it reads (set with ``flow``)
        self.op_split = None  # bool per op: a split reduction's partial op (set with ``flow``)
        self._topo = None

    def simulate(self, ctl=None, contention: float | None = None, cycle_ok: bool = False):
        """The schedule of these arrays (``costmodel.simulate.simulate_arrays``, ports and
        collectives included); ``ctl``: control edges ``(ctl_ptr, ctl_idx)`` such as
        ``costmodel.lookahead.lookahead_edges`` gives, or None; ``contention``: the slowdown of
        compute overlapped by communication (default: the lowering hardware's
        ``Hardware.contention``; 1 = none); ``cycle_ok``: None for a cyclic graph instead of
        raising ``SimulationError``."""
        if contention is None:
            contention = self.contention
        from costmodel.simulate import simulate_arrays

        ctl_ptr, ctl_idx = ctl if ctl is not None else (None, None)
        return simulate_arrays(self.kind, self.dev, self.dst, self.dur, self.succ_ptr, self.succ_idx, self.alloc,
                               self.resident, self.n_devices, lat=self.lat, link=self.link, part_ptr=self.part_ptr,
                               part_dev=self.part_dev, part_alloc=self.part_alloc, ctl_ptr=ctl_ptr, ctl_idx=ctl_idx,
                               contention=contention, acc=self.acc, cycle_ok=cycle_ok, topo_hint=self.topo_hint)

    @property
    def topo_hint(self) -> np.ndarray:
        """int32[n]: the nodes in program order (each op's compute nodes, then the transfers and
        collectives of its output), except that a loop-carried state's gathers and the ops fed by
        sources only (a weight's cast) with their transfers come just before their first reader,
        where the lookahead fetches them (``costmodel.lookahead``): a topological order of the
        data edges and of the lookahead window's control edges. It saves the simulator its own
        topological pass (which checks the order and runs the pass where an edge points
        backwards in it, as a pipeline's control edges do)."""
        if self._topo is None:
            fetch = np.full(len(self.op_names), -1, np.int64)
            if self.flow is not None:
                fetch = fetch_readers(self.flow, self.op_reads > 0)
            self._topo = K.topo_hint(self.op_offsets, self.transfer_src_op, self.transfer_op, fetch,
                                     self.kind.shape[0])
        return self._topo

    @property
    def elapsed(self) -> np.ndarray:
        """float64[n]: ``dur + lat``, the seconds from a node's start until its output is available
        when nothing delays it (for a transfer: latency + bytes / bandwidth,
        :meth:`Hardware.transfer_time`)."""
        return self.dur + self.lat

    @property
    def op_offsets(self) -> np.ndarray:
        return self._ints[: len(self.op_names) + 1]

    @property
    def n_compute(self) -> int:
        return int(self._ints[len(self.op_names)])

    @property
    def n_transfer(self) -> int:
        return self.kind.shape[0] - self.n_compute

    @property
    def flops(self) -> np.ndarray:
        return self._flts[: self.n_compute]

    @property
    def nbytes(self) -> np.ndarray:
        nc = self.n_compute
        return self._flts[nc: 2 * nc]

    @property
    def transfer_epb(self) -> np.ndarray:
        return self._flts[2 * self.n_compute:]

    @property
    def transfer_op(self) -> np.ndarray:
        k = len(self.op_names) + 1
        return self._ints[k: k + self.n_transfer]

    @property
    def transfer_src_op(self) -> np.ndarray:
        return self._ints[len(self.op_names) + 1 + self.n_transfer:]

    @property
    def transfer_bytes(self) -> np.ndarray:
        return self.alloc[self.n_compute:]


def union_volume(lo: np.ndarray, hi: np.ndarray) -> float:
    """Exact volume of a union of boxes (rows of ``lo``/``hi``)."""
    lo = np.ascontiguousarray(lo, np.int64)
    hi = np.ascontiguousarray(hi, np.int64)
    if lo.ndim != 2 or lo.shape != hi.shape:
        raise ValueError(f"boxes must be (n, d) arrays of one shape, got {lo.shape} and {hi.shape}")
    return float(K.union_volume(lo, hi))


#: Program numbers, unique in the process (never reused, nor shared by two lowerers): caches
#: keyed by them (structures here, ``costmodel.lookahead``'s per-structure facts) stay right.
_PROGRAM_SEQ = itertools.count(1)


def program_key(g: Graph) -> tuple:
    """Identity of the logical program behind a plan, cheap to compute (no unsharding): its logical
    ops (name, kernel, params), its sources and outputs (name, shape, dtype, role), and which
    Tensor objects those are (``Ends``)."""
    logical = []
    for o in g.ops.values():
        logical.extend(_logical_entries(o, g))
    return tuple(sorted(logical)), _io_key(g), Ends(_ends(g))


class Ends:
    """The source and output Tensor objects of a plan, as part of its program's key: equal when
    they are the same objects. A plan and every plan rewritten from it share them (rewrites copy
    the tensors mapping, not its sources and outputs), while two programs built apart do not, so
    programs that name the same ops but wire them differently (a pre-norm and a post-norm block)
    never share a key, whose entries say nothing of the wiring. Holding the objects keeps their
    ids unique for as long as a key holds them."""

    __slots__ = ("objs", "ids", "_hash")

    def __init__(self, objs: tuple) -> None:
        self.objs, self.ids = objs, tuple(map(id, objs))
        self._hash = hash(self.ids)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ends) and self.ids == other.ids


def _ends(g: Graph) -> tuple:
    values = list(g.tensors.values())
    return tuple(compress(values, map(ne, map(_role, values), repeat("intermediate"))))


def _logical_entries(o: Op, g: Graph) -> list[tuple]:
    if o.kernel == "fused":
        return [(s["op"], s["kernel"], json_key(s.get("params", {}))) for s in o.params["stages"]]
    if o.kernel in ("accumulate", "attention_combine") and o.name.endswith(".acc") and o.name[:-4] in g.ops:
        return []  # the combine step of a split reduction: the same logical op as the unsplit one
    if o.name.endswith(".re") and o.name[:-3] in g.ops:
        return []  # a recomputed copy (ir.rewrites.recompute): no new logical work
    if "split" in o.params:
        return [(o.name, o.kernel, json_key({k: v for k, v in o.params.items() if k != "split"}))]
    return [(o.name, o.kernel, o.params_key)]


def _record_entry(r: Mapping[str, Any]) -> tuple:
    """The logical entry of an op a substitution recorded (``op``, ``kernel``, ``params``)."""
    return (r["op"], r["kernel"], json_key({k: v for k, v in r["params"].items() if k != "split"}))


def _entries_read_graph(o: Op) -> bool:
    """Whether ``_unsubstituted_entries(o, g)`` looks at other ops of ``g`` (so is not memoised)."""
    return (o.kernel in ("slice", "concat", "attention_lse") or o.kernel.startswith("attention_grad_")
            or (o.kernel in ("einsum", "matmul") and "+" in o.name))


def _attention_grad_of_fused(o: Op, g: Graph) -> bool:
    """Whether ``o`` is a gradient op ``fuse_attention`` wrote (``<attention op>.dq``, ``.dlse``...):
    the attention op's records hold the backward ops it replaced."""
    if o.kernel != "attention_lse" and not o.kernel.startswith("attention_grad_"):
        return False
    base = g.ops.get(o.name.rsplit(".", 1)[0])
    return base is not None and base.kernel == "attention" and bool(base.params.get("origin"))


def _merged_contraction(name: str, g: Graph) -> Op | None:
    """The merged contraction (``ir.rewrites.substitute_merge``) that op ``name`` is, or whose
    weight concat (``<merged>.wcat<i>``) it is; else None."""
    base = name.rsplit(".wcat", 1)[0] if ".wcat" in name else name
    o = g.ops.get(base)
    if o is None or "+" not in base or o.kernel not in ("einsum", "matmul"):
        return None
    # its concat, or (folded at load time, ``ir.folding``) the stacked weight the concat made
    if f"{base}.wcat1" not in g.ops and not any(t.startswith(f"{base}.wcat") for _, t in o.inputs):
        return None
    return o


def _unsubstituted_entries(o: Op, g: Graph) -> list[tuple]:
    """Logical entries of ``o`` in the program without substitutions (what ``unshard`` restores):
    a substituted op stands for the ops it records (fused attention, forward and backward; a
    fused norm; a reassociated chain); other ops as in ``program_key``."""
    p = o.params
    merged = _merged_contraction(o.name, g)
    if merged is not None:  # merge_matmuls: the slices stand for the contractions, the rest for nothing
        return []
    if o.kernel == "slice":
        src = g.ops.get(g.producers.get(o.inputs[0][1], ""))
        if src is not None and _merged_contraction(src.name, g) is src and o.name in src.name.split("+"):
            return [(o.name, src.kernel, json_key({k: v for k, v in src.params.items() if k != "split"}))]
    if o.kernel == "attention" and p.get("origin"):
        return [_record_entry(r) for r in p["origin"]["ops"] + p["origin"].get("backward", [])]
    if o.kernel == "norm_matmul":
        return [_record_entry(p["norm"]), _record_entry(p["inner"])]
    if o.kernel == "einsum" and p.get("origin"):
        return [_record_entry(p["origin"]["inner"]), _record_entry(p["origin"]["outer"])]
    if o.kernel == "fused":  # a split reduction's combine step fused with its consumer: no logical work
        out = []
        for s in p["stages"]:
            if s["kernel"] == "norm_matmul":  # a fused norm as the GEMM's prologue: the norm and the GEMM
                out += [_record_entry(s["params"]["norm"]), _record_entry(s["params"]["inner"])]
            elif not (s["kernel"] in ("accumulate", "attention_combine") and s["op"].endswith(".acc")
                      and s["op"][:-4] in g.ops):
                out.append((s["op"], s["kernel"], json_key(s.get("params", {}))))
        return out
    return _logical_entries(o, g)


def _same_ends(g: Graph, b: Mapping[str, Any]) -> bool:
    """Whether ``g``'s tensors and ``b`` differ only in intermediates (the same sources and outputs)."""
    a = g.tensors
    return all((n not in a or a[n].role == "intermediate") and (n not in b or b[n].role == "intermediate")
               for n in g.changed_tensors(b))


def _io_key(g: Graph) -> tuple:
    return tuple(sorted((n, t.shape, t.dtype, t.role) for n, t in g.tensors.items()
                        if t.role in SOURCE_ROLES or t.role == "output"))


def json_key(params: Mapping[str, Any]) -> str:
    import json

    return json.dumps(params, sort_keys=True, separators=(",", ":"))


#: Tensors one multi-tensor kernel launch covers: PyTorch's foreach and fused AdamW and apex's
#: FusedAdam (which Megatron-LM uses, also to copy its fp32 main params to the bf16 model params)
#: run ``multi_tensor_apply``, one launch per up to 36 tensors at depth 4 (param, grad, exp_avg,
#: exp_avg_sq; ATen native/cuda/MultiTensorApply.cuh: ``depth_to_max_tensors = {110, 64, 48, 36, 30}``)
MULTI_TENSOR = 36


def multi_tensor(g: Graph, o: Op) -> bool:
    """Whether a production runtime runs ``o`` inside a multi-tensor kernel, paying a
    ``MULTI_TENSOR``-th of a launch: an optimizer's state update, or the cast of a loop-carried
    (fp32 master) parameter to the low-precision copy the step reads."""
    if o.kernel == "cast":
        return g.is_carried(o.inputs[0][1])
    return isinstance(get_kernel(o.kernel), StateUpdate)


def compute_dtype(g: Graph, o: Op) -> str:
    """The dtype whose peak times ``o``: its output's, except that a fused op whose epilogue casts
    runs its first stage (the contraction) in that stage's own dtype (an fp32 GEMM cast to bf16 on
    the way out is an fp32 GEMM)."""
    dtype = g.tensors[o.output].dtype
    if o.kernel == "fused" and any(st["kernel"] == "cast" for st in o.params["stages"][1:]):
        sig = g.signature(o)
        dtype = get_kernel("fused").stage_signatures(sig.in_specs, o.params)[0][1].out_spec.dtype
    return dtype


def kernel_class_of(o: Op) -> str:
    """Efficiency class of an op (a fused op runs as its first stage's class)."""
    if o.kernel == "fused":
        return get_kernel(o.params["stages"][0]["kernel"]).kernel_class
    return get_kernel(o.kernel).kernel_class


# ---------------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------------


class _SigPack:
    """A signature's projections as padded int64 arrays for ``op_kernel``."""

    __slots__ = ("sig", "ports", "port_index", "ranks", "in_Ap", "in_An", "in_b", "in_s", "in_shape", "in_rank",
                 "in_item", "out_Ap", "out_An", "out_b", "out_s", "out_shape", "out_item", "fpp", "n_dims")

    def __init__(self, sig: Signature) -> None:
        self.sig = sig
        self.ports = tuple(sig.inputs)
        self.port_index = {p: i for i, p in enumerate(self.ports)}
        D = self.n_dims = len(sig.dims)
        P = len(self.ports)
        ranks = [sig.inputs[p].out_rank for p in self.ports]
        self.ranks = ranks
        R = max(ranks, default=1)
        self.in_Ap = np.zeros((P, R, D), np.int64)
        self.in_An = np.zeros((P, R, D), np.int64)
        self.in_b = np.zeros((P, R), np.int64)
        self.in_s = np.ones((P, R), np.int64)
        self.in_shape = np.ones((P, R), np.int64)
        self.in_rank = np.array(ranks, np.int64)
        self.in_item = np.array([float(ITEMSIZE[sig.in_specs[p].dtype]) for p in self.ports], np.float64)
        for i, p in enumerate(self.ports):
            Ap, An, b, s = sig.inputs[p].arrays
            r = ranks[i]
            self.in_Ap[i, :r], self.in_An[i, :r], self.in_b[i, :r], self.in_s[i, :r] = Ap, An, b, s
            self.in_shape[i, :r] = sig.in_specs[p].shape
        self.out_Ap, self.out_An, self.out_b, self.out_s = (np.ascontiguousarray(a) for a in sig.output.arrays)
        self.out_shape = np.array(sig.out_spec.shape, np.int64)
        self.out_item = float(ITEMSIZE[sig.out_spec.dtype])
        self.fpp = float(sig.flops_per_point)


class OpPiece:
    """One op's compute nodes: ``f`` float64[n, 5] = (device, seconds, output bytes, FLOPs,
    bytes), output boxes, its (padded) input boxes per port, and ``res[p]``: the resident bytes
    per device of port ``p`` when it reads a graph input."""

    __slots__ = ("op", "n", "f", "dev", "out_lo", "out_hi", "in_lo", "in_hi", "pack", "kclass", "dtype", "src_port",
                 "res", "_ports", "_mb", "_box_ids")

    def __init__(self, op: Op, f: np.ndarray, out_lo: np.ndarray, out_hi: np.ndarray, in_lo: np.ndarray,
                 in_hi: np.ndarray, pack: _SigPack, kclass: str, dtype: str, src_port: np.ndarray,
                 res: np.ndarray) -> None:
        self.op, self.n, self.f = op, f.shape[0], f
        self.dev = op.shards.device
        self.out_lo, self.out_hi, self.in_lo, self.in_hi = out_lo, out_hi, in_lo, in_hi
        self.pack, self.kclass, self.dtype, self.src_port, self.res = pack, kclass, dtype, src_port, res
        self._ports: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._mb: bool | None = None  # ``_microbatched``, found once
        self._box_ids: dict[str | None, bytes] = {}  # ``_boxes_key`` of its output (None) and input ports

    def input_boxes(self, port: str) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) int64[n, rank]: the boxes each shard reads through ``port``, clipped."""
        hit = self._ports.get(port)
        if hit is None:
            i = self.pack.port_index[port]
            r = self.pack.ranks[i]
            hit = self._ports[port] = (np.ascontiguousarray(self.in_lo[i, :, :r]),
                                       np.ascontiguousarray(self.in_hi[i, :, :r]))
        return hit


def _boxes_key(p: OpPiece, port: str | None) -> bytes:
    """``array_digest`` of the boxes (and their devices) ``p`` writes (``port`` None) or reads through
    ``port``, found once per piece."""
    k = p._box_ids.get(port)
    if k is None:
        lo, hi = (p.out_lo, p.out_hi) if port is None else p.input_boxes(port)
        k = p._box_ids[port] = array_digest(lo, hi, p.dev)
    return k


class GroupPiece:
    """Edges and transfers of one produced tensor (see ``_kernels.group_kernel``; its ``ints``
    rows kept as int32, of its ``flts`` the first five columns); ``counts`` int64[5] = (L, T, Q,
    K, C): K > 0 when its transfers run as C collectives, one per independent exchange, with K
    participants in all (``coll``
    float64[C, 8]: port seconds, latency, joules per byte, link mask, transfer rows, reader rows,
    participants, in place of each; ``parts`` float64[K, 2] = device, bytes received;
    ``collective`` the tuple of their :class:`CollectiveCost`; a last column 1 where the
    collective reduces partials of several microbatches, accumulated in place on each device
    first). Otherwise ``coll`` is one row of zeros."""

    __slots__ = ("counts", "ints", "flts", "coll", "parts", "collective")

    def __init__(self, counts: np.ndarray, ints: np.ndarray, flts: np.ndarray, coll: np.ndarray, parts: np.ndarray,
                 collective: Any = None) -> None:
        # int32 rows (shard, device and reader numbers) and the five columns of ``flts`` the
        # assembly reads (not the boxes' hashes and sums that the collectives were found by):
        # fewer bytes every plan's arrays copy (a 7B truncation's ~116,000 rows spliced and
        # assembled at each step)
        self.counts, self.ints = counts, ints.astype(np.int32)
        self.flts = np.ascontiguousarray(flts[:, :5])
        self.coll, self.parts, self.collective = coll, parts, collective


_NO_COLL = np.zeros((1, 8))
_NO_PARTS = np.zeros((0, 2))


def _exchanges(ints: np.ndarray, L: int, T: int, src: np.ndarray, n_devices: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The independent exchanges of a group's point-to-point transfers: the transfers among each
    set of devices that send to or receive from one another (under tensor x data parallelism,
    each replica's reduction inside its node), which NCCL runs as separate collectives on
    separate communicators. ``src``: the source device of each transfer row. Returns the exchange
    of each transfer row and of each reader row, numbered in order of first transfer, and their
    count."""
    t_ex, n = K.exchanges(np.ascontiguousarray(src, np.int64), np.ascontiguousarray(ints[L:L + T, 1], np.int64),
                          n_devices)
    return t_ex, t_ex[ints[L + T:, 0]], n


def _microbatched(piece: "OpPiece") -> bool:
    """An op's shards are microbatches: at least two per device on average
    (``ir.rewrites.pipeline.microbatch`` cuts each device's shard in ``m >= 2``). A shard moved
    beside another one (a device with two, the rest with one) is not: its group can still be a
    collective (one moved shard of a 512-way op left its whole group, ~250,000 transfers,
    point to point)."""
    mb = piece._mb
    if mb is None:
        mb = piece._mb = piece.n >= 2 * np.count_nonzero(np.bincount(piece.dev))
    return mb


def _one_per_box(sel: np.ndarray, src: np.ndarray, dst: np.ndarray, content: np.ndarray) -> np.ndarray:
    """The rows of ``sel`` (ascending), the first of each (source device, destination device,
    box carried): several microbatches' partials of one box, summed on their device before they
    are sent, move once."""
    key = np.stack([src[sel].astype(np.float64), dst[sel].astype(np.float64), content[sel]], axis=1)
    _, first = np.unique(key, axis=0, return_index=True)
    return sel[np.sort(first)]


def _rows_of(ex: np.ndarray, C: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of each of ``C`` exchanges (``ex``: the exchange of each row), in row order, as
    CSR (rows, ptr): one stable sort for all of them rather than a comparison of every row per
    exchange."""
    if C == 1:
        return np.arange(ex.shape[0]), np.array([0, ex.shape[0]])
    bounds = np.zeros(C + 1, np.int64)
    np.cumsum(np.bincount(ex, minlength=C), out=bounds[1:])
    return np.argsort(ex, kind="stable"), bounds


def _compact_collective(counts: np.ndarray, ints: np.ndarray, flts: np.ndarray, t_ex: np.ndarray,
                        q_ex: np.ndarray, C: int, totals: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A collective group's rows as ``_kernels.assemble`` reads them: its local edges, then for
    each of its ``C`` exchanges (``t_ex``/``q_ex``: the exchange of each transfer and reader row)
    one transfer row per producer shard it reads (the first row first: it names the op the
    collective feeds; the exchange's bytes ``totals[c]`` in its first row of ``flts``, zeros
    after) and one row per reader shard it feeds, each in first-occurrence order. The
    point-to-point pairs (every producer shard times every destination: quadratic in the ranks,
    750 MB of rows for Llama-2 70B on 512 GPUs) are not kept: the collectives' cost came from
    them already. Also returns the (transfer rows, reader rows) of each exchange. All exchanges
    at once, in one compiled pass (``_kernels.compact_collective``)."""
    kept, f, sizes = K.compact_collective(ints, int(counts[0]), int(counts[1]), int(counts[2]), t_ex, q_ex, C, flts,
                                          totals)
    out = counts.copy()
    out[1], out[2] = sizes.sum(axis=0)
    return out, kept, f, sizes


def _coll_rows(p: GroupPiece) -> np.ndarray:
    return p.coll


def _same_rows(a: np.ndarray) -> np.ndarray:
    return a


_first, _second = itemgetter(0), itemgetter(1)
_MISS = (None, None)  # a memo miss (``_memo_key``)
_role = attrgetter("role")
_flow_key = attrgetter("flow_key")

#: the lowering's six concatenated arrays (``_Cat``): which pieces (op, group or source), the rows
#: each piece contributes, and the empty array
_CATS = (("op", attrgetter("f"), np.zeros((0, 5))),
         ("group", attrgetter("ints"), np.zeros((0, 3), np.int32)),
         ("group", attrgetter("flts"), np.zeros((0, 5))),
         ("group", _coll_rows, np.zeros((0, 8))),
         ("group", attrgetter("parts"), _NO_PARTS),
         ("source", _same_rows, np.zeros(0)))


def same_data_flow(o: Op | None, old: Op) -> bool:
    """Whether ``o`` may replace ``old`` in a lowering structure (only shards differ)."""
    return o is not None and o.inputs == old.inputs and o.output == old.output and o.kernel == old.kernel and (
        o.params is old.params or o.params_key == old.params_key)


class _State:
    __slots__ = ("ops_map", "tensors", "struct", "ops", "op_pieces", "group_pieces", "source_pieces", "op_sizes",
                 "g_counts", "lowered", "cats", "_index")

    def index(self) -> dict[int, int]:
        """id of each of its ops -> the op's position (the state keeps its ops alive)."""
        idx = getattr(self, "_index", None)
        if idx is None:
            idx = self._index = dict(zip(map(id, self.ops), range(len(self.ops))))
        return idx


class _Sketch:
    """What a lowered plan leaves for its children once its state has left the recent ones: its
    ops, tensors and structure (all that ``derive_structure`` and ``_program_of_recent`` read)."""

    __slots__ = ("ops_map", "tensors", "struct", "ops", "_index")
    index = _State.index


class _Cat:
    """The row-wise concatenation of per-piece arrays, with each piece's first row (``off``).
    A child plan splices its changed pieces into its parent's (fast when few pieces change);
    either way the result is the concatenation of the pieces in order, bit for bit."""

    __slots__ = ("arr", "off")

    def __init__(self, arr: np.ndarray, off: np.ndarray) -> None:
        self.arr, self.off = arr, off

    @classmethod
    def of(cls, arrays: list[np.ndarray], empty: np.ndarray) -> "_Cat":
        if not arrays:
            return cls(empty, np.zeros(1, np.int64))
        off = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([a.shape[0] for a in arrays], out=off[1:])
        return cls(np.concatenate(arrays), off)

    def splice(self, changes: dict[int, np.ndarray], pieces: list | None = None) -> "_Cat":
        """``changes``: piece index -> its new rows. ``pieces``: all pieces' rows, given when a
        plain concatenation is cheaper (few pieces: NumPy's per-call costs dominate)."""
        if not changes:
            return self
        if pieces is not None and len(pieces) <= 64:  # rebuilt whole
            return _Cat.of(pieces, self.arr[:0])
        off = self.off
        keys = sorted(changes)
        if all(changes[i].shape[0] == off[i + 1] - off[i] for i in keys):
            arr = self.arr.copy()
            for i in keys:
                arr[off[i]:off[i + 1]] = changes[i]
            return _Cat(arr, off)
        parts, prev = [], 0
        sizes = np.diff(off)
        for i in keys:
            parts.append(self.arr[off[prev]:off[i]])
            parts.append(changes[i])
            sizes[i] = changes[i].shape[0]
            prev = i + 1
        parts.append(self.arr[off[prev]:])
        new_off = np.zeros_like(off)
        np.cumsum(sizes, out=new_off[1:])
        return _Cat(np.concatenate(parts), new_off)

    def remap(self, m: np.ndarray, pieces: list, rows: Callable[[Any], np.ndarray], empty: np.ndarray) -> "_Cat":
        """The concatenation of ``rows(p)`` for ``p`` in ``pieces``, where ``self`` is that of an
        earlier list and ``m[i]`` the index there of ``pieces[i]`` (-1: a new piece). A structural
        rewrite keeps most pieces of its parent in order: runs of consecutive indices are copied
        as one slice of ``self.arr``, so this is a few slices instead of thousands of small arrays."""
        n = len(pieces)
        if n == 0:
            return _Cat(empty, np.zeros(1, np.int64))
        off = self.off
        brk = np.ones(n, np.bool_)
        brk[1:] = (m[1:] != m[:-1] + 1) | (m[1:] < 0) | (m[:-1] < 0)
        starts = np.nonzero(brk)[0]
        ends = np.append(starts[1:], n)
        parts: list[np.ndarray] = []
        sizes = np.empty(n, np.int64)
        kept = m >= 0
        sizes[kept] = (off[1:] - off[:-1])[m[kept]]
        for a, b in zip(starts.tolist(), ends.tolist()):
            j = int(m[a])
            if j < 0:  # a new piece (a run of one)
                r = rows(pieces[a])
                parts.append(r)
                sizes[a] = r.shape[0]
            else:
                parts.append(self.arr[off[j]:off[j + b - a]])
        new_off = np.zeros(n + 1, np.int64)
        np.cumsum(sizes, out=new_off[1:])
        return _Cat(np.concatenate(parts) if len(parts) > 1 else parts[0].copy(), new_off)


# ---------------------------------------------------------------------------------------------
# the lowerer
# ---------------------------------------------------------------------------------------------


class Lowerer:
    """Lowers plans on one ``Hardware``; keeps pieces and recent plans for incremental lowering.

    ``lower(g)`` is the only entry point. ``states`` recent plans are searched for the closest
    one; ``cache_size`` bounds the per-piece caches (LRU). Every other memo is capped too
    (``PACKS_CAP``, ``PROGRAMS_CAP``, ``SKETCHES``, 512 structures, 256 io keys): a worker lowers millions of
    plans over a multi-day campaign and its memory must stay flat (issue 16).
    """

    #: signature packs kept (keyed by signature identity; oldest dropped first)
    PACKS_CAP = 4096
    #: logical programs numbered (oldest forgotten first; a forgotten program gets a new number)
    PROGRAMS_CAP = 1024
    SKETCHES = 64  # plans whose structures children may derive from (~0.5 MB each for a gpt-2 step)
    #: programs smaller than this keep no sketches: their structures come from the cache by key
    #: faster than a derivation (a 15-op transformer block: ~0.1 against ~0.4 ms)
    SKETCH_MIN_OPS = 200

    def __init__(self, hw: Hardware, cache_size: int = 8000, states: int = 6, collectives: bool = False,
                 curves: E.Curves | None = None, cache_bytes: float = 2e9, runtime: bool = False) -> None:
        self.hw = hw
        # runtime: price a plan as a production runtime runs it (what a search optimises; Evaluator):
        # weights-only ops folded at load time (ir.folding), contiguous slices as views, optimizer
        # updates and master-weight casts in multi-tensor kernels (``multi_tensor``). Off, as
        # this repository's executor runs it (every op each step, a slice a copy): what its
        # measurements are predicted with (optimizer.realrun, serial_prediction)
        self.runtime = runtime
        # group pieces hold every overlapping producer/reader shard pair of a tensor: at 512 GPUs tens
        # of MB each, so the piece cache is bounded by their bytes as well as by its entries
        self.cache_bytes = cache_bytes
        self._piece_bytes: dict[tuple, int] = {}
        self._bytes = 0
        self.collectives = collectives
        self.curves = curves  # shape-dependent efficiencies (costmodel.efficiency); None: the constants
        self._curve = curves.as_array() if curves is not None else E.OFF
        self._coll_cost: dict[tuple, C.CollectiveCost] = {}
        self._sized: dict[int, Any] = {}
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._alive: dict[tuple, Op] = {}  # op of an ("op", id) key whose piece is shared (see op_piece)
        self._packs: dict[int, _SigPack] = {}
        self._den: dict[tuple[str, str], tuple[float, float, float]] = {}
        self._states: deque[_State] = deque(maxlen=max(1, states))
        self._programs: dict[tuple, int] = {}
        self._keys: dict[int, tuple] = {}  # program number -> its key (for as long as _programs has it)
        self._structures: dict[tuple, Structure] = {}
        # (weak reference, sketch) of plans lowered lately, by id: a search mutates a few good
        # plans (its front) over and over, long after their states left the recent ones
        self._sketches: OrderedDict[int, tuple] = OrderedDict()
        self._link: tuple | None = None  # (plan, state, op map, group map) of the last derived structure
        self._logical: OrderedDict[int, tuple] = OrderedDict()
        self._unsubstituted: OrderedDict[int, tuple] = OrderedDict()
        self._io: dict[tuple, tuple] = {}
        hw_links = (hw.devices_per_node, hw.intra_link.latency, hw.intra_link.bandwidth,
                    hw.intra_link.energy_per_byte, hw.inter_link.latency, hw.inter_link.bandwidth,
                    hw.inter_link.energy_per_byte)
        self._links = hw_links
        self.stats = {"exact": 0, "incremental": 0, "fresh": 0}

    # -- caches ----------------------------------------------------------------------------
    def _cached(self, key: tuple, fn: Callable[[], Any]) -> Any:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        val = fn()
        self._cache[key] = val  # values keep the ops of their key alive, so ids stay unique
        self._trim()
        return val

    def _trim(self) -> None:
        """Drop the least recently used entries beyond ``cache_size`` entries or ``cache_bytes``."""
        cache, sizes = self._cache, self._piece_bytes
        while cache and (len(cache) > self.cache_size or self._bytes > self.cache_bytes):
            key, _ = cache.popitem(last=False)
            self._bytes -= sizes.pop(key, 0)
            self._alive.pop(key, None)

    def clear(self) -> None:
        self._cache.clear()
        self._alive.clear()
        self._piece_bytes.clear()
        self._bytes = 0
        self._states.clear()

    def _pack(self, sig: Signature) -> _SigPack:
        p = self._packs.get(id(sig))
        if p is None or p.sig is not sig:
            p = self._packs[id(sig)] = _SigPack(sig)
            if len(self._packs) > self.PACKS_CAP:
                self._packs.pop(next(iter(self._packs)))
        return p

    def _denominators(self, dtype: str, kclass: str) -> tuple[float, float, float]:
        d = self._den.get((dtype, kclass))
        if d is None:
            ce, me = self.hw.efficiency_for(kclass)
            if self.curves is not None:  # the curves replace the constant factors they model
                me = 1.0
                if class_family(kclass) == "matmul":
                    ce = 1.0
            d = self._den[(dtype, kclass)] = (self.hw.peak_flops(dtype) * ce, self.hw.device.mem_bandwidth * me,
                                              float(self.hw.launch_overhead_for(kclass)))
        return d

    # -- pieces ----------------------------------------------------------------------------
    def op_piece(self, g: Graph, o: Op, like: OpPiece | None = None) -> OpPiece:
        """``o``'s piece; ``like``: the piece of an op with the same kernel, params and inputs
        in the same tensors (its signature is reused instead of looked up). Ops with the same
        signature, shards and input roles share one piece (a piece is a function of these): the
        ops of equal layers, and the ops a structural move re-creates unchanged (whose group
        pieces are then found again by their boxes)."""
        key = ("op", id(o))
        cache = self._cache
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit
        if like is not None:
            pk, kclass, dtype, src_port = like.pack, like.kclass, like.dtype, like.src_port
        else:
            pk = self._pack(g.signature(o))
            kclass = kernel_class_of(o)
            dtype = compute_dtype(g, o)
            ins = o.input_map
            src_port = np.array([g.tensors[ins[p]].role in SOURCE_ROLES and not g.is_carried(ins[p])
                                 for p in pk.ports], np.bool_)
        multi = self.runtime and multi_tensor(g, o)
        sh = o.shards
        # the piece keeps ``pk`` alive, so its id stays unique while this entry lives
        shared = ("opc", id(pk), dtype, src_port.tobytes(), multi, sh.content_digest)
        piece = cache.get(shared)
        if piece is None:
            piece = cache[shared] = self._op_piece(o, pk, kclass, dtype, src_port, multi)
        else:
            cache.move_to_end(shared)
        cache[key] = piece
        self._alive[key] = o  # the piece may keep another op alive: this one's id must stay unique
        self._trim()
        return piece

    def _op_piece(self, o: Op, pk: _SigPack, kclass: str, dtype: str, src_port: np.ndarray,
                  multi: bool) -> OpPiece:
        check_op_size(o.name, pk.sig.extents)
        sh = o.shards
        if sh.lo.shape[1] != pk.n_dims:
            raise ValueError(f"op {o.name!r}: shards have rank {sh.lo.shape[1]}, its index space has "
                             f"{pk.n_dims} dims (validate the plan)")
        fden, bden, launch = self._denominators(dtype, kclass)
        if multi:
            launch /= MULTI_TENSOR
        f, out_lo, out_hi, in_lo, in_hi, bad, res = K.op_kernel(
            sh.lo, sh.hi, sh.device, pk.in_Ap, pk.in_An, pk.in_b, pk.in_s, pk.in_shape, pk.in_rank, pk.in_item,
            pk.out_Ap, pk.out_An, pk.out_b, pk.out_s, pk.out_shape, pk.out_item, pk.fpp, fden, bden, launch,
            self.hw.n_devices, src_port, self._curve, class_family(kclass) == "matmul")
        if bad >= 0:
            raise HardwareError(f"op {o.name!r} places a shard on device {bad}, but {self.hw.name!r} has "
                                f"devices 0..{self.hw.n_devices - 1}")
        if self.hw.staged_fusion and o.kernel == "fused":  # its stages run one by one (costmodel.efficiency)
            f[:, 1] = E.staged_fused_seconds(self.hw, pk.sig, o.params, kclass, dtype, f)
        elif self.runtime and o.kernel == "slice" and o.params.get("step", 1) == 1:
            # a contiguous slice is a view (``torch.narrow``; its readers take the strides): no
            # kernel, no launch, no traffic; its buffer stays counted (the viewed bytes live until
            # its readers end)
            f[:, 1] = 0.0
            f[:, 4] = 0.0
        return OpPiece(o, f, out_lo, out_hi, in_lo, in_hi, pk, kclass, dtype, src_port, res)

    def _group_piece(self, g: Graph, st: Structure, gi: int, ops: list[Op], pieces: list[OpPiece]) -> GroupPiece:
        prod, tensor, readers = st.groups[gi]
        state = bool(st.g_state[gi])  # state reads: the producer's boxes are the home
        # no batch rows in the tensor: a state, or made from states only (see the collective below)
        batch_free = state or all(map(g.is_carried, map(_second, ops[prod].inputs)))
        tag = "sgrp" if state else "bgrp" if batch_free else "grp"
        reduce = all(ops[r].kernel == "accumulate" for r, _ in readers)
        # keyed by what it is computed from: the boxes (and devices) the producer writes and each
        # reader reads, as digests of their content, so a structural move's new ops (and pieces) that
        # write or read as before find it again
        pp = pieces[prod]
        key = (tag, reduce, st.g_item[gi], _boxes_key(pp, None)) + tuple(
            [_boxes_key(pieces[r], port) for r, port in readers])
        cache = self._cache
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit
        if len(readers) == 1:  # the padded boxes (extra columns beyond the rank are ignored)
            r, port = readers[0]
            pc = pieces[r]
            i = pc.pack.port_index[port]
            c_lo, c_hi, c_dev = pc.in_lo[i], pc.in_hi[i], pc.dev
            r_counts = np.array([pc.n], np.int64)
        else:
            boxes = [pieces[r].input_boxes(port) for r, port in readers]
            c_lo = np.concatenate([b[0] for b in boxes])
            c_hi = np.concatenate([b[1] for b in boxes])
            c_dev = np.concatenate([pieces[r].dev for r, _ in readers])
            r_counts = np.array([pieces[r].n for r, _ in readers], np.int64)
        counts, ints, flts = K.group_kernel(pp.out_lo, pp.out_hi, pp.dev, c_lo, c_hi, c_dev, r_counts,
                                            self.hw.n_devices, st.g_item[gi], *self._links)
        counts = np.append(counts, (0, 0))
        coll, parts, cost = _NO_COLL, _NO_PARTS, None
        # a microbatched producer or reader (``_microbatched``): one collective per microbatch's
        # exchange among peers, found over shards, not devices (``shard_exchanges``), as
        # Megatron-LM runs each microbatch's tensor-parallel reductions and gathers (one over all
        # microbatches would wait for every one and serialise the pipeline; as point-to-point
        # transfers, a 70B 3D plan on 512 GPUs had 1.1 million). A group with an exchange from
        # some devices to others (a pipeline's send between stages, which Megatron-LM posts
        # rank to rank, in order: ``lookahead``'s port order) stays point to point. The reads of
        # what holds no batch (a loop-carried state, or an op computed from states only: a
        # weight's cast to bf16) are one collective for every microbatch on a device: the same
        # data, gathered once, as FSDP does.
        mb = _microbatched(pp) or (not batch_free and any(_microbatched(pieces[r]) for r, _ in readers))
        if self.collectives and counts[1] >= 2:
            coll, parts, cost, ex = self._collectives(counts, ints, flts, pp.dev, reduce, r_counts if mb else None)
            if cost is not None:
                counts[3], counts[4] = parts.shape[0], coll.shape[0]
                counts, ints, flts, sizes = _compact_collective(counts, ints, flts, *ex)
                coll[:, 4:6] = sizes
        piece = cache[key] = GroupPiece(counts, ints, flts, coll, parts, cost)
        self._piece_bytes[key] = size = ints.nbytes + flts.nbytes
        self._bytes += size
        self._trim()
        return piece

    def _collectives(self, counts, ints, flts, p_dev, reduce: bool, r_counts: np.ndarray | None = None):
        """(coll, parts, costs, (t_ex, q_ex, C, totals)) when a group's transfers are collectives,
        one per independent exchange (``_exchanges``; each must be one), else no collective. With
        ``r_counts`` (the reader shards of each reader: a microbatched group), the exchanges are
        found over shards (``_kernels.shard_exchanges``): one per microbatch."""
        none = _NO_COLL, _NO_PARTS, None, None
        in_place = False
        L, T, Q = int(counts[0]), int(counts[1]), int(counts[2])
        rows = ints[L:L + T]
        shard = rows[:, 0]
        src = p_dev[shard]
        dst = rows[:, 1]
        n_dev = self.hw.n_devices
        if np.count_nonzero(np.bincount(np.concatenate((src, dst)), minlength=n_dev)) < C.MIN_RANKS:
            return none  # the common case, decided without sorting
        if r_counts is None:
            t_ex, q_ex, n_ex = _exchanges(ints[:L + T + Q], L, T, src, n_dev)
        else:
            t_ex, n_ex = K.shard_exchanges(ints[:L + T + Q], L, T, p_dev.shape[0], r_counts,
                                           np.ascontiguousarray(p_dev, np.int64), n_dev)
            if n_ex < 0 and not reduce:
                return none
            if n_ex < 0:
                # partials of several microbatches reduced together (weight gradients under a
                # pipeline): each device adds its microbatches' partials into one buffer as they
                # come (Megatron-LM's main_grad), then the devices reduce those sums once, one
                # collective per exchange of devices, after their last microbatch
                in_place = True
                t_ex, q_ex, n_ex = _exchanges(ints[:L + T + Q], L, T, src, n_dev)
            else:
                q_ex = t_ex[ints[L + T:L + T + Q, 0]]
        order, ptr = _rows_of(t_ex, n_ex)
        if in_place:  # one copy of each (device, destination, box of the sum): the accumulated sum
            sels = [_one_per_box(order[a:b], src, dst, flts[:, 6]) for a, b in zip(ptr[:-1], ptr[1:])]
            order = np.concatenate(sels)
            np.cumsum([s.shape[0] for s in sels], out=ptr[1:])
        iv, fv, r_ptr, ranks, recv, n_ptr, per_node = K.exchange_facts(
            order, ptr, src, dst, shard, flts[:, 0], flts[:, 2], flts[:, 5], reduce, n_dev, self.hw.devices_per_node,
            C.MIN_RANKS)
        if not iv[:, 0].all():  # an exchange between two devices, or one not a collective
            return none
        if r_counts is not None and not in_place and not iv[:, 1].all():
            return none  # a microbatch's data sent to other devices: a pipeline's send
        rows_, costs = [], []
        r_ptr, n_ptr, per_node = r_ptr.tolist(), n_ptr.tolist(), per_node.tolist()
        for (code, _, links), (total, energy, b_nv, b_ib), r0, r1, n0, n1 in zip(
                iv.tolist(), fv.tolist(), r_ptr, r_ptr[1:], n_ptr, n_ptr[1:]):
            cost = self._collective(C.KINDS[code - 1], total, r1 - r0, per_node[n0:n1], b_nv if links & 1 else None,
                                    b_ib if links & 2 else None, float(recv[r0:r1].max()) if r1 > r0 else 0.0)
            rows_.append((cost.bandwidth_s, cost.latency_s, energy / total if total > 0 else 0.0,
                          1.0 if n1 - n0 == 1 else 3.0, 0.0, 0.0, r1 - r0, 1.0 if in_place else 0.0))
            costs.append(cost)
        return (np.array(rows_), np.stack([ranks.astype(np.float64), recv], axis=1), tuple(costs),
                (t_ex, q_ex, n_ex, fv[:, 0]))

    def _collective(self, kind: str, total: float, n_ranks: int, by_node: list[int], busiest_nv: float | None,
                    busiest_ib: float | None, most_received: float = 0.0) -> C.CollectiveCost:
        """The cost of one exchange run as collective ``kind``: ``total`` bytes as point-to-point
        transfers among ``n_ranks`` ranks, ``by_node`` of them on each node; ``busiest_*``: the
        most bytes a rank sends or receives over NVLink, over the NIC (all-to-all only);
        ``most_received``: the most bytes a rank receives (``collectives.buffer_bytes``)."""
        if kind == "all_to_all":  # its time depends on what each rank sends (the piece is cached)
            return C.pairwise_time(total, n_ranks, len(by_node), busiest_nv, busiest_ib, self.hw)
        ring = kind in ("reduce_scatter", "all_gather")
        S = C.buffer_bytes(total, n_ranks, most_received if ring else 0.0)
        ck = (kind, S, tuple(by_node))
        cost = self._coll_cost.get(ck)
        if cost is None:
            cost = self._coll_cost[ck] = C.collective_time(kind, S, by_node, self.hw)
            if len(self._coll_cost) > 4096:
                self._coll_cost.pop(next(iter(self._coll_cost)))
        return cost

    def _source_piece(self, g: Graph, st: Structure, si: int, ops: list[Op], pieces: list[OpPiece]) -> np.ndarray:
        tensor, readers = st.sources[si]
        home = st.source_home[si]
        if home >= 0:  # a loop-carried state: resident where its next value's producer writes it
            key = ("home", id(ops[home]), tensor)
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]

            def at_home():
                pp = pieces[home]
                shape = np.array(g.tensors[tensor].shape, np.int64)
                lo = np.clip(pp.out_lo, 0, shape)
                hi = np.clip(pp.out_hi, lo, shape)
                res = K.resident_kernel(lo, hi, pp.dev, self.hw.n_devices, float(ITEMSIZE[g.tensors[tensor].dtype]))
                return res, ops[home]

            return self._cached(key, at_home)[0]
        if len(readers) == 1:  # one reader: its piece has it
            r, port = readers[0]
            return pieces[r].res[pieces[r].pack.port_index[port]]
        key = ("src", tensor) + tuple((id(ops[r]), port) for r, port in readers)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit[0]

        def compute():
            boxes = [pieces[r].input_boxes(port) for r, port in readers]
            lo = np.concatenate([b[0] for b in boxes]) if len(boxes) > 1 else boxes[0][0]
            hi = np.concatenate([b[1] for b in boxes]) if len(boxes) > 1 else boxes[0][1]
            dev = np.concatenate([pieces[r].dev for r, _ in readers])
            res = K.resident_kernel(lo, hi, dev, self.hw.n_devices, float(ITEMSIZE[g.tensors[tensor].dtype]))
            return res, tuple(ops[r] for r, _ in readers)

        return self._cached(key, compute)[0]

    # -- structure -------------------------------------------------------------------------
    def _structure(self, g: Graph) -> Structure:
        """The structure of ``g``: derived from that of the plan ``g`` was made from when that plan
        is a recent state (``derive_structure``), else shared by plans with the same ops, kernels
        and data flow and the same program (cached: plans reached by other paths revisit a few)."""
        program = self.program_of(g)
        st = self._derived_structure(g, program)
        if st is None:
            key = (tuple(map(_flow_key, g.ops.values())), program)
            st = self._structures.get(key)
            if st is None:
                self._check_sizes(g)
                st = self._structures[key] = build_structure(g, program)
                if len(self._structures) > 512:
                    self._structures.pop(next(iter(self._structures)))
        # the piece cache must hold a few plans' worth of pieces, or a model larger than the
        # cap (a 32-layer training step has ~9,000) would be lowered afresh at every step
        self.cache_size = max(self.cache_size, 3 * (len(st.order) + len(st.g_prod) + len(st.s_home)))
        return st

    def program_of(self, g: Graph) -> int:
        """The number of ``g``'s program (equal numbers: equal programs; ``Lowered.program``)."""
        number = self._program_of_recent(g)
        return number if number is not None else self._program_number(self._program_key(g))

    def _origin_state(self, g: Graph) -> _State | None:
        """The recent state of the plan ``g`` was made from (``Graph.origin``), or None."""
        parent = g.origin() if g.origin is not None else None
        if parent is None:
            return None
        S = next((S for S in reversed(self._states) if S.ops_map is parent.ops), None)
        if S is not None:
            self._touch(S)
        return S

    def _origin_sketch(self, g: Graph) -> _State | _Sketch | None:
        """The state of the plan ``g`` was made from, else its sketch (``_Sketch``), or None."""
        S = self._origin_state(g)
        if S is not None or g.origin is None:
            return S
        parent = g.origin()
        hit = self._sketches.get(id(parent))
        if parent is None or hit is None or hit[0]() is not parent:
            return None
        return hit[1]

    def _sketch(self, g: Graph, st: Structure, ops: list) -> None:
        if len(ops) < self.SKETCH_MIN_OPS:
            return
        sk, key = self._sketches, id(g)
        hit = sk.get(key)
        if hit is not None and hit[0]() is g:
            sk.move_to_end(key)
            return
        K = _Sketch()
        K.ops_map, K.tensors, K.struct, K.ops, K._index = g.ops, g.tensors, st, ops, None
        sk[key] = (weakref.ref(g, lambda _r, key=key, sk=sk: sk.pop(key, None)), K)
        if len(sk) > self.SKETCHES:
            sk.popitem(last=False)

    def _touch(self, S: _State) -> None:
        """Keep state ``S`` as the most recent: a plan whose children are lowered one after
        another (a search keeps mutating a good parent) must not lose its state to them."""
        if self._states[-1] is not S:
            self._states.remove(S)
            self._states.append(S)

    def _program_of_recent(self, g: Graph) -> int | None:
        """``g``'s program from that of the state (or sketch) of its origin, or None."""
        S = self._origin_sketch(g)
        return None if S is None else self.program_from(g, S.ops_map, S.tensors, S.struct.program)

    def program_from(self, g: Graph, ops_map: Mapping[str, Op], tensors: Mapping[str, Any],
                     program: int) -> int | None:
        """``g``'s program from that of a plan it was made from (its ``ops_map``, ``tensors`` and
        program number), when they have the same sources and outputs: the same program when the
        ops ``g`` changed stand for the same logical entries as those they replaced (a fusion, a
        reduction split: they rewrite the plan, not the program), else the parent's key less the
        replaced ops' entries plus the new ones' (a substitution). None when that cannot be told.
        Keying a whole model's program took ~1 ms of every structural move of a gpt-2 step. Like
        the key, this takes ``g`` for a rewrite of that plan: an edit that rewires ops it keeps
        the names, kernels and params of would keep the program's number."""
        gops, memo, P = g.ops, self._logical, ops_map
        if g.tensors is not tensors and not _same_ends(g, tensors):
            return None
        origin = g.origin() if g.origin is not None and g.ops_delta is not None else None
        if origin is not None and origin.ops is P:  # what ``with_ops`` changed (unchanged ops cancel)
            replace, insert_after = g.ops_delta
            gone = [P[k] for k in replace if k in P]
            new = [o for k, o in replace.items() if o is not None and k in P]
            new += [o for a, extra in insert_after.items() if a in P for o in extra]
        else:
            names, vals = list(gops), list(gops.values())
            mask = list(map(is_not, map(P.get, names), vals))
            gone = [P[k] for k in compress(names, mask) if k in P] + [P[k] for k in P.keys() - gops.keys()]
            new = list(compress(vals, mask))
        before = []
        for o in gone:  # their entries as keyed with the parent (a miss: key g whole)
            hit = memo.get(id(o))
            if hit is None or hit[0] is not o:
                return None
            before.extend(hit[1])
        after = []
        for o in new:
            hit = memo.get(id(o))
            if hit is None or hit[0] is not o:
                hit = memo[id(o)] = (o, _logical_entries(o, g))
            after.extend(hit[1])
        if sorted(before) == sorted(after):
            return program
        key = self._keys.get(program)
        if key is not None and isinstance(key[0], frozenset):  # the parent's entries, all distinct
            entries = key[0].difference(before).union(after)
            if len(entries) == len(key[0]) - len(before) + len(after):  # still all distinct
                return self._program_number((entries, *key[1:]))
        return None

    def _program_number(self, key: tuple) -> int:
        number = self._programs.get(key)
        if number is None:
            number = self._programs[key] = next(_PROGRAM_SEQ)
            self._keys[number] = key
            if len(self._programs) > self.PROGRAMS_CAP:
                self._keys.pop(self._programs.pop(next(iter(self._programs))), None)
        return number

    def _check_sizes(self, g: Graph, names: list[str] | None = None) -> None:
        """``check_tensor_size`` of every tensor of ``g`` (or of those ``names`` it has) not
        checked before (tensors are shared between plans; the dict keeps them alive, so ids stay
        unique)."""
        sized = self._sized
        vals = list(g.tensors.values()) if names is None else [g.tensors[n] for n in names if n in g.tensors]
        for t in compress(vals, map(is_not, map(sized.get, map(id, vals)), vals)):
            check_tensor_size(t)
            sized[id(t)] = t
        if len(sized) > 4 * self.cache_size:
            sized.clear()

    def _derived_structure(self, g: Graph, program: int) -> Structure | None:
        """``g``'s structure derived from the state of its origin (``derive_structure``), with the
        op and group maps kept for ``_derive``; None when there is no such state or it cannot."""
        S = self._origin_sketch(g)
        if S is None:
            return None
        out = derive_structure(g, S.struct, S.ops, S.index(), S.tensors, program)
        if out is None:
            return None
        self._check_sizes(g, g.changed_tensors(S.tensors))  # (the parent's were checked)
        self._link = (g, S, out[1], out[2])
        return out[0]

    def _program_key(self, g: Graph) -> tuple:
        """``program_key(g)`` with per-op and per-tensors-mapping memos (ids kept alive)."""
        return self._memo_key(g, _logical_entries, self._logical)

    def unsubstituted_key(self, g: Graph) -> tuple:
        """A key of ``g``'s logical program without substitutions, ``unshard(g)``'s, found without
        unsharding (per-op memos): equal keys, equal programs. Plans that differ only in which
        layers have fused attention share it (so ``Evaluator`` shares their program facts)."""
        return self._memo_key(g, _unsubstituted_entries, self._unsubstituted)

    def _memo_key(self, g: Graph, entries: Callable[[Op, Graph], list[tuple]], memo: OrderedDict) -> tuple:
        # room for a few whole models: a 70B training step keys ~9,500 ops, more than the piece
        # cache's size (set by the truncations it lowers), and a memo smaller than one model misses always
        cap = max(self.cache_size, 3 * len(g.ops))
        ops = list(g.ops.values())
        hits = list(map(memo.get, map(id, ops), repeat(_MISS)))  # (op, its entries or None: they depend on g)
        for i in list(compress(range(len(ops)), map(is_not, map(_first, hits), ops))):
            o = ops[i]
            dyn = entries is not _logical_entries and _entries_read_graph(o)
            hits[i] = memo[id(o)] = (o, None if dyn else entries(o, g))
            if len(memo) > cap:
                memo.popitem(last=False)
        logical = list(chain.from_iterable(filter(None, map(_second, hits))))
        if entries is not _logical_entries:
            for o in list(compress(ops, map(is_, map(_second, hits), repeat(None)))):
                if not _attention_grad_of_fused(o, g):
                    logical.extend(entries(o, g))
        # sources and outputs: rewrites copy the tensors mapping but share these Tensor objects
        ends = Ends(_ends(g))
        io = self._io.get(ends)
        if io is None:
            io = self._io[ends] = (ends, _io_key(g))
            if len(self._io) > 256:
                self._io.pop(next(iter(self._io)))
        # a set, not a sorted tuple: entries name their ops, so they are unique (sorting ten
        # thousand of them took ~20 ms of every structural move on a whole 70B model); sorted
        # where some entry repeats, so equal multisets still give equal keys
        entries_set = frozenset(logical)
        return (entries_set if len(entries_set) == len(logical) else tuple(sorted(logical))), io[1], io[0]

    def _find_base(self, g: Graph) -> tuple[_State | None, list[int] | None]:
        """The recent state ``g`` differs least from (same ops and tensors), and the changed ops.
        A graph whose parent is a recent state and which replaced some of its ops in place
        (``Graph.edit``) is lowered from that state, looking only at the replaced ops."""
        gops = g.ops
        parent = g.edit.parent() if g.edit is not None else None
        if parent is not None and parent.tensors is g.tensors:
            for S in reversed(self._states):
                if S.ops_map is parent.ops:
                    self._touch(S)
                    pos = S.struct.position
                    changed = sorted(pos[n] for n in g.edit.replaced if gops[n] is not S.ops[pos[n]])
                    if all(same_data_flow(gops[S.struct.order[i]], S.ops[i]) for i in changed):
                        return S, changed
                    break
        best, best_changed = None, None
        for S in reversed(self._states):
            if S.ops_map is gops:
                return S, []
            st = S.struct
            if g.tensors is not S.tensors or len(gops) != len(st.keys):
                continue
            changed = [i for i, (o, old) in enumerate(zip(map(gops.get, st.order), S.ops)) if o is not old]
            ok = all(same_data_flow(gops.get(st.order[i]), S.ops[i]) for i in changed)
            if not ok or tuple(gops) != st.keys:
                continue
            if best_changed is None or len(changed) < len(best_changed):
                best, best_changed = S, changed
                if len(changed) <= 1:
                    break
        return best, best_changed

    # -- whole plan ------------------------------------------------------------------------
    def lower(self, g: Graph) -> Lowered:
        if self.runtime:  # weights-only ops run once, at load time, not in the step (ir.folding)
            g = fold_constants(g)
        base, changed = self._find_base(g)
        if base is not None and not changed:
            self.stats["exact"] += 1
            if base.ops_map is not g.ops:  # same ops in a new dict: remember it too
                self._push(g, base.struct, base.ops, base.op_pieces, base.group_pieces, base.source_pieces,
                           base.op_sizes, base.g_counts, base.lowered, base.cats)
            else:  # the most recent state is the plan just lowered (``costmodel.explain`` reads it)
                self._touch(base)
            return base.lowered
        if base is None:
            self.stats["fresh"] += 1
            st = self._structure(g)
            ops = list(g.ops.values()) if st.order is st.keys else list(map(g.ops.__getitem__, st.order))
            get = self._cache.get
            # the state of the plan this one was made from, else the recent one closest in size
            # (most pieces are its pieces; with layers="repeat" states alternate between two truncations)
            last = self._origin_state(g) or min(reversed(self._states), key=lambda S: abs(len(S.ops) - len(ops)),
                                                default=None)
            if last is not None:
                op_pieces, group_pieces, source_pieces, op_sizes, g_counts, cats = self._derive(g, st, ops, last)
            else:
                op_pieces = [get(("op", id(o))) or self.op_piece(g, o) for o in ops]
                group_pieces = [self._group_piece(g, st, gi, ops, op_pieces) for gi in range(len(st.g_prod))]
                source_pieces = [self._source_piece(g, st, si, ops, op_pieces) for si in range(len(st.s_home))]
                op_sizes = np.array([p.n for p in op_pieces], np.int64)
                g_counts = (np.stack([p.counts for p in group_pieces]) if group_pieces
                            else np.zeros((0, 5), np.int64))
                now = {"op": op_pieces, "group": group_pieces, "source": source_pieces}
                cats = tuple(_Cat.of([rows(p) for p in now[k]], empty) for k, rows, empty in _CATS)
        else:
            self.stats["incremental"] += 1
            st = base.struct
            ops = list(base.ops)
            op_pieces = list(base.op_pieces)
            group_pieces = list(base.group_pieces)
            source_pieces = list(base.source_pieces)
            op_sizes = base.op_sizes.copy()
            g_counts = base.g_counts.copy()
            get = self._cache.get
            for i in changed:
                old = ops[i]
                o = ops[i] = g.ops[st.order[i]]
                p = get(("op", id(o))) or self.op_piece(g, o, op_pieces[i] if o.params is old.params else None)
                op_pieces[i] = p
                op_sizes[i] = p.n
            if len(changed) == 1:
                tg, ts = st.op_groups(changed[0]), st.op_sources(changed[0])
            else:
                tg = sorted({x for i in changed for x in st.op_groups(i)})
                ts = sorted({x for i in changed for x in st.op_sources(i)})
            for gi in tg:
                group_pieces[gi] = p = self._group_piece(g, st, gi, ops, op_pieces)
                g_counts[gi] = p.counts
            for si in ts:
                source_pieces[si] = self._source_piece(g, st, si, ops, op_pieces)
            c_op, c_gi, c_gf, c_gc, c_gp, c_res = base.cats
            gp = {gi: group_pieces[gi] for gi in tg}
            small = len(group_pieces) <= 64  # few pieces: concatenate them all (cheaper than splicing)
            cats = (c_op.splice({i: op_pieces[i].f for i in changed}, [p.f for p in op_pieces] if small else None),
                    c_gi.splice({gi: p.ints for gi, p in gp.items()},
                                [p.ints for p in group_pieces] if small else None),
                    c_gf.splice({gi: p.flts for gi, p in gp.items()},
                                [p.flts for p in group_pieces] if small else None),
                    c_gc.splice({gi: p.coll for gi, p in gp.items()},
                                [p.coll for p in group_pieces] if small else None),
                    c_gp.splice({gi: p.parts for gi, p in gp.items()},
                                [p.parts for p in group_pieces] if small else None),
                    c_res.splice({si: source_pieces[si] for si in ts}, source_pieces if small else None))
        low = self._assemble(st, cats, op_sizes, g_counts)
        self._push(g, st, ops, op_pieces, group_pieces, source_pieces, op_sizes, g_counts, low, cats)
        return low

    @staticmethod
    def _group_map(st: Structure, P: Structure, c2p: np.ndarray) -> np.ndarray:
        """Per group of ``st``: the group of ``P`` with the same producer (or home), state flag,
        tensor, itemsize and readers (the same ops, ports, in order), or -1."""
        pos = c2p[st.g_prod]
        safe = np.maximum(pos, 0)
        pg = np.where(st.g_state == 1, P.group_of_home[safe], P.group_of_producer[safe])
        pg[pos < 0] = -1
        cnt_c, cnt_p = np.diff(st.g_rptr), np.diff(P.g_rptr)
        idx = np.nonzero(pg >= 0)[0]
        idx = idx[(cnt_c[idx] == cnt_p[pg[idx]]) & (st.g_item[idx] == P.g_item[pg[idx]])
                  & (st.g_tensor[idx] == P.g_tensor[pg[idx]]).astype(np.bool_)]
        if idx.size:
            cnt = cnt_c[idx]
            first = np.cumsum(cnt) - cnt
            within = np.arange(int(cnt.sum())) - np.repeat(first, cnt)
            ce = np.repeat(st.g_rptr[idx], cnt) + within
            pe = np.repeat(P.g_rptr[pg[idx]], cnt) + within
            same = (c2p[st.g_rop[ce]] == P.g_rop[pe]) & (st.g_rport[ce] == P.g_rport[pe]).astype(np.bool_)
            idx = idx[np.logical_and.reduceat(same, first)]
        gmap = np.full(len(st.g_prod), -1, np.int64)
        gmap[idx] = pg[idx]
        return gmap

    def _derive(self, g: Graph, st: Structure, ops: list[Op], last: _State) -> tuple:
        """A fresh structure's pieces and arrays, taken from ``last`` (a recent state, usually the
        parent) wherever they are the same: an op kept (the same object) keeps its piece; a group
        with the same producer, state flag and readers (kept ops, same ports, in order) keeps its
        piece and counts; a state's home source whose home op is kept keeps its piece. The rest is
        looked up or computed as in a fresh lowering, so the arrays are bit-identical to one."""
        P = last.struct
        get = self._cache.get
        link, self._link = self._link, None
        if link is not None and link[0] is g and link[1] is last:  # the structure was derived from last's
            c2p, gmap = link[2], link[3]
        else:
            c2p = np.fromiter(map(last.index().get, map(id, ops), itertools.repeat(-1)), np.int64, len(ops))
            gmap = self._group_map(st, P, c2p)
        # kept pieces by one C-level pass (j = -1 takes a placeholder), then the new ones
        op_pieces = _take(last.op_pieces, c2p)
        new_ops = np.nonzero(c2p < 0)[0].tolist()
        for i in new_ops:
            o = ops[i]
            op_pieces[i] = get(("op", id(o))) or self.op_piece(g, o)
        group_pieces = _take(last.group_pieces, gmap)
        for gi in np.nonzero(gmap < 0)[0].tolist():
            group_pieces[gi] = self._group_piece(g, st, gi, ops, op_pieces)
        g_counts = np.empty((len(group_pieces), 5), np.int64)
        kept = gmap >= 0
        g_counts[kept] = last.g_counts[gmap[kept]]
        for gi in np.nonzero(~kept)[0].tolist():
            g_counts[gi] = group_pieces[gi].counts
        # sources: a state's home piece follows its home op and tensor
        hpos = c2p[np.maximum(st.s_home, 0)]
        smap = np.where((st.s_home >= 0) & (hpos >= 0), P.source_of_home[np.maximum(hpos, 0)], -1)
        ok = smap >= 0
        ok[ok] = (st.s_tensor[ok] == P.s_tensor[smap[ok]]).astype(np.bool_)
        smap[~ok] = -1
        source_pieces = _take(last.source_pieces, smap)
        for si in np.nonzero(smap < 0)[0].tolist():
            source_pieces[si] = self._source_piece(g, st, si, ops, op_pieces)
        op_sizes = last.op_sizes[c2p]
        for i in new_ops:
            op_sizes[i] = op_pieces[i].n
        now = {"op": (op_pieces, c2p), "group": (group_pieces, gmap), "source": (source_pieces, smap)}
        cats = tuple(c.remap(now[k][1], now[k][0], rows, empty) for c, (k, rows, empty) in zip(last.cats, _CATS))
        return op_pieces, group_pieces, source_pieces, op_sizes, g_counts, cats

    def _push(self, g, st, ops, op_pieces, group_pieces, source_pieces, op_sizes, g_counts, low, cats) -> None:
        S = _State()
        S.ops_map, S.tensors, S.struct, S.ops, S.op_pieces = g.ops, g.tensors, st, ops, op_pieces
        S.group_pieces, S.source_pieces, S.op_sizes, S.g_counts, S.lowered, S.cats = (
            group_pieces, source_pieces, op_sizes, g_counts, low, cats)
        self._states.append(S)
        self._sketch(g, st, ops)

    def _assemble(self, st: Structure, cats: tuple, op_sizes, g_counts) -> Lowered:
        n_dev = self.hw.n_devices
        op_f, g_ints, g_flts, g_coll, c_parts, res = (c.arr for c in cats)
        kind, i32, f64, ptr, idx, resident, ints, flts, link, pptr, pdev, palloc = K.assemble(
            op_sizes, op_f, st.g_prod, st.g_rptr, st.g_rop, g_counts, g_ints, g_flts, res, n_dev, st.g_state,
            st.op_inplace, g_coll, c_parts)
        low = Lowered(kind, i32, f64, ptr, idx, resident, ints, flts, n_dev, st.order, st.program, link, pptr, pdev,
                      palloc)
        acc = np.zeros(kind.shape[0], np.bool_)
        nc = int(ints[len(st.order)])
        acc[:nc] = np.repeat(st.op_acc, op_sizes)
        if g_coll[:, 7].any():  # collectives that microbatches' partials are accumulated into
            coll = g_counts[:, 3] > 0  # per group: C collective nodes and C rows, else T nodes and one row
            nodes = np.where(coll, g_counts[:, 4], g_counts[:, 1])
            rows = np.where(coll, g_counts[:, 4], 1)
            acc[nc:][np.repeat(coll, nodes)] = g_coll[np.repeat(coll, rows), 7] > 0
        low.acc = acc
        low.flow = (st.g_prod, st.g_rptr, st.g_rop, st.g_state)
        low.op_reads, low.op_split = st.op_reads, st.op_split
        low.contention = self.hw.contention
        return low


def _take(items: list, idx: np.ndarray) -> list:
    """``items[j]`` for each ``j`` of ``idx``; where ``j`` is -1, a placeholder to fill."""
    return list(map(items.__getitem__, idx.tolist())) if items else [None] * len(idx)


def lower(g: Graph, hw: Hardware) -> Lowered:
    """One-shot lowering (a fresh ``Lowerer``)."""
    return Lowerer(hw).lower(g)


def warmup() -> float:
    """Compile (or load from numba's cache) the lowering kernels in this process; seconds spent.
    About half a second with a warm on-disk cache, tens of seconds on a cold one."""
    import time

    from costmodel.presets import PRESETS
    from ir.builder import GraphBuilder
    from ir.rewrites import retile

    t0 = time.perf_counter()
    b = GraphBuilder()
    y = b.matmul(b.input("x", (4, 4)), b.parameter("W", (4, 4)), name="mm")
    b.add(y, b.input("z", (4, 4)), name="add")
    b.add(y, y, name="twice")
    g = retile(retile(b.build(), "mm", [2, 1], [0, 1]), "add", [1, 2], [1, 0])
    Lowerer(PRESETS["h100-sxm-8"]).lower(g)
    K.union_volume(np.array([[0, 0], [1, 1]]), np.array([[2, 2], [3, 3]]))
    return time.perf_counter() - t0
