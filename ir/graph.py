"""The block graph: logical tensors, operations, and each operation's shards.

Node kinds and fields (the one place they are defined):

- ``Tensor(name, shape, dtype, role)``: a whole logical tensor. ``role`` is ``input``
  (activations fed in: the batch, targets, token ids), ``parameter`` (weights), ``state``
  (optimizer state such as AdamW's moments), ``intermediate`` or ``output``. Inputs, parameters
  and states are *sources*: they have no producer; every other tensor has exactly one.
- **Loop-carried state.** A training step reads a parameter or state tensor ``P`` and writes its
  next value into the output tensor ``P.next`` (``carried`` maps ``P -> P.next``). ``P`` then
  lives where the shards of ``P.next``'s producer write it (the update op's sharding *is* the
  state's layout: replicated = data parallel, sharded = ZeRO/FSDP), so reading a box of ``P`` on
  another device is a transfer. Sources without a next value (the batch; weights of a forward-only
  program) stay resident wherever they are read.
- ``Op(name, kernel, params, inputs, output, shards)``: one block operation. ``inputs`` maps the
  kernel's port names to tensor names, ``output`` names the tensor it writes (port ``y``).
  ``params`` is plain JSON data (never mutated). The kernel's signature, derived from the input
  tensors' specs, gives the index space and the projections.
- ``Shards(lo, hi, device)``: ``n`` index sub-boxes as ``(n, d)`` int64 arrays plus a device
  number each. They partition the op's index space. Arrays are read-only and shared between a
  graph and the graphs rewritten from it (copy-on-write: a rewrite of one op copies only that
  op's shards and a dict of references).

There are no slice or concat nodes: a shard reads and writes boxes of whole logical tensors.
Graphs are immutable; ``Graph.with_ops`` returns a new graph sharing everything unchanged. A graph
made by replacing ops in place keeps ``edit`` (``Edit``: a weak reference to its parent and the
replaced names), so a consumer that processed the parent can process only what changed.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress
from operator import is_not
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from ir.kernels import DTYPES, TensorSpec, cached_signature
from ir.kernels.base import Signature
from ir.zspace import ZRange

FORMAT = "tapestry-graph/1"
ROLES = ("input", "parameter", "state", "intermediate", "output")
SOURCE_ROLES = ("input", "parameter", "state")
STATE_ROLES = ("parameter", "state")
NEXT_SUFFIX = ".next"


def next_name(tensor: str) -> str:
    """The name of a loop-carried tensor's next value (``W1`` -> ``W1.next``)."""
    return tensor + NEXT_SUFFIX
DTYPES_OK = DTYPES


# canonical text: ``json.dumps(x, sort_keys=True, separators=(",", ":"))``, without the encoder that
# each such call builds (a name and a small dict: 9.4 -> 3.0 us; an op's text writes four names)
_compact_json = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    role: str = "intermediate"

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "role": self.role}

    @cached_property
    def canonical_text(self) -> str:
        """Sorted, whitespace-free JSON, cached: plans share their Tensor objects, and every plan a
        search makes is digested (``Graph.canonical_json``)."""
        return _compact_json(self.to_json())

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("canonical_text", None)  # (a memo)
        return state


