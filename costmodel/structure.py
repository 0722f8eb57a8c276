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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from ir.graph import NEXT_SUFFIX, SOURCE_ROLES, STATE_ROLES, Graph
from ir.kernels import ITEMSIZE


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
    key = np.unique(rows * max(n_cols, 1) + cols)
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
    def group_of_producer(self) -> np.ndarray:
        """int64 per op: its ordinary group (of its output), or -1."""
        out = np.full(len(self.order), -1, np.int64)
        plain = np.nonzero(self.g_state == 0)[0]
        out[self.g_prod[plain]] = plain
        return out

    @cached_property
    def group_of_home(self) -> np.ndarray:
        """int64 per op: the state group it is the home of, or -1."""
        out = np.full(len(self.order), -1, np.int64)
        st = np.nonzero(self.g_state == 1)[0]
        out[self.g_prod[st]] = st
        return out

    @cached_property
    def source_of_home(self) -> np.ndarray:
        """int64 per op: the state source it is the home of, or -1."""
        out = np.full(len(self.order), -1, np.int64)
        homes = np.nonzero(self.s_home >= 0)[0]
        out[self.s_home[homes]] = homes
        return out


_first, _second = itemgetter(0), itemgetter(1)
_output, _kernel, _role, _dtype = attrgetter("output"), attrgetter("kernel"), attrgetter("role"), attrgetter("dtype")


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
    gkeys, first, counts = np.unique(key[o], return_index=True, return_counts=True)
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
        u, first_read = np.unique(in_t[cand], return_index=True)
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
    return Structure(keys, order, program, g_prod, names[g_tid], g_state, item_of, g_rptr, in_op[o], port_arr[o],
                     s_tensor, s_home, s_rptr, in_op[se], port_arr[se], op_inplace, op_acc, lens)


def _itemsizes(tensors: Any, names: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Itemsize of each tensor in ``ids``."""
    return np.fromiter(map(ITEMSIZE.__getitem__, map(_dtype, map(tensors.__getitem__, names[ids].tolist()))),
                       np.float64, len(ids))
