"""Region layouts: assign index dims to mesh axes for a connected set of ops, in one move.

A *layout* says, per op, which mesh axes split which index dims (DTensor's ``Shard(dim)`` per
mesh axis, see STYLE.md §7). ``layout(g, ops, mesh, use)`` sets it for every op of a region by
propagation, as GSPMD and DTensor propagate shardings:

1. **Seeds.** Each mesh axis has a *use*: ``b`` (batch: dim 0 of the activations entering the
   region), ``s`` (sequence: dim 1), ``t`` (tensor parallel: the dims of the weights), ``e``
   (expert parallel: the experts' dim of a mixture of experts' weights ``[e, d, f]``, which the
   dispatched tokens ``[e, ...]`` share; elsewhere as ``b``, so attention is data parallel over
   the expert ranks, as in Mixtral's and DeepSpeed-MoE's training). Tensors
   that enter the region and are not parameters or state are seeded: ``b`` axes split their
   dim 0, ``s`` axes their dim 1 (where long enough).
2. **Propagation**, op by op in dependency order. An input tensor split on tensor dim ``r`` over
   axis ``a`` gives the op's index dim ``c`` to ``a`` when the port's projection maps ``c`` to
   ``r`` one-to-one (``Shard(r) -> Shard(c)``). When ``r`` is a hidden reduction of the op
   (matmul's ``k``), the axis splits that reduction instead: ``split_reduction`` with the block
   dim on ``a``, and an ``accumulate`` after it (``S(1)·S(0) -> Partial``). One-to-one maps are
   taken before reductions, so an all-gather is preferred to a partial sum. An expert axis
   arriving on another dim of an op with an experts' dim is dropped there (the tokens move to
   their experts: the all-to-all of expert parallelism).
3. **Free axes** (no input decided them) go to a dim chosen by the axis's use: ``t``: a dim that
   only the weights see (output columns, heads); ``e``: the experts' dim, else as ``b``;
   ``b``/``s``: the dim that writes output dim 0/1;
   then any long enough dim. An accumulate whose block axis is freed so takes the output apart
   (reduce-scatter rather than all-reduce: sequence parallelism after a row-parallel layer).
   An axis that fits nowhere leaves the op on coordinate 0 of that axis.
4. Each op gets a regular grid of near-equal tiles; tile coordinates are mesh coordinates
   (several axes on one dim split it outer-first), so consumers of equal extents line up.

With ``hierarchical=True``, reductions split over several mesh axes, one of which crosses nodes,
are reduced in two levels (``ir.rewrites.hierarchical``): inside each node first, then across
nodes. Off by default: the cost model already prices a flat reduce-scatter over nodes as NCCL's
hierarchical collective (``costmodel.collectives``), so the explicit form only adds a stage; the
search can still try it (the ``two_level`` operator).

Before the layout, split reductions whose accumulate lies in the region are merged back, so
any plan of the region is one move away from any layout of it::

    layout{ops=all,mesh=8x8,use=b.t}       # DP over nodes x Megatron TP inside each node
    layout{ops=all,mesh=8x8,use=b.s}       # DP x context parallel
    layout{ops=all,mesh=8x8,use=b.b}       # 64-way data parallel
    layout{ops=all,mesh=8x8,use=b.e}       # DP over nodes x expert parallel inside each node
    layout{ops=l3.*,mesh=2x4,use=b.t}      # one layer's ops (a glob), 8 devices
    layout{ops=ln1:ff2,mesh=8,use=t}       # a topological range of ops
"""

from __future__ import annotations

import fnmatch
from functools import lru_cache
from math import prod
from typing import Sequence

import numpy as np

from ir.graph import STATE_ROLES, Graph, Op, Shards, Tensor
from ir.kernels import Signature
from ir.kernels.attention import COMBINE_KERNEL
from ir.mesh import Mesh
from ir.rewrites.errors import RewriteError
from ir.rewrites.hierarchical import block_owners, split_dim, stage_one_shards
from ir.rewrites.reduction import acc_name, merge_reduction, split_reduction
from ir.zspace import Projection, split_points

USES = ("b", "s", "t", "e")