def array_digest(*arrays: np.ndarray) -> bytes:
    """A 128-bit digest of ``arrays`` (dtypes, shapes, bytes): a cache key that stays small where a
    table of 512 shards' boxes is tens of kB (equal digests of unequal tables: odds of 2^-128)."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).data)
    return h.digest()


def _frozen(a: np.ndarray, dtype: Any) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=dtype)
    a.flags.writeable = False
    return a


class Shards:
    """Immutable shard table of one op: boxes ``[lo[i], hi[i])`` on ``device[i]``."""

    __slots__ = ("lo", "hi", "device", "_text", "_digest")

    def __init__(self, lo: Any, hi: Any, device: Any) -> None:
        lo = np.asarray(lo, dtype=np.int64)
        n = len(device) if not isinstance(device, int) else 1
        self.lo = _frozen(lo.reshape(n, -1) if lo.size or n == 0 else lo.reshape(n, 0), np.int64)
        self.hi = _frozen(np.asarray(hi, dtype=np.int64).reshape(self.lo.shape), np.int64)
        self.device = _frozen(np.asarray(device, dtype=np.int64).reshape(n), np.int64)

    @classmethod
    def whole(cls, extents: Iterable[int], device: int = 0) -> Shards:
        """One shard covering ``extents`` on ``device`` (shared: shard tables are immutable)."""
        return _whole_shards(tuple(int(e) for e in extents), int(device))

    def __len__(self) -> int:
        return self.device.shape[0]

    @property
    def ndim(self) -> int:
        return self.lo.shape[1]

    def box(self, i: int) -> ZRange:
        return ZRange(self.lo[i], self.hi[i])

    def boxes(self) -> Iterator[ZRange]:
        return (self.box(i) for i in range(len(self)))

    def with_devices(self, device: Any) -> Shards:
        s = Shards.__new__(Shards)
        s.lo, s.hi = self.lo, self.hi  # shared, read-only
        s.device = _frozen(np.asarray(device, dtype=np.int64).reshape(len(self)), np.int64)
        return s

    def to_json(self) -> dict:
        return {"lo": self.lo.tolist(), "hi": self.hi.tolist(), "device": self.device.tolist()}

    @property
    def canonical_text(self) -> str:
        """Sorted, whitespace-free JSON, cached: most ops a structural rewrite re-creates keep
        their shard table object, and writing a 64-shard table is most of writing an op's text."""
        try:
            return self._text
        except AttributeError:
            self._text = text = _compact_json(self.to_json())
            return text

    @property
    def content_digest(self) -> bytes:
        """``array_digest(lo, hi, device)``, cached (the cost model keys its pieces by it)."""
        try:
            return self._digest
        except AttributeError:
            self._digest = d = array_digest(self.lo, self.hi, self.device)
            return d

    def __getstate__(self) -> tuple[None, dict]:
        return None, {"lo": self.lo, "hi": self.hi, "device": self.device}  # not the memos

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Shards) and np.array_equal(self.lo, other.lo)
                and np.array_equal(self.hi, other.hi) and np.array_equal(self.device, other.device))

    def __repr__(self) -> str:
        return f"Shards(n={len(self)}, devices={sorted(set(self.device.tolist()))})"


@functools.lru_cache(maxsize=4096)
def _whole_shards(extents: tuple[int, ...], device: int) -> Shards:
    return Shards([[0] * len(extents)], [list(extents)], [device])


@dataclass(frozen=True, eq=False)
class Op:
    name: str
    kernel: str
    inputs: tuple[tuple[str, str], ...]  # (port, tensor name), in port order
    output: str
    params: Mapping[str, Any] = field(default_factory=dict)
    shards: Shards | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple((str(p), str(t)) for p, t in self.inputs))

    @cached_property
    def params_key(self) -> str:
        return _compact_json(self.params)

    @cached_property
    def flow_key(self) -> tuple:
        """``(name, kernel, inputs, output)``: what the op is in the data flow, shards and params aside."""
        return (self.name, self.kernel, self.inputs, self.output)

    @property
    def input_map(self) -> dict[str, str]:
        return dict(self.inputs)

    def replace(self, **changes: Any) -> Op:
        d = {"name": self.name, "kernel": self.kernel, "inputs": self.inputs, "output": self.output,
             "params": self.params, "shards": self.shards}
        d.update(changes)
        new = Op(**d)
        # memos that only kernel, params and inputs decide carry over (rewrites mostly move shards)
        if new.params is self.params and new.kernel == self.kernel:
            mine, theirs = self.__dict__, new.__dict__
            if "params_key" in mine:
                theirs["params_key"] = mine["params_key"]
            if new.inputs == self.inputs and new.name == self.name and new.output == self.output \
                    and "flow_key" in mine:
                theirs["flow_key"] = mine["flow_key"]
            if new.inputs == self.inputs:
                for memo in ("_sig", "_batch"):
                    if memo in mine:
                        theirs[memo] = mine[memo]
        return new

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for memo in ("_sig", "_batch", "_lentry", "_moved", "_mbstarts", "_mbids"):  # memos (Graph.signature,
            state.pop(memo, None)  # batch_dims, ir.layers, costmodel.lookahead): not worth their bytes
        return state

    def to_json(self) -> dict:
        return {"name": self.name, "kernel": self.kernel, "params": self.params,
                "inputs": {p: t for p, t in self.inputs}, "output": self.output,
                "shards": self.shards.to_json() if self.shards is not None else None}

    @cached_property
    def canonical_text(self) -> str:
        """``json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))``, written field by
        field in sorted-key order from the params' and shards' cached texts."""
        shards = "null" if self.shards is None else self.shards.canonical_text
        return (f'{{"inputs":{_compact_json(dict(self.inputs))},"kernel":{_compact_json(self.kernel)},'
                f'"name":{_compact_json(self.name)},"output":{_compact_json(self.output)},'
                f'"params":{self.params_key},"shards":{shards}}}')


