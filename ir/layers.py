"""Numbered layers of a model: which layer owns a name, layer signatures and classes, names
re-pointed between layers, and truncations of a plan to some of its layers.

``ir.workloads``' language models name the ops and tensors of layer ``i`` ``l<i>.…`` or
``l<i>_…`` (``l7.q_proj``, ``l7_Wq``, ``l7.q_proj.da``). Names may mention other layers (layer 7
reads ``l6.resid2.out``; a fused op ``l2.a+l3.b``), so names are compared *relative* to their
own layer (``@0.q_proj`` reading ``@-1.resid2.out``).

- ``layer_classes(g)``: layers with equal signatures (ops with relative names, kernels, params,
  tensor specs and shards) form a class; the first and last layers differ from the middle ones
  (they read the embedding and the head's gradient), a pipeline stage's layers form one class.
- ``LayerMap``: re-points the layer numbers inside names and params: ``Shift(d)`` moves an op of
  layer ``i`` to layer ``i + d`` (``ir.rewrites.tie``); ``Chain(kept)`` chains the kept layers
  in order (``truncate``).
- ``truncate(g, kept)``: the plan with only some of its layers (``costmodel.repetition``
  evaluates a model of repeated layers from two truncations).

A search evaluates thousands of children of a few plans, so a child's signatures and truncations
are derived from its parent's where the edit is known (``Graph.ops_delta``: the ops ``with_ops``
replaced and inserted): only those ops' entries are made, only those ops are re-pointed, and
either gives what the whole computation gives (``tests/costmodel/test_repetition.py``).
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections import OrderedDict
from functools import lru_cache
from typing import Any

from ir.graph import Graph, Op, Tensor

__all__ = ["LAYER_RE", "Chain", "GraphMemo", "LayerMap", "Shift", "layer_classes", "layer_of", "layer_ops",
           "same_entry", "truncate"]

LAYER_RE = re.compile(r"^l(\d+)[._]")  # the layer a name belongs to
# a layer number inside a name: ``l<i>`` at the start or after a non-word character, followed by
# ``.`` or ``_`` (``l3.q_proj``, ``l3_Wq``, ``l2.a+l3.b``); not ``final_norm`` or ``labels``
_NUM = re.compile(r"(?<![A-Za-z0-9_])l(\d+)(?=[._])")


@lru_cache(maxsize=1 << 16)
def _parts(name: str) -> tuple[int | None, tuple[str, ...], tuple[int, ...]]:
    """(owning layer or None, literal pieces, layer numbers between them) of a name."""
    m = LAYER_RE.match(name)
    pieces = _NUM.split(name)
    return (int(m.group(1)) if m else None), tuple(pieces[0::2]), tuple(int(x) for x in pieces[1::2])


def _join(lits: tuple[str, ...], nums: tuple) -> str:
    out = [lits[0]]
    for n, lit in zip(nums, lits[1:]):
        out.append(f"l{n}{lit}")
    return "".join(out)


def _relative(text: str, owner: int | None) -> str:
    """``text`` (a name, a params key) with its layer numbers relative to ``owner`` (``l6`` in
    layer 7: ``@-1``); as it is outside the layers."""
    if owner is None or "l" not in text:
        return text
    return _NUM.sub(lambda m: f"@{int(m.group(1)) - owner}", text)


def layer_of(name: str) -> int | None:
    """The layer owning ``name`` (``l<i>.…`` or ``l<i>_…``), or None."""
    return _parts(name)[0]


# ---------------------------------------------------------------------------------------------
# layer signatures and classes
# ---------------------------------------------------------------------------------------------

_INTERN_CAP = 50_000
_INTERN: dict[tuple, int] = {}  # an entry -> a number (equal entries, equal numbers; never reused)
_NEXT = itertools.count()


def _shards_key(sh) -> tuple:
    if sh is None:
        return ()
    return (len(sh), hash(sh.lo.tobytes()), hash(sh.hi.tobytes()), hash(sh.device.tobytes()))


def _entry(o: Op, g: Graph) -> tuple[int | None, int]:
    """(owning layer, the number of the op's entry in its layer's signature), memoised on the op
    (so the memo lives as long as the op, no longer). Entries are interned, so a layer's signature
    is a tuple of ints (cheap to hash)."""
    hit = o.__dict__.get("_lentry")
    if hit is not None:
        return hit
    owner = _parts(o.name)[0]
    ts = g.tensors
    spec = lambda t: (ts[t].shape, ts[t].dtype, ts[t].role) if t in ts else None  # noqa: E731
    entry = (_relative(o.name, owner), o.kernel, _relative(o.params_key, owner),
             tuple((p, _relative(t, owner), spec(t)) for p, t in o.inputs),
             _relative(o.output, owner), spec(o.output), _shards_key(o.shards))
    number = _INTERN.get(entry)
    if number is None:
        if len(_INTERN) > _INTERN_CAP:  # equal entries made later get new numbers: never a false match
            _INTERN.clear()
        number = _INTERN[entry] = next(_NEXT)
    o.__dict__["_lentry"] = out = (owner, number)
    return out


def same_entry(src: Op, dst: Op, g: Graph) -> None:
    """Record that ``dst`` is ``src`` (an op of ``g``) moved to another layer of its class
    (``Shift``), so its signature entry is ``src``'s and is not recomputed (``ir.rewrites.tie``
    copies one move into tens of layers)."""
    if "_lentry" not in dst.__dict__:
        dst.__dict__["_lentry"] = (_parts(dst.name)[0], _entry(src, g)[1])


class GraphMemo:
    """A few recently used graphs' derived values, by identity (weak: never keeps a graph alive).
    A hit makes an entry the most recent and dead graphs' entries go first, so a search's root
    plan, whose children are made every few steps, keeps its values (the truncations its children
    are derived from) while the steps between make and drop theirs."""

    def __init__(self, cap: int = 16) -> None:
        self.cap = cap
        self.d: OrderedDict = OrderedDict()

    def get(self, g: Graph, key: Any = None) -> Any:
        k = (id(g), key)
        hit = self.d.get(k)
        if hit is None or hit[0]() is not g:
            return None
        self.d.move_to_end(k)
        return hit[1]

    def put(self, g: Graph, value: Any, key: Any = None) -> Any:
        d = self.d
        for k in [k for k, (ref, _v) in d.items() if ref() is None]:
            del d[k]
        k = (id(g), key)
        d[k] = (weakref.ref(g), value)
        d.move_to_end(k)
        if len(d) > self.cap:
            d.popitem(last=False)
        return value


_SIGS = GraphMemo()


def _signatures(g: Graph) -> tuple[dict[int, list[str]], dict[int, tuple]]:
    """(op names of each layer, in op order; each layer's signature), derived from its origin's
    for a child ``with_ops`` made (``Graph.ops_delta``: only the edited ops' entries change)."""
    hit = _SIGS.get(g)
    if hit is not None:
        return hit
    origin = g.origin() if g.origin is not None else None
    base = _SIGS.get(origin) if origin is not None and g.ops_delta is not None else None
    derived = _derived_signatures(g, base) if base is not None else None
    if derived is not None:
        return _SIGS.put(g, derived)
    per: dict[int, list[int]] = {}
    names: dict[int, list[str]] = {}
    for n, o in g.ops.items():
        owner, number = _entry(o, g)
        if owner is not None:
            lst = per.get(owner)
            if lst is None:
                per[owner], names[owner] = [number], [n]
            else:
                lst.append(number)
                names[owner].append(n)
    return _SIGS.put(g, (names, {i: tuple(v) for i, v in per.items()}))


def _derived_signatures(g: Graph, base: tuple) -> tuple[dict, dict] | None:
    """``_signatures`` of ``g`` from its origin's (``base``) and ``g.ops_delta``: the names and
    entries of the layers the edit touched, edited like ``Graph.with_ops`` edits the op order
    (the untouched entries kept: a tied move replaces one op in each of tens of layers). None
    (derive nothing) for an op inserted after another layer's or renamed into another layer:
    its place among its layer's ops is not known without the whole order."""
    names, sigs = dict(base[0]), dict(base[1])
    replace, insert_after = g.ops_delta
    touched: dict[int, tuple[list[str], list[int]]] = {}

    def lists(i: int) -> tuple[list[str], list[int]]:
        hit = touched.get(i)
        if hit is None:
            hit = touched[i] = (list(names.get(i, ())), list(sigs.get(i, ())))
        return hit

    for a, extra in insert_after.items():  # first: anchors are the origin's names
        owner = _parts(a)[0]
        at = -1
        for o in extra:
            i = _parts(o.name)[0]
            if i is None:
                continue
            if i != owner:
                return None
            lst, num = lists(i)
            if at < 0:
                if a not in lst:  # (``with_ops`` ignores an anchor that is not an op)
                    break
                at = lst.index(a) + 1
            lst.insert(at, o.name)
            num.insert(at, _entry(o, g)[1])
            at += 1
    for n, o in replace.items():
        i = _parts(n)[0]
        if o is not None and o.name != n and _parts(o.name)[0] != i:
            return None
        if i is None or n not in names.get(i, ()):  # (``with_ops`` ignores a name that is not an op)
            continue
        lst, num = lists(i)
        k = lst.index(n)
        if o is None:
            del lst[k], num[k]
        else:
            lst[k], num[k] = o.name, _entry(o, g)[1]
    for i, (lst, num) in touched.items():
        if lst:
            names[i], sigs[i] = lst, tuple(num)
        else:
            names.pop(i, None)
            sigs.pop(i, None)
    return names, sigs


def layer_ops(g: Graph) -> dict[int, list[str]]:
    """The op names of each numbered layer, in op order (memoised with ``layer_classes``)."""
    return _signatures(g)[0]


def layer_classes(g: Graph) -> list[int] | None:
    """Class of each layer ``0 .. L-1`` (layers of one class have equal signatures; classes
    numbered in order of first appearance), or None when ``g`` has no numbered layers or they are
    not ``0 .. L-1``."""
    _names, sigs = _signatures(g)
    if not sigs or max(sigs) != len(sigs) - 1 or min(sigs) != 0:
        return None
    ids: dict[tuple, int] = {}
    return [ids.setdefault(sigs[i], len(ids)) for i in range(len(sigs))]


# ---------------------------------------------------------------------------------------------
# truncation
# ---------------------------------------------------------------------------------------------

_RENAMED: "OrderedDict[tuple, tuple[Any, Any]]" = OrderedDict()
_RENAMED_CAP = 64  # truncated tensor maps (thousands of tensors each) of recent plans


def _memo(key: tuple, keep_alive: tuple, make):
    """``make()`` memoised under ``key``, which names the ids of the objects ``keep_alive``
    (held by the entry, so the ids are not reused while it lives)."""
    hit = _RENAMED.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], keep_alive)):
        _RENAMED.move_to_end(key)
        return hit[1]
    out = make()
    _RENAMED[key] = (keep_alive, out)
    if len(_RENAMED) > _RENAMED_CAP:
        _RENAMED.popitem(last=False)
    return out