def select_ops(g: Graph, sel: str) -> list[str]:
    """The ops of a region text: ``all``, a glob (``l3.*``), ``a:b`` (a topological range,
    inclusive), an op name, or several of these joined by ``|``. Topological order."""
    order = g.topo_order
    chosen: set[str] = set()
    for part in str(sel).split("|"):
        if part == "all":
            chosen.update(order)
        elif ":" in part:
            a, _, b = part.partition(":")
            if a not in g.ops or b not in g.ops:
                raise RewriteError(f"region {part!r}: both ends must be operations")
            i, j = order.index(a), order.index(b)
            chosen.update(order[min(i, j):max(i, j) + 1])
        elif any(c in part for c in "*?["):
            chosen.update(n for n in order if fnmatch.fnmatchcase(n, part))
        elif part in g.ops:
            chosen.add(part)
        else:
            raise RewriteError(f"region {part!r} names no operation; use all, a glob, a:b or an op name")
    if not chosen:
        raise RewriteError(f"region {sel!r} selects no operation")
    return [n for n in order if n in chosen]


def _unit_col(row: tuple[int, ...]) -> int | None:
    """The index column a projection row copies one-to-one, or None."""
    nz = [c for c, v in enumerate(row) if v != 0]
    return nz[0] if len(nz) == 1 and row[nz[0]] == 1 else None


@lru_cache(maxsize=4096)
def _unit_cols(proj: Projection) -> tuple[int | None, ...]:
    """``_unit_col`` of each row of ``proj`` (projections are shared by the signatures of a
    search, and a layout asks for every row of every port of every op)."""
    return tuple(_unit_col(row) for row in proj.A)


#: A tensor's sharding in a layout: ``(tensor dim, mesh axes splitting it, outer first)`` pairs.
Sharding = tuple[tuple[int, tuple[int, ...]], ...]


class _Assign:
    """Mesh axes per index dim of one op (outer axis first), plus a reduction's axes."""

    def __init__(self, sig: Signature, mesh: Mesh) -> None:
        self.sig, self.mesh = sig, mesh
        self.dims: dict[int, list[int]] = {}
        self.used: set[int] = set()
        self.red: tuple[str, list[int]] | None = None

    def parts(self, c: int) -> int:
        return prod(self.mesh.shape[a] for a in self.dims.get(c, ()))

    def fits(self, c: int, axis: int) -> bool:
        return self.sig.extents[c] >= self.parts(c) * self.mesh.shape[axis]

    def give(self, c: int, axis: int) -> bool:
        if axis in self.used or not self.fits(c, axis):
            return False
        self.dims.setdefault(c, []).append(axis)
        self.used.add(axis)
        return True


def _weights(v: _View, g: Graph) -> set[str]:
    """Weight-like tensors: parameters and state, and what ops compute from them alone (the
    low-precision copies of fp32 master weights, a transposed weight)."""
    w = {t for t, ten in v.tensors.items() if ten.role in STATE_ROLES}
    for n in g.topo_order:
        o = v.ops.get(n)
        if o is not None and o.inputs and all(t in w for _, t in o.inputs):
            w.add(o.output)
    return w


def _param_dims(sig: Signature, inputs: Sequence[tuple[str, bool]]) -> list[int]:
    """Index dims that only weight-like inputs see (one-to-one), in index order; ``inputs``:
    ``(port, whether its tensor is weight-like)`` of each input."""
    seen_by_act: set[int] = set()
    seen_by_w: set[int] = set()
    for port, is_weight in inputs:
        cols = {c for c in _unit_cols(sig.inputs[port]) if c is not None}
        (seen_by_w if is_weight else seen_by_act).update(cols)
    return sorted(seen_by_w - seen_by_act)  # in index order: heads before head dims


def _expert_dims(sig: Signature, inputs: Sequence[tuple[str, bool]]) -> list[int]:
    """The experts' dim of a mixture of experts' GEMM (``ebcd,edf->ebcf``): an index dim that a
    weight-like input's dim 0 and an activation's dim 0 both copy one-to-one, in an op that
    reduces (so an element-wise op on a weight and its gradient has none)."""
    if not sig.reductions:
        return []
    first: dict[bool, set[int]] = {True: set(), False: set()}
    for port, is_weight in inputs:
        cols = _unit_cols(sig.inputs[port])
        if cols and cols[0] is not None:
            first[is_weight].add(cols[0])
    return sorted(first[True] & first[False])