@dataclass(frozen=True)
class Edit:
    """How a graph was made from its parent by ``Graph.with_ops`` when the edit replaced some ops
    by ops of the same names and changed nothing else (the shard moves of a search): ``parent``
    (a weak reference: lineage must not keep ancestors alive) and the replaced op names. Consumers
    such as the cost model's incremental lowering use it to find what changed without comparing
    every op."""

    parent: weakref.ref
    replaced: tuple[str, ...]


class Graph:
    """An immutable block graph. Build with ``GraphBuilder``; change with ``ir.rewrites``.
    ``edit``: an :class:`Edit` when ``with_ops`` replaced ops in place, else None."""

    def __init__(self, tensors: Mapping[str, Tensor], ops: Mapping[str, Op]) -> None:
        self.tensors: Mapping[str, Tensor] = tensors
        self.ops: Mapping[str, Op] = ops
        self.edit: Edit | None = None
        #: the graph ``with_ops`` made this one from (a weak reference), or None: lineage for
        #: consumers that derive a child's facts from its parent's (the cost model)
        self.origin: weakref.ref | None = None
        #: (the tensors of the graph ``with_ops`` made this one from, the names it changed there):
        #: see ``changed_tensors``
        self.tensor_delta: tuple[Mapping[str, Tensor], tuple[str, ...]] | None = None
        #: ``(replace, insert_after)`` that ``with_ops`` turned the graph ``origin`` into this one
        #: with, or None (unknown): consumers re-derive only what those ops touch
        self.ops_delta: tuple[dict[str, Op | None], dict[str, list[Op]]] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_backward_index", None)  # memos (ir.rewrites.substitute_attention, ir.folding)
        state.pop("_folded", None)
        state["edit"] = None  # lineage is local to a process (a weak reference)
        state["origin"] = None
        state["tensor_delta"] = None
        state["ops_delta"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("tensor_delta", None)  # (pickles made before they existed)
        state.setdefault("ops_delta", None)
        self.__dict__.update(state)

    def changed_tensors(self, other: Mapping[str, Tensor]) -> list[str]:
        """Names whose tensor differs between this graph's tensors and ``other`` (a tensor table
        sharing most objects, such as its parent's): added, removed or replaced. Known without
        comparing every tensor when ``with_ops`` made this graph from a graph with ``other``."""
        mine = self.tensors
        if mine is other:
            return []
        delta = self.tensor_delta
        if delta is not None and delta[0] is other:
            return list(delta[1])
        names = list(mine)
        out = list(compress(names, map(is_not, map(other.get, names), mine.values())))
        return out + [n for n in other.keys() - mine.keys()]

    # -- derived views (cached per graph; cheap: O(ops), never O(shards)) ------------------
    def signature(self, op: str | Op) -> Signature:
        o = self.ops[op] if isinstance(op, str) else op
        tensors = self.tensors
        ts = tuple([tensors[t] for _, t in o.inputs])
        # memo on the op, keyed by its input tensors (equal Tensors: equal specs); ops are shared
        # by the plans of a search, so most calls end here
        hit = o.__dict__.get("_sig")
        if hit is not None and hit[0] == ts:
            return hit[1]
        sig = cached_signature(o.kernel, o.params_key, tuple((p, t.spec) for (p, _), t in zip(o.inputs, ts)))
        o.__dict__["_sig"] = (ts, sig)
        return sig

    @cached_property
    def producers(self) -> dict[str, str]:
        return {o.output: o.name for o in self.ops.values()}

    @cached_property
    def consumers(self) -> dict[str, list[tuple[str, str]]]:
        """tensor -> [(op, port)] readers, in op order."""
        out: dict[str, list[tuple[str, str]]] = {t: [] for t in self.tensors}
        for o in self.ops.values():
            for port, t in o.inputs:
                out.setdefault(t, []).append((o.name, port))
        return out

    @cached_property
    def carried(self) -> dict[str, str]:
        """Loop-carried state: source ``P`` (parameter or state) -> its produced next value ``P.next``."""
        return {n: next_name(n) for n, t in self.tensors.items()
                if t.role in STATE_ROLES and next_name(n) in self.producers}

    def is_carried(self, tensor: str) -> bool:
        """``tensor in self.carried``, without building the map on a new graph: a parameter or
        state whose next value is a produced tensor (in a valid graph every tensor that is not a
        source is produced)."""
        if "carried" in self.__dict__:
            return tensor in self.__dict__["carried"]
        ts = self.tensors
        t = ts.get(tensor)
        if t is None or t.role not in STATE_ROLES:
            return False
        nxt = ts.get(next_name(tensor))
        return nxt is not None and nxt.role not in SOURCE_ROLES

    @cached_property
    def topo_order(self) -> tuple[str, ...]:
        """Operations in dependency order: *program order*, the order that always takes the
        earliest op (in op order) whose inputs are ready. Builders and rewrites keep op order
        topological, so this is usually op order itself, found in one pass. Raises on a cycle."""
        names = list(self.ops)
        ops = list(self.ops.values())
        prod = {o.output: i for i, o in enumerate(ops)}  # on op indices
        if all(prod.get(t, -1) < i for i, o in enumerate(ops) for _, t in o.inputs):
            return tuple(names)
        indeg = [0] * len(names)
        succ: list[list[int]] = [[] for _ in names]
        for i, o in enumerate(ops):
            preds = {prod[t] for _, t in o.inputs if t in prod}
            indeg[i] = len(preds)
            for p in preds:
                succ[p].append(i)
        ready = [i for i, d in enumerate(indeg) if d == 0]  # a heap on op positions
        order: list[int] = []
        while ready:
            n = heapq.heappop(ready)
            order.append(n)
            for m in succ[n]:
                indeg[m] -= 1
                if indeg[m] == 0:
                    heapq.heappush(ready, m)
        if len(order) != len(names):
            done = {names[i] for i in order}
            raise ValueError(f"the graph has a cycle through {sorted(set(names) - done)}")
        return tuple([names[i] for i in order])

    @property
    def n_shards(self) -> int:
        return sum(len(o.shards) for o in self.ops.values())

    @property
    def devices(self) -> set[int]:
        s: set[int] = set()
        for o in self.ops.values():
            s.update(o.shards.device.tolist())
        return s

    # -- copy-on-write edits -----------------------------------------------------------
    def with_ops(self, replace: Mapping[str, Op | None] = (), insert_after: Mapping[str, list[Op]] | None = None,
                 tensors: Mapping[str, Tensor | None] | None = None) -> Graph:
        """A new graph: ops replaced (``None`` deletes), new ops inserted after named ones."""
        replace = dict(replace)
        in_place = not insert_after and all(v is None or v.name == k for k, v in replace.items())
        if in_place:
            # the common edit (shards of a few ops): one C-level dict copy instead of a Python loop
            ops = dict(self.ops)
            for name, new in replace.items():
                if name in ops:
                    if new is None:
                        del ops[name]
                    else:
                        ops[name] = new
        else:
            ops = self._rebuilt_ops(replace, insert_after)
        t = self.tensors
        if tensors:
            t = dict(t)
            for name, v in tensors.items():
                if v is None:
                    t.pop(name, None)
                else:
                    t[name] = v
        child = Graph(t, ops)
        child.origin = weakref.ref(self)
        child.ops_delta = (replace, {a: list(v) for a, v in insert_after.items()} if insert_after else {})
        if tensors:
            child.tensor_delta = (self.tensors, tuple(n for n, v in tensors.items()
                                                      if v is not self.tensors.get(n)))
        if in_place and not tensors and all(v is not None and k in self.ops for k, v in replace.items()):
            child.edit = Edit(weakref.ref(self), tuple(replace))
        return child

    def in_program_order(self) -> Graph:
        """This graph with its ops in program order (``topo_order``): itself when they are, else a
        copy with the same origin. For rewrites whose new ops cannot simply be placed in order."""
        order = self.topo_order
        if order == tuple(self.ops):
            return self
        child = Graph(self.tensors, {n: self.ops[n] for n in order})
        child.origin, child.tensor_delta = self.origin, self.tensor_delta
        return child

    def _rebuilt_ops(self, replace: dict[str, Op | None], insert_after: Mapping[str, list[Op]] | None) -> dict:
        ops: dict[str, Op] = {}
        for name, o in self.ops.items():
            new = replace.get(name, o) if name in replace else o
            if new is not None:
                ops[new.name] = new
            for extra in (insert_after or {}).get(name, ()):
                ops[extra.name] = extra
        return ops

    # -- identity and text -------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT,
                "tensors": [t.to_json() for t in self.tensors.values()],
                "ops": [o.to_json() for o in self.ops.values()]}

    @cached_property
    def canonical_json(self) -> str:
        """Sorted, whitespace-free JSON; per-op and per-tensor fragments are cached on the (shared) ops
        and tensors."""
        tensors = ",".join(self.tensors[n].canonical_text for n in sorted(self.tensors))
        ops = ",".join(self.ops[n].canonical_text for n in sorted(self.ops))
        return f'{{"format":"{FORMAT}","ops":[{ops}],"tensors":[{tensors}]}}'

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json.encode()).hexdigest()

    def __str__(self) -> str:
        lines = []
        for n in self.topo_order:
            o = self.ops[n]
            t = self.tensors[o.output]
            args = ", ".join(f"{p}=%{x}" for p, x in o.inputs)
            if o.kernel == "fused":
                params = "[" + " → ".join(st["kernel"] for st in o.params["stages"]) + "]"
            elif o.kernel == "attention" and o.params.get("origin"):  # the replaced ops, not their records
                shown = {k: v for k, v in o.params.items() if k != "origin"}
                was = " → ".join(r["kernel"] for r in o.params["origin"]["ops"])
                params = f"[{json.dumps(shown, sort_keys=True, separators=(',', ':'))}; was {was}]"
            elif o.kernel == "einsum" and o.params.get("origin"):  # a reassociated chain
                shown = {k: v for k, v in o.params.items() if k != "origin"}
                params = f"[{json.dumps(shown, sort_keys=True, separators=(',', ':'))}; reassociated]"
            elif o.kernel == "norm_matmul":
                params = f"[{o.params['norm']['kernel']} → {o.params['inner']['kernel']}]"
            else:
                params = f"[{o.params_key}]" if o.params else ""
            devs = sorted(set(o.shards.device.tolist()))
            lines.append(f"%{o.output} : {t.dtype}{list(t.shape)} = {o.kernel}{params}({args})"
                         f"  # {n}: {len(o.shards)} shards on {devs}")
        return "\n".join(lines)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)
