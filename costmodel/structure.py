"""A plan's lowering structure: its ops in program order and its data flow, as arrays.

Everything the lowering needs of a plan besides its shards (``costmodel.lowering``):

- **groups**: one per produced tensor that something reads, in producer order, then one per
  read loop-carried state ``P`` (read from the home that ``P.next``'s producer writes), in the
  order of that producer; each with its producer, tensor and readers ``(op, port)`` in program
  order (an op that reads a tensor twice is listed twice);
- **sources**: the ordinary graph inputs in first-reader order, then every loop-carried state
  with its home op, in the order of the homes;
- per op: whether it is an ``accumulate`` and whether it writes a state's next value in place,
  and the groups and sources it takes part in.

Built with NumPy over flattened inputs (a gpt-2 training step has 1,500 ops and 4,000 reads; the
per-read Python loops this replaces took ~5 ms of every structural move). Groups and sources are
CSR arrays; ``groups[gi]`` and ``sources[si]`` give the ``(producer, tensor, ((op, port), ...))``
and ``(tensor, ((op, port), ...))`` tuples on demand.

A rewrite's child differs from its parent in a few ops. ``derive_structure`` makes the child's
structure from the parent's: the groups and sources of tensors no changed op touches are the
parent's with positions remapped, those of the tensors the new and removed ops read or write are
rebuilt (and program order is checked there); the result equals ``build_structure``'s, array for
array (``tests/costmodel/test_structure.py``), in about half its time on a gpt-2 step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain, repeat
from operator import attrgetter, contains, itemgetter
from typing import Any

import numpy as np

from ir.graph import NEXT_SUFFIX, SOURCE_ROLES, STATE_ROLES, Graph
from ir.kernels import ITEMSIZE
from ir.unique import distinct, first_indices


class _Groups:
    """``groups[gi]`` -> ``(producer, tensor, ((reader, port), ...))`` (positions in program order)."""

    __slots__ = ("st",)

    def __init__(self, st: "Structure") -> None:
        self.st = st

    def __len__(self) -> int:
        return len(self.st.g_prod)

    def __getitem__(self, gi: int) -> tuple[int, str, tuple[tuple[int, str], ...]]:
        st = self.st
        a, b = int(st.g_rptr[gi]), int(st.g_rptr[gi + 1])
        return int(st.g_prod[gi]), st.g_tensor[gi], tuple(zip(st.g_rop[a:b].tolist(), st.g_rport[a:b].tolist()))


class _Sources:
    """``sources[si]`` -> ``(tensor, ((reader, port), ...))`` (a state's home source has no readers)."""

    __slots__ = ("st",)

    def __init__(self, st: "Structure") -> None:
        self.st = st

    def __len__(self) -> int:
        return len(self.st.s_home)

    def __getitem__(self, si: int) -> tuple[str, tuple[tuple[int, str], ...]]:
        st = self.st
        a, b = int(st.s_rptr[si]), int(st.s_rptr[si + 1])
        return st.s_tensor[si], tuple(zip(st.s_rop[a:b].tolist(), st.s_rport[a:b].tolist()))


def _csr(rows: np.ndarray, cols: np.ndarray, n_rows: int, n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The sorted, deduplicated ``cols`` of each row (CSR ``ptr, idx``)."""
    key = distinct(rows * max(n_cols, 1) + cols)
    r = key // max(n_cols, 1)
    ptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(np.bincount(r, minlength=n_rows), out=ptr[1:])
    return ptr, key - r * max(n_cols, 1)


@dataclass(eq=False)
class Structure:
    """What a plan's lowering depends on besides shards: ops, their order and data flow."""

    keys: tuple[str, ...]          # op names in dict order
    order: tuple[str, ...]         # program order (``Graph.topo_order``)
    program: int                   # the lowerer's number of the logical program
    g_prod: np.ndarray             # int64 per group: producer (the home op for a state group)
    g_tensor: np.ndarray           # object per group: tensor name (``P`` for a state group)
    g_state: np.ndarray            # int8 per group: 1 = reads of a loop-carried state
    g_item: np.ndarray             # float64 per group: itemsize of its tensor
    g_rptr: np.ndarray             # CSR of readers per group
    g_rop: np.ndarray
    g_rport: np.ndarray            # object: reader ports, beside g_rop
    s_tensor: np.ndarray           # object per source: tensor name
    s_home: np.ndarray             # int64 per source: -1, or the producer of its P.next (state home)
    s_rptr: np.ndarray
    s_rop: np.ndarray
    s_rport: np.ndarray
    op_inplace: np.ndarray         # int8 per op: 1 = produces some P.next (writes P's buffer)
    op_acc: np.ndarray             # bool per op: an accumulate (its local inputs are added in place)
    op_reads: np.ndarray           # int64 per op: how many inputs it reads
    op_out: np.ndarray             # object per op: its output tensor's name
    op_split: np.ndarray           # bool per op: a split reduction's partial op (its params have "split")

    @property
    def groups(self) -> _Groups:
        return _Groups(self)

    @property
    def sources(self) -> _Sources:
        return _Sources(self)

    @property
    def source_home(self) -> np.ndarray:
        return self.s_home

    @cached_property
    def position(self) -> dict[str, int]:
        """Op name -> its index in ``order``."""
        return dict(zip(self.order, range(len(self.order))))

    @cached_property
    def _op_groups(self) -> tuple[np.ndarray, np.ndarray]:
        G = len(self.g_prod)
        rows = np.concatenate([self.g_prod, self.g_rop])
        cols = np.concatenate([np.arange(G, dtype=np.int64), np.repeat(np.arange(G, dtype=np.int64),
                                                                        np.diff(self.g_rptr))])
        return _csr(rows, cols, len(self.order), G)

    @cached_property
    def _op_sources(self) -> tuple[np.ndarray, np.ndarray]:
        S = len(self.s_home)
        homes = np.nonzero(self.s_home >= 0)[0]
        rows = np.concatenate([self.s_rop, self.s_home[homes]])
        cols = np.concatenate([np.repeat(np.arange(S, dtype=np.int64), np.diff(self.s_rptr)), homes])
        return _csr(rows, cols, len(self.order), S)

    def op_groups(self, i: int) -> list[int]:
        """The groups op ``i`` produces or reads, in group order."""
        ptr, idx = self._op_groups
        return idx[ptr[i]:ptr[i + 1]].tolist()

    def op_sources(self, i: int) -> list[int]:
        """The sources op ``i`` reads or is the home of, in source order."""
        ptr, idx = self._op_sources
        return idx[ptr[i]:ptr[i + 1]].tolist()

    @cached_property
    def _lookups(self) -> tuple[dict, dict, dict, dict]:
        """(tensor -> producer position, -> ordinary group, -> state group, -> ordinary source)."""
        plain = np.nonzero(self.g_state == 0)[0]
        state = np.nonzero(self.g_state == 1)[0]
        src = np.nonzero(self.s_home < 0)[0]
        return (dict(zip(self.op_out.tolist(), range(len(self.op_out)))),
                dict(zip(self.g_tensor[plain].tolist(), plain.tolist())),
                dict(zip(self.g_tensor[state].tolist(), state.tolist())),
                dict(zip(self.s_tensor[src].tolist(), src.tolist())))

    @cached_property
    def group_of_producer(self) -> np.ndarray:
        """int64 per op: its ordinary group (of its output), or -1."""
        return _inverse(len(self.order), self.g_prod, self.g_state == 0)

    @cached_property
    def group_of_home(self) -> np.ndarray:
        """int64 per op: the state group it is the home of, or -1."""
        return _inverse(len(self.order), self.g_prod, self.g_state == 1)

    @cached_property
    def source_of_home(self) -> np.ndarray:
        """int64 per op: the state source it is the home of, or -1."""
        return _inverse(len(self.order), self.s_home, self.s_home >= 0)


def _inverse(n: int, at: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int64[n] of -1, with each index ``i`` that ``mask`` selects written at ``at[i]``."""
    out = np.full(n, -1, np.int64)
    sel = np.nonzero(mask)[0]
    out[at[sel]] = sel
    return out


_first, _second = itemgetter(0), itemgetter(1)
_output, _kernel, _dtype = attrgetter("output"), attrgetter("kernel"), attrgetter("dtype")
_params = attrgetter("params")


def _carried(tensors: Any, tid: dict, prod_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Graph.carried`` as ids: (states ``P``, their next values ``P.next``), in tensor order;
    ``prod_of``: producer of each tensor id, -1 for none."""
    p_ids, nxt_ids = [], []
    for name, i in tid.items():  # names that have a name.next: few; their role decides
        j = tid.get(name + NEXT_SUFFIX)
        if j is not None and prod_of[j] >= 0 and tensors[name].role in STATE_ROLES:
            p_ids.append(i)
            nxt_ids.append(j)
    return np.array(p_ids, np.int64), np.array(nxt_ids, np.int64)


def _flat_inputs(ops: list) -> tuple[np.ndarray, list, list]:
    """(inputs per op, ports, tensor names) of ``ops``, flattened in op and port order."""
    inputs = [o.inputs for o in ops]
    lens = np.fromiter(map(len, inputs), np.int64, len(inputs))
    flat = list(chain.from_iterable(inputs))
    return lens, list(map(_first, flat)), list(map(_second, flat))


def build_structure(g: Graph, program: int) -> Structure:
    """The lowering structure of ``g`` (program number ``program``)."""
    gops, tensors = g.ops, g.tensors
    keys = tuple(gops)
    ops = list(gops.values())
    tid = dict(zip(tensors, range(len(tensors))))
    lens, ports, tens = _flat_inputs(ops)
    n, T = len(ops), len(tid)
    in_t = np.fromiter(map(tid.__getitem__, tens), np.int64, len(tens))
    out_t = np.fromiter(map(tid.__getitem__, map(_output, ops)), np.int64, n)
    in_op = np.repeat(np.arange(n, dtype=np.int64), lens)
    prod_of = np.full(T, -1, np.int64)
    prod_of[out_t] = np.arange(n, dtype=np.int64)
    order = keys
    if (prod_of[in_t] < in_op).all():  # op order is program order (``Graph.topo_order``'s first test)
        g.__dict__.setdefault("topo_order", keys)  # (its cached_property's slot: found here, O(reads) in C)
    else:  # not topological: program order repairs it
        order = g.topo_order
        ops = [gops[n_] for n_ in order]
        lens, ports, tens = _flat_inputs(ops)
        in_t = np.fromiter(map(tid.__getitem__, tens), np.int64, len(tens))
        out_t = np.fromiter(map(tid.__getitem__, map(_output, ops)), np.int64, n)
        in_op = np.repeat(np.arange(n, dtype=np.int64), lens)
        prod_of[out_t] = np.arange(n, dtype=np.int64)
    names = np.empty(T, object)
    names[:] = list(tensors)
    port_arr = np.empty(len(ports), object)
    port_arr[:] = ports

    # loop-carried state: P -> home (the producer of P.next), homes in program order
    p_ids, nxt_ids = _carried(tensors, tid, prod_of)
    home_of = np.full(T, -1, np.int64)  # per tensor P: its home op
    state_t = np.full(n, -1, np.int64)  # per op: the state P whose next value it writes
    if p_ids.size:
        home_of[p_ids] = prod_of[nxt_ids]
        state_t[prod_of[nxt_ids]] = p_ids
    home_ops = np.nonzero(state_t >= 0)[0]

    # groups: a key per read (its producer, or n + the home of the state it reads), sorted stably
    e_prod = prod_of[in_t]
    e_home = home_of[in_t]
    key = np.where(e_prod >= 0, e_prod, np.where(e_home >= 0, n + e_home, -1))
    grouped = np.nonzero(key >= 0)[0]
    o = grouped[np.argsort(key[grouped], kind="stable")]
    gkeys, first, counts = first_indices(key[o], counts=True)
    g_state = (gkeys >= n).astype(np.int8)
    g_prod = np.where(g_state == 1, gkeys - n, gkeys)
    g_tid = np.where(g_state == 1, state_t[g_prod], out_t[g_prod])
    g_rptr = np.zeros(len(gkeys) + 1, np.int64)
    np.cumsum(counts, out=g_rptr[1:])
    item_of = _itemsizes(tensors, names, g_tid)

    # ordinary sources: read, not produced, not carried, a source role; in first-reader order
    cand = np.nonzero((e_prod < 0) & (e_home < 0))[0]
    src_ids = []
    if cand.size:
        u, first_read = first_indices(in_t[cand])
        u = u[np.argsort(first_read, kind="stable")]
        src_ids = [t for t in u.tolist() if tensors[names[t]].role in SOURCE_ROLES]
    src_ids = np.array(src_ids, np.int64)
    n_src = len(src_ids)
    if n_src:
        slot = np.full(T, -1, np.int64)
        slot[src_ids] = np.arange(n_src)
        e_slot = slot[in_t]
        se = np.nonzero(e_slot >= 0)[0]
        se = se[np.argsort(e_slot[se], kind="stable")]
        s_counts = np.bincount(e_slot[se], minlength=n_src)
    else:
        se = np.zeros(0, np.int64)
        s_counts = np.zeros(0, np.int64)
    S = n_src + len(home_ops)
    s_rptr = np.zeros(S + 1, np.int64)
    np.cumsum(s_counts, out=s_rptr[1:n_src + 1])
    s_rptr[n_src + 1:] = s_rptr[n_src]
    s_tensor = np.empty(S, object)
    s_tensor[:] = [*names[src_ids].tolist(), *names[state_t[home_ops]].tolist()]
    s_home = np.concatenate([np.full(n_src, -1, np.int64), home_ops])

    op_inplace = np.zeros(n, np.int8)
    op_inplace[home_ops] = 1
    op_acc = np.array(list(map(_kernel, ops)), object) == "accumulate"
    op_split = np.fromiter(map(contains, map(_params, ops), repeat("split")), np.bool_, n)
    return Structure(keys, order, program, g_prod, names[g_tid], g_state, item_of, g_rptr, in_op[o], port_arr[o],
                     s_tensor, s_home, s_rptr, in_op[se], port_arr[se], op_inplace, op_acc, lens, names[out_t],
                     op_split)


def _itemsizes(tensors: Any, names: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Itemsize of each tensor in ``ids``."""
    return np.fromiter(map(ITEMSIZE.__getitem__, map(_dtype, map(tensors.__getitem__, names[ids].tolist()))),
                       np.float64, len(ids))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + c)`` for each (start, count)."""
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)


def _objects(values: list) -> np.ndarray:
    a = np.empty(len(values), object)
    a[:] = values
    return a


def derive_structure(g: Graph, P: Structure, p_ops: list, p_index: dict[int, int], p_tensors: Any,
                     program: int) -> tuple[Structure, np.ndarray, np.ndarray] | None:
    """``build_structure(g, program)`` from the structure ``P`` of a plan ``g`` was made from (its
    ops ``p_ops`` in ``P.order``, ``p_index``: id of each -> position, its tensors ``p_tensors``),
    looking only at the ops ``g`` changed and the tensors they touch; with the child-to-parent
    position of each op (-1: new) and each group (-1: rebuilt). None where it cannot (the parent's
    op order was not program order, the child's is not, or too much changed): build it whole."""
    if P.order is not P.keys:
        return None
    gops, tensors = g.ops, g.tensors
    vals = list(gops.values())
    n, Pn = len(vals), len(P.order)
    c2p = np.fromiter(map(p_index.get, map(id, vals), repeat(-1)), np.int64, n)
    kept = c2p >= 0
    kp = c2p[kept]
    if kp.size > 1 and not (kp[1:] > kp[:-1]).all():
        return None
    p2c = np.full(Pn, -1, np.int64)
    p2c[kp] = np.nonzero(kept)[0]
    new = np.nonzero(~kept)[0].tolist()
    gone = np.nonzero(p2c < 0)[0].tolist()
    if len(new) + len(gone) > max(16, n // 8):
        return None
    new_ops = [vals[i] for i in new]
    dirty: set[str] = set()
    for o in chain(new_ops, (p_ops[j] for j in gone)):
        dirty.add(o.output)
        dirty.update(map(_second, o.inputs))
    if tensors is not p_tensors and not set(g.changed_tensors(p_tensors)) <= dirty:
        return None  # a tensor changed under a kept op: build whole
    k = len(NEXT_SUFFIX)
    dirty.update([t[:-k] for t in dirty if t.endswith(NEXT_SUFFIX)])  # a state whose next value moved
    p_prod, p_plain, p_state, p_src = P._lookups
    new_out = {o.output: i for i, o in zip(new, new_ops)}

    def producer(t: str) -> int:
        i = new_out.get(t)
        if i is not None:
            return i
        j = p_prod.get(t)
        return int(p2c[j]) if j is not None else -1

    def readers(t: str) -> tuple[list[int], list[str]]:
        """Child readers of ``t`` in program order: the parent's kept ones and the new ops'."""
        rows: list[tuple[int, int, str]] = []
        for table, ptr, rop, rport in ((p_plain, P.g_rptr, P.g_rop, P.g_rport), (p_state, P.g_rptr, P.g_rop, P.g_rport),
                                       (p_src, P.s_rptr, P.s_rop, P.s_rport)):
            x = table.get(t)
            if x is not None:
                a, b = ptr[x], ptr[x + 1]
                rows += [(int(p2c[r]), q, port) for q, (r, port) in enumerate(zip(rop[a:b].tolist(),
                                                                                  rport[a:b].tolist()))
                         if p2c[r] >= 0]
        for i, o in zip(new, new_ops):
            rows += [(i, q, port) for q, (port, tt) in enumerate(o.inputs) if tt == t]
        rows.sort()
        return [r for r, _q, _p in rows], [p for _r, _q, p in rows]

    # groups: the parent's whose tensor is clean, remapped; those of dirty tensors rebuilt
    # (a dirty tensor's groups from the lookups: a test of every group's tensor took longer)
    gone_g = [x for t in dirty for x in (p_plain.get(t), p_state.get(t)) if x is not None]
    keep_g = np.ones(len(P.g_prod), np.bool_)
    keep_g[gone_g] = False
    clean = np.nonzero(keep_g)[0]
    c_counts = np.diff(P.g_rptr)[clean]
    c_entries = _ranges(P.g_rptr[clean], c_counts)
    keys = [np.where(P.g_state[clean] == 1, n + p2c[P.g_prod[clean]], p2c[P.g_prod[clean]])]
    new_groups = []  # (key, tensor, state, readers, ports)
    homes_new = []  # (home, P) of dirty carried states
    for t in sorted(dirty):
        tt = tensors.get(t)
        if tt is None:
            continue
        pr = producer(t)
        if pr >= 0:
            rd, ports = readers(t)
            if rd:
                if min(rd) <= pr:
                    return None  # not in program order
                new_groups.append((pr, t, 0, rd, ports))
            continue
        home = producer(t + NEXT_SUFFIX) if tt.role in STATE_ROLES else -1
        if home >= 0:
            homes_new.append((home, t))
            rd, ports = readers(t)
            if rd:
                new_groups.append((n + home, t, 1, rd, ports))
    keys.append(np.array([x[0] for x in new_groups], np.int64))
    all_keys = np.concatenate(keys)
    perm = np.argsort(all_keys, kind="stable")
    counts = np.concatenate([c_counts, np.array([len(x[3]) for x in new_groups], np.int64)])
    flat_rop = np.concatenate([p2c[P.g_rop[c_entries]],
                               np.array([r for x in new_groups for r in x[3]], np.int64)])
    flat_port = np.concatenate([P.g_rport[c_entries], _objects([p for x in new_groups for p in x[4]])])
    starts = np.cumsum(counts) - counts
    take = _ranges(starts[perm], counts[perm])
    g_rptr = np.zeros(len(perm) + 1, np.int64)
    np.cumsum(counts[perm], out=g_rptr[1:])
    g_state = np.concatenate([P.g_state[clean], np.array([x[2] for x in new_groups], np.int8)])[perm]
    gk = all_keys[perm]
    g_prod = np.where(g_state == 1, gk - n, gk)
    g_tensor = np.concatenate([P.g_tensor[clean], _objects([x[1] for x in new_groups])])[perm]
    g_item = np.concatenate([P.g_item[clean], np.array([float(ITEMSIZE[tensors[x[1]].dtype]) for x in new_groups],
                                                       np.float64)])[perm]
    gmap = np.concatenate([clean, np.full(len(new_groups), -1, np.int64)])[perm]

    # sources: ordinary ones in first-reader order, then the states' homes in home order
    ordinary = []  # (first reader, index of its first read there, tensor, readers, ports)
    for si in np.nonzero(P.s_home < 0)[0].tolist():
        t = P.s_tensor[si]
        if t in dirty:
            continue
        a, b = P.s_rptr[si], P.s_rptr[si + 1]
        rd = p2c[P.s_rop[a:b]].tolist()
        ordinary.append((rd[0], t, rd, P.s_rport[a:b].tolist()))
    for t in sorted(dirty):
        tt = tensors.get(t)
        if tt is None or producer(t) >= 0 or tt.role not in SOURCE_ROLES or \
                (tt.role in STATE_ROLES and producer(t + NEXT_SUFFIX) >= 0):
            continue
        rd, ports = readers(t)
        if rd:
            ordinary.append((rd[0], t, rd, ports))
    ordinary.sort(key=lambda x: (x[0], [tt for _p, tt in vals[x[0]].inputs].index(x[1])))
    p_homes = np.nonzero(P.s_home >= 0)[0]
    keep_home = ~np.fromiter(map(dirty.__contains__, P.s_tensor[p_homes].tolist()), np.bool_, len(p_homes))
    h_pos = np.concatenate([p2c[P.s_home[p_homes[keep_home]]], np.array([h for h, _ in homes_new], np.int64)])
    h_t = np.concatenate([P.s_tensor[p_homes[keep_home]], _objects([t for _, t in homes_new])])
    ho = np.argsort(h_pos, kind="stable")
    h_pos, h_t = h_pos[ho], h_t[ho]
    n_src = len(ordinary)
    s_counts = np.array([len(x[2]) for x in ordinary] + [0] * len(h_pos), np.int64)
    s_rptr = np.zeros(len(s_counts) + 1, np.int64)
    np.cumsum(s_counts, out=s_rptr[1:])
    s_tensor = np.concatenate([_objects([x[1] for x in ordinary]), h_t])
    s_home = np.concatenate([np.full(n_src, -1, np.int64), h_pos])

    # per op: kept ops' values, the new ops' own
    def per_op(parent: np.ndarray, fresh: list, dtype: Any) -> np.ndarray:
        out = np.empty(n, dtype)
        out[kept] = parent[kp]
        if new:
            out[new] = np.array(fresh, dtype) if dtype is not object else _objects(fresh)
        return out

    op_inplace = np.zeros(n, np.int8)
    op_inplace[h_pos] = 1
    keys_ = tuple(gops)
    st = Structure(keys_, keys_, program, g_prod, g_tensor, g_state, g_item, g_rptr, flat_rop[take],
                   flat_port[take], s_tensor, s_home, s_rptr,
                   np.array([r for x in ordinary for r in x[2]], np.int64),
                   _objects([p for x in ordinary for p in x[3]]), op_inplace,
                   per_op(P.op_acc, [o.kernel == "accumulate" for o in new_ops], np.bool_),
                   per_op(P.op_reads, [len(o.inputs) for o in new_ops], np.int64),
                   per_op(P.op_out, [o.output for o in new_ops], object),
                   per_op(P.op_split, ["split" in o.params for o in new_ops], np.bool_))
    g.__dict__.setdefault("topo_order", st.keys)
    return st, c2p, gmap