@lru_cache(maxsize=1024)
def _batched_operands(equation: str) -> tuple[int, ...]:
    """Operands of an einsum whose leading letter another operand leads with too and the output
    keeps (``ebcd,edf->ebcf``: both; ``bsd,df->bsf``: none)."""
    ins, _, out = equation.partition("->")
    ops = ins.split(",")
    return tuple(i for i, x in enumerate(ops) if x and x[0] in out
                 and any(y[:1] == x[0] for j, y in enumerate(ops) if j != i))


def has_experts(g: Graph) -> bool:
    """Whether some einsum batches a weight over its leading dim together with the activations (a
    mixture of experts' weights ``[e, d, f]``): the programs where the ``e`` use differs from ``b``."""
    roles = g.tensors
    prods = g.producers
    for o in g.ops.values():
        if o.kernel != "einsum":
            continue
        for i in _batched_operands(o.params.get("equation", "")):
            t = o.inputs[i][1]
            src = [t] if t not in prods else [x for _, x in g.ops[prods[t]].inputs]  # a weight's cast
            if all(roles[x].role in STATE_ROLES for x in src):
                return True
    return False


def _out_dim_col(sig: Signature, r: int) -> int | None:
    cols = _unit_cols(sig.output)
    return cols[r] if r < len(cols) else None


class _Decision:
    """What ``_decide`` chose for one op: mesh axes per index dim (outer first; read-only), and
    the hidden reduction split over mesh axes (``(name, axes)``) or None. Without a split, also
    the op's tile grid and its output's sharding (with one, they follow from the split op)."""

    __slots__ = ("dims", "red", "shards", "out")

    def __init__(self, sig: Signature, mesh: Mesh, asg: _Assign) -> None:
        self.dims: dict[int, tuple[int, ...]] = {c: tuple(axes) for c, axes in asg.dims.items()}
        self.red = None if asg.red is None else (asg.red[0], tuple(asg.red[1]))
        self.shards = self.out = None
        if self.red is None:
            self.shards = _grid_shards(sig, mesh, self.dims)
            self.out = _out_sharding(sig, self.dims)


# ``_decide`` is a function of the op's signature, kernel and inputs' shardings, not of the plan:
# the ops of a search share a few hundred signatures, so most decisions are seen before.
_DECISIONS: dict[tuple, tuple[Signature, _Decision]] = {}
_DECISIONS_MAX = 8192


def _decide(v: _View, name: str, mesh: Mesh, use: tuple[str, ...], T: dict[str, Sharding],
            weights: set[str]) -> tuple[Signature, _Decision]:
    """The op's signature and its layout decision (memoised, see ``_DECISIONS``)."""
    o = v.ops[name]
    sig = v.signature(o)
    inputs = tuple([(port, T.get(t, ()), t in weights) for port, t in o.inputs])
    # keyed by the signature's id: the entry holds the signature, so the id stays its own
    key = (id(sig), o.kernel, inputs, mesh, use)
    hit = _DECISIONS.get(key)
    if hit is not None:
        return hit
    if len(_DECISIONS) >= _DECISIONS_MAX:
        _DECISIONS.clear()
    asg = _assign(sig, o.kernel, inputs, mesh, use)
    _DECISIONS[key] = out = (sig, _Decision(sig, mesh, asg))
    return out