class LayerMap:
    """Re-points the layer numbers inside names and params. ``_num(n, owner)``: the new number
    of layer ``n`` named inside layer ``owner`` (None: outside the layers), or None when it has
    none (the name does not survive)."""

    key: tuple = ()  # identifies the map (memo keys)

    def _num(self, n: int, owner: int | None) -> int | None:
        raise NotImplementedError

    def name(self, name: str, owner: int | None | str = "own") -> str | None:
        """The re-pointed name, or None when it does not survive. Numbers are taken relative to
        ``owner`` (the layer of the op that names it; by default the name's own layer)."""
        own, lits, nums = _parts(name)
        owner = own if owner == "own" else owner
        if not nums:
            return name
        out = [self._num(n, owner) for n in nums]
        if any(v is None for v in out):
            return None
        return name if tuple(out) == nums else _join(lits, out)

    def value(self, v: Any, owner: int | None) -> Any:
        """A param value with the layer numbers inside its strings re-pointed like names (a
        number without a new one is left as it is)."""
        if isinstance(v, str):
            if "l" not in v or not _NUM.search(v):
                return v

            def sub(m: re.Match) -> str:
                new = self._num(int(m.group(1)), owner)
                return m.group(0) if new is None else f"l{new}"
            return _NUM.sub(sub, v)
        if isinstance(v, dict):
            return {k: self.value(x, owner) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(self.value(x, owner) for x in v)
        return v

    def op(self, o: Op) -> Op | None:
        """``o`` re-pointed (memoised on ``o``, so equal calls give the same object; ``o`` itself
        where nothing changes); None when it does not survive."""
        moved = o.__dict__.get("_moved")
        if moved is None:
            moved = o.__dict__["_moved"] = {}
        elif self.key in moved:
            return moved[self.key]

        def make() -> Op | None:
            owner = _parts(o.name)[0]
            name = self.name(o.name, owner)
            out = self.name(o.output, owner)
            inputs = tuple((p, self.name(t, owner)) for p, t in o.inputs)
            if name is None or out is None or any(t is None for _, t in inputs):
                return None
            params = self.value(o.params, owner)
            if name == o.name and out == o.output and inputs == o.inputs and params == o.params:
                return o  # nothing to re-point: the same op (its lowering pieces are shared)
            if params == o.params:
                params = o.params
            return o.replace(name=name, inputs=inputs, output=out, params=params)
        new = moved[self.key] = make()
        if len(moved) > 64:  # an op takes part in a few truncations and shifts, not hundreds
            moved.pop(next(iter(moved)))
        return new


class Chain(LayerMap):
    """A truncation's map: the layers ``kept`` (ascending) keep their numbers and are chained in
    order, a number ``n`` named inside layer ``o`` going to the kept layer as many kept places
    away as ``n`` is from ``o`` (the next kept layer stands for ``o + 1``); outside the layers a
    number must itself be kept. Most ops stay the very same objects, so their lowering pieces are
    shared with the whole plan and with other truncations."""

    def __init__(self, kept: tuple[int, ...]) -> None:
        self.kept = self.key = tuple(kept)
        self.idx = {old: i for i, old in enumerate(self.kept)}

    def _num(self, n: int, owner: int | None) -> int | None:
        if owner is None:
            return n if n in self.idx else None
        i = self.idx.get(owner)
        if i is None:
            return None
        j = i + (n - owner)
        return self.kept[j] if 0 <= j < len(self.kept) else None


class Shift(LayerMap):
    """Moves the names of layer ``owner`` to layer ``owner + d`` (every number inside them by
    ``d``); names outside the layers stay."""

    def __init__(self, d: int) -> None:
        self.d = d
        self.key = ("shift", d)

    def _num(self, n: int, owner: int | None) -> int | None:
        return n if owner is None else (n + self.d if n + self.d >= 0 else None)


def _renamed_tensors(g: Graph, r: Chain) -> dict[str, Tensor]:
    def make() -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        idx = r.idx
        for name, t in g.tensors.items():
            owner = _parts(name)[0]
            if owner is not None and owner not in idx:
                continue  # a dropped layer's
            new = r.name(name)
            if new is not None:
                out[new] = t if new == name else Tensor(new, t.shape, t.dtype, t.role)
        return out
    return _memo(("tensors", id(g.tensors), r.kept), (g.tensors,), make)


def truncate(g: Graph, kept: tuple[int, ...]) -> Graph | None:
    """``g`` with only the layers ``kept`` (ascending), chained in that order (see
    ``Chain``); ops outside the layers kept. None when the result does not close up (an op
    reads a tensor that is neither a source nor produced by a kept op)."""
    kept = tuple(kept)
    hit = _TRUNCS.get(g, kept)
    if hit is not None:
        return hit
    r = Chain(kept)
    origin = g.origin() if g.origin is not None else None
    base = _TRUNCS.get(origin, kept) if origin is not None else None
    if base is not None and g.ops_delta is not None:  # an edit of a truncated plan: re-point it
        out = _truncate_delta(g, origin, base, r)
        if out is not _WHOLE:
            return _TRUNCS.put(g, out, kept)
    tensors = _renamed_tensors(g, r)
    ops: dict[str, Op] = {}
    for o in g.ops.values():
        owner = _parts(o.name)[0]
        if owner is not None and owner not in r.idx:
            continue
        new = r.op(o)
        if new is None:
            return None
        ops[new.name] = new
    produced = {o.output for o in ops.values()}
    for o in ops.values():
        for _, t in o.inputs:
            if t not in tensors or (t not in produced and tensors[t].role == "intermediate"):
                return None
    if any(o.output not in tensors for o in ops.values()):
        return None
    out = Graph(tensors, ops)
    if base is not None:  # the truncation of the plan g was made from: this one's origin
        out.origin = weakref.ref(base)
    return _TRUNCS.put(g, out, kept)


_TRUNCS = GraphMemo(32)
_WHOLE = object()  # ``_truncate_delta``: truncate the plan whole


def _kept(name: str, r: Chain) -> bool:
    owner = _parts(name)[0]
    return owner is None or owner in r.idx


def _truncate_delta(g: Graph, origin: Graph, base: Graph, r: Chain) -> Graph | None | object:
    """The truncation of ``g``, made by ``origin.with_ops`` (``g.ops_delta``), from ``base``, the
    truncation of ``origin``: the same edit with its ops and tensors re-pointed, those of dropped
    layers left out (what the whole truncation gives, in the same order, without re-pointing
    thousands of ops; an in-place edit stays one, so the lowering stays incremental). ``_WHOLE``
    when the edit does not map (an anchor in a dropped layer)."""
    replace, insert_after = g.ops_delta
    rep: dict[str, Op | None] = {}
    for n, o in replace.items():
        if not _kept(n, r):
            if o is not None and _kept(o.name, r):
                return _WHOLE
            continue
        m = r.name(n)
        new = r.op(o) if o is not None else None
        if m is None or m not in base.ops or (o is not None and new is None):
            return _WHOLE
        rep[m] = new
    ins: dict[str, list[Op]] = {}
    for a, extra in insert_after.items():
        extra = [o for o in extra if _kept(o.name, r)]
        if not extra:
            continue
        b = r.name(a) if _kept(a, r) else None
        moved = [r.op(o) for o in extra]
        if b is None or b not in base.ops or any(o is None for o in moved):
            return _WHOLE
        ins[b] = moved
    tch: dict[str, Tensor | None] = {}
    if g.tensors is not origin.tensors:
        delta = g.tensor_delta
        if delta is None or delta[0] is not origin.tensors:
            return _WHOLE
        for t in delta[1]:
            if not _kept(t, r):
                continue
            u = r.name(t)
            if u is None:
                return _WHOLE
            v = g.tensors.get(t)
            tch[u] = None if v is None else v if u == t else Tensor(u, v.shape, v.dtype, v.role)
    out = base.with_ops(rep, insert_after=ins or None, tensors=tch or None)
    if g.edit is not None:  # in place (the shards of some ops): nothing to close anew
        return out
    # closure at the cuts (see ``truncate``): the ops the edit brought, and the ops of ``base``
    # that read what it took away (a kept layer may stand for a neighbour the edit left alone)
    tensors, producers = out.tensors, out.producers

    def closed(t: str) -> bool:
        return t in tensors and (t in producers or tensors[t].role != "intermediate")

    for o in [*rep.values(), *(o for extra in ins.values() for o in extra)]:
        if o is not None and (o.output not in tensors or not all(closed(t) for _, t in o.inputs)):
            return None
    lost = [t for t, v in tch.items() if v is None]
    lost += [base.ops[n].output for n in rep if base.ops[n].output not in producers]
    if lost:
        readers = base.consumers
        for t in lost:
            if not closed(t) and any(out.ops.get(q) is base.ops[q] for q, _ in readers.get(t, ())):
                return None
    return out