def _assign(sig: Signature, kernel: str, inputs: tuple[tuple[str, Sharding, bool], ...], mesh: Mesh,
            use: tuple[str, ...]) -> _Assign:
    """Mesh axes for the index dims of an op from ``(port, sharding, is weight-like)`` of each
    input (steps 2 and 3 of the module doc)."""
    asg = _Assign(sig, mesh)
    wdims = _param_dims(sig, [(port, is_weight) for port, _, is_weight in inputs])
    edims = _expert_dims(sig, [(port, is_weight) for port, _, is_weight in inputs]) if "e" in use else []
    # 1. one-to-one inheritance from the inputs' shardings; a tensor-parallel axis arriving on a
    #    dim the weights do not see is dropped where the op has weight-only dims (Megatron: the
    #    activations are gathered, the weights stay split)
    for port, sharding, _ in inputs:
        proj = sig.inputs[port]
        cols = _unit_cols(proj)
        for r, axes in sharding:
            c = cols[r]
            if c is None or proj.s[r] != 1:
                continue
            for a in axes:
                if use[a] == "t" and wdims and c not in wdims and any(asg.fits(w, a) for w in wdims):
                    continue
                if use[a] == "e" and edims and c not in edims:
                    continue  # the tokens go to their experts' devices
                asg.give(c, a)
    # 2. a sharded tensor dim that is a hidden reduction of the op: split it over those axes
    if kernel not in ("fused", "accumulate", COMBINE_KERNEL) and sig.reductions:
        for port, sharding, _ in inputs:
            if asg.red is not None:
                break
            for r, axes in sharding:
                # an expert axis stays for the experts' dim (step 3): the tokens go to their experts
                free = [a for a in axes if a not in asg.used and not (use[a] == "e" and edims)]
                red = next((x for x in sig.reductions if (port, r) in x.spans), None)
                if not free or red is None or any(v != 0 for v in sig.inputs[port].A[r]):
                    continue
                k = prod(mesh.shape[a] for a in free)
                if red.extent % k == 0:
                    asg.red = (red.name, sorted(free))
                    asg.used.update(free)
                    break
    # 3. free axes by their use
    for a in range(mesh.ndim):
        if a in asg.used or mesh.shape[a] == 1:
            continue
        pref: list[int] = []
        if use[a] == "t":
            pref = wdims
        elif use[a] == "e" and edims:
            pref = edims
        elif use[a] in ("b", "s", "e"):
            c = _out_dim_col(sig, 1 if use[a] == "s" else 0)
            pref = [c] if c is not None else []
        rest = sorted((c for c in range(len(sig.dims)) if c not in pref), key=lambda c: (c in asg.dims, c))
        for c in pref + rest:
            if asg.give(c, a):
                break
    for axes in asg.dims.values():
        axes.sort()
    return asg


_GRIDS: dict[tuple, Shards] = {}


def _grid_shards(sig: Signature, mesh: Mesh, dims: dict[int, Sequence[int]]) -> Shards:
    """A regular tile grid; tile coordinates along a dim are mesh coordinates of its axes.

    Grids are cached by (extents, mesh, assignment): the ops of identical layers share one
    read-only ``Shards`` object, so a whole-model layout costs memory and time per distinct layer
    shape, not per layer (and consumers that key on object identity see the repetition)."""
    key = (sig.extents, mesh.shape, mesh.offset, tuple(sorted((c, tuple(a)) for c, a in dims.items())))
    hit = _GRIDS.get(key)
    if hit is not None:
        return hit
    if len(_GRIDS) > 4096:
        _GRIDS.clear()
    _GRIDS[key] = out = _build_grid(sig, mesh, dims)
    return out


def _build_grid(sig: Signature, mesh: Mesh, dims: dict[int, Sequence[int]]) -> Shards:
    nd = len(sig.dims)
    parts = [prod(mesh.shape[a] for a in dims.get(c, ())) for c in range(nd)]
    n = prod(parts)
    grids = np.meshgrid(*[np.arange(p) for p in parts], indexing="ij") if nd else []
    idx = np.stack([x.reshape(-1) for x in grids], axis=1) if nd else np.zeros((1, 0), np.int64)
    lo = np.zeros((n, nd), np.int64)
    hi = np.zeros((n, nd), np.int64)
    coords = np.zeros((n, mesh.ndim), np.int64)
    for c in range(nd):
        cuts = np.array(split_points(0, sig.extents[c], parts[c]), dtype=np.int64)
        lo[:, c] = cuts[idx[:, c]]
        hi[:, c] = cuts[idx[:, c] + 1]
        rem = idx[:, c].copy()
        for a in reversed(dims.get(c, ())):  # innermost axis varies fastest
            coords[:, a] = rem % mesh.shape[a]
            rem //= mesh.shape[a]
    return Shards(lo, hi, mesh.device(coords))


def _out_sharding(sig: Signature, dims: dict[int, tuple[int, ...]]) -> Sharding:
    return tuple([(r, tuple(dims[c])) for r, c in enumerate(_unit_cols(sig.output))
                  if c is not None and dims.get(c)])


class _View:
    """A mutable overlay of a graph's ops and tensors, so that a layout over thousands of ops
    builds one new graph at the end instead of one per op."""

    def __init__(self, g: Graph) -> None:
        self.ops: dict[str, Op] = dict(g.ops)
        self.tensors: dict[str, Tensor] = dict(g.tensors)
        self.after: dict[str, list[str]] = {}  # new op names, inserted after an op

    def signature(self, op: str | Op) -> Signature:
        # Graph.signature reads only ``ops`` and ``tensors``, and memoises on the op: the ops of
        # a region are mostly the plan's own, whose signatures the search has asked for already
        return Graph.signature(self, op)  # type: ignore[arg-type]

    def insert(self, after: str, op: Op) -> None:
        self.ops[op.name] = op
        self.after.setdefault(after, []).append(op.name)

    def graph(self, g: Graph) -> Graph:
        ops: dict[str, Op] = {}

        def put(n: str) -> None:
            if n in self.ops:
                ops[n] = self.ops[n]
            for m in self.after.get(n, ()):
                put(m)

        for n in g.ops:
            put(n)
        return Graph(self.tensors, ops)


def _mini(v: _View, ops: list[str]) -> Graph:
    """A graph of just these ops and the tensors they touch (for the rewrites of ``ir.rewrites``)."""
    names = {t for n in ops for _, t in v.ops[n].inputs} | {v.ops[n].output for n in ops}
    return Graph({t: v.tensors[t] for t in names}, {n: v.ops[n] for n in ops})


def _merge_region(v: _View, g: Graph, names: list[str]) -> list[str]:
    """``merge_reduction`` on the overlay for every split op of the region whose accumulate is in
    the region (innermost first: a two-level reduction's accumulate is itself split)."""
    region = set(names)
    for n in reversed(names):
        o = v.ops.get(n)
        if o is None or not o.params.get("split"):
            continue
        readers = g.consumers.get(o.output, [])
        if len(readers) != 1 or readers[0][0] not in region or readers[0][0] not in v.ops:
            continue
        acc = readers[0][0]
        try:
            merged = merge_reduction(_mini(v, [n, acc]), n)
        except RewriteError:
            continue
        v.ops[n] = merged.ops[n]
        del v.ops[acc]
        del v.tensors[o.output]
    return [n for n in names if n in v.ops]


def _split(v: _View, name: str, parts: int, red: str) -> str:
    """``split_reduction`` on the overlay (the same rewrite, on a graph of this op alone); returns
    the name of the op that combines the partials."""
    done = split_reduction(_mini(v, [name]), name, parts, red)
    v.ops[name] = done.ops[name]
    for t, spec in done.tensors.items():
        v.tensors.setdefault(t, spec)
    v.insert(name, done.ops[acc_name(name)])
    return acc_name(name)


def layout(g: Graph, ops: str | Sequence[str], mesh: Mesh, use: Sequence[str],
           hierarchical: bool = False) -> Graph:
    """Lay out the region ``ops`` (a region text or op names) on ``mesh`` with one use per axis."""
    use = tuple(use)
    if len(use) != mesh.ndim or any(u not in USES for u in use):
        raise RewriteError(f"layout needs one use per mesh axis ({mesh.ndim} for mesh {mesh.text}) from "
                           f"{list(USES)}, got {list(use)}")
    names = select_ops(g, ops) if isinstance(ops, str) else [n for n in g.topo_order if n in set(ops)]
    if not names:
        raise RewriteError("layout region is empty")
    before = g
    v = _View(g)
    names = _merge_region(v, g, names)
    produced_in = {v.ops[n].output for n in names}
    T: dict[str, Sharding] = {}
    for n in names:  # seeds: activations entering the region
        for _, t in v.ops[n].inputs:
            ten = v.tensors[t]
            if t in produced_in or t in T or ten.role in STATE_ROLES:
                continue
            T[t] = _seed(ten.shape, mesh, use)
    weights = _weights(v, g)
    # ops on weights alone (casts to bf16) are laid out last, the way their readers read them
    deferred = [n for n in names if all(t in weights for _, t in v.ops[n].inputs)]
    work = [n for n in names if n not in set(deferred)]
    decided: dict[str, tuple[Signature, dict[int, tuple[int, ...]]]] = {}
    twos: list[tuple[str, int, Shards]] = []
    i = 0
    while i < len(work):
        name = work[i]
        i += 1
        sig, d = _decide(v, name, mesh, use, T, weights)
        dims, shards, out = d.dims, d.shards, d.out
        two = None
        if d.red is not None:
            red, axes = d.red
            acc = _split(v, name, prod(mesh.shape[a] for a in axes), red)
            dims = {0: axes, **{c + 1: x for c, x in dims.items()}}
            sig = v.signature(name)
            shards, out = _grid_shards(sig, mesh, dims), _out_sharding(sig, dims)
            work.insert(i, acc)
            inner = prod(mesh.shape[a] for a in axes if not mesh.crosses_nodes(a))
            if hierarchical and 1 < inner < prod(mesh.shape[a] for a in axes):
                two = (acc, inner)
        o = v.ops[name]
        v.ops[name] = o.replace(shards=shards)
        T[o.output] = out
        decided[name] = (sig, dims)
        if two is not None:
            twos.append((two[0], two[1], shards))
    for name in reversed(deferred):
        o = v.ops[name]
        sig = v.signature(name)
        asg = _Assign(sig, mesh)
        for c, axes in (_as_read(g, o.output, sig, mesh, decided) or {}).items():
            for a in axes:
                asg.give(c, a)
        for a in range(mesh.ndim):  # axes the reader does not split the weight over: shard it
            if a not in asg.used and mesh.shape[a] > 1:  # anyway (ZeRO: each device holds a part)
                next((c for c in range(len(sig.dims)) if asg.give(c, a)), None)
        dims = {c: tuple(sorted(x)) for c, x in asg.dims.items()}
        v.ops[name] = o.replace(shards=_grid_shards(sig, mesh, dims))
        decided[name] = (sig, dims)
    for acc, inner, psh in twos:  # inside the node first, then across nodes
        _two_level_view(v, acc, inner, psh)
    out = v.graph(g)
    if len(out.ops) == len(before.ops) and all(n in before.ops and _same_shards(before.ops[n].shards, o.shards)
                                               and before.ops[n].params_key == o.params_key
                                               for n, o in out.ops.items()):
        raise RewriteError(f"the region is already laid out like this on mesh {mesh.text}")
    return out


def _seed(shape: tuple[int, ...], mesh: Mesh, use: tuple[str, ...]) -> Sharding:
    """The sharding of an activation entering the region: ``b`` axes split its dim 0, ``s`` axes
    its dim 1, where long enough."""
    s: dict[int, list[int]] = {}
    for a, u in enumerate(use):
        r = {"b": 0, "s": 1}.get(u)
        if r is not None and r < len(shape) and mesh.shape[a] > 1:
            have = prod(mesh.shape[x] for x in s.get(r, ()))
            if shape[r] >= have * mesh.shape[a]:
                s.setdefault(r, []).append(a)
    return tuple((r, tuple(axes)) for r, axes in s.items())


def _same_shards(a: Shards, b: Shards) -> bool:
    return a is b or a == b  # a re-laid-out op mostly gets its grid object back (``_grid_shards``)


def _as_read(g: Graph, tensor: str, sig: Signature, mesh: Mesh,
             decided: dict[str, tuple[Signature, dict[int, tuple[int, ...]]]]) -> dict[int, list[int]] | None:
    """Index-dim axes for the op writing ``tensor`` so that its first laid-out reader finds each
    box where it reads it (None when no reader was laid out)."""
    for reader, port in g.consumers.get(tensor, []):
        if reader not in decided:
            continue
        rsig, rdims = decided[reader]
        proj = rsig.inputs[port]
        dims: dict[int, list[int]] = {}
        for r, c in enumerate(_unit_cols(proj)):
            oc = _out_dim_col(sig, r)
            if c is None or proj.s[r] != 1 or not rdims.get(c) or oc is None:
                continue
            if sig.extents[oc] >= prod(mesh.shape[a] for a in rdims[c]):
                dims[oc] = list(rdims[c])
        return dims
    return None


def _two_level_view(v: _View, acc: str, group: int, producer_shards: Shards) -> None:
    """``hierarchical.two_level`` on the overlay, for an accumulate just laid out."""
    o = v.ops[acc]
    k = v.tensors[o.inputs[0][1]].shape[0]
    if k % group or group >= k:
        return
    owners = block_owners(producer_shards, 0, k)
    old = o.shards
    _split(v, acc, k // group, "k")
    sig = v.signature(acc)
    out_ext = sig.extents[1:]
    v.ops[acc] = v.ops[acc].replace(shards=stage_one_shards(owners, group, out_ext, int(old.device[0]),
                                                            split_dim(old, out_ext)))
    v.ops[acc_name(acc)] = v.ops[acc_name(acc)].replace(shards=old)


__all__ = ["USES", "has_experts", "layout", "select_ops"]
