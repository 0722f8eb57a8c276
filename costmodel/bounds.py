"""The lower bound on a plan's makespan (``lower_bound``; the reasoning is in
``costmodel.evaluate``'s module doc), valid for the program's substituted forms too.

A plan may compute its program through substitutions that the bound's two terms would otherwise
overcount: ``fuse_attention`` runs scores, mask, softmax and values as one kernel (one launch on
the chain where the program has three), ``fuse_norm`` runs a norm inside the contractions that
read it, and ``reassociate`` evaluates ``(A·B)·R`` as ``A·(B·R)``, which costs fewer FLOPs and,
where ``B·R`` is weights-only, is folded at load time (``ir.folding``) so the step reads one
smaller weight. So each term is the smallest of its values over the forms of the program
(``program_forms``): as written; each form that reassociations reach, in any order and at any
site (the order decides what a later fold saves), with the weights-only ops folded; and each of
those with every attention pattern and norm fused as well. Work is a sum over ops and the chain a
longest path, so a plan that applies some of the substitutions lies between those forms term by
term. The work term's second launch (``every_kernel_waits``) is added only where all the forms
allow it; the condition is checked op by op, so it carries over to the ops a plan builds from
them (fused, merged, split into partial sums, copied).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from costmodel.efficiency import Curves
from costmodel.hardware import Hardware, class_family
from costmodel.lowering import MULTI_TENSOR, kernel_class_of, multi_tensor, union_volume
from ir.graph import SOURCE_ROLES, Graph
from ir.kernels import ELEMENTWISE, ITEMSIZE, get_kernel
from ir.kernels.prenorm import NORMS

__all__ = ["FORMS_CAP", "FREE_KERNELS", "bound_over", "bound_terms", "every_kernel_waits", "lower_bound",
           "program_forms", "substituted_forms"]

#: kernels a plan may run without a launch of their own: an accumulate may lower to a collective
#: (``costmodel.collectives``), a contiguous slice to a view (the lowering's runtime mode)
FREE_KERNELS = ("accumulate", "slice")


def lower_bound(program: Graph, hw: Hardware, curves: Curves | None = None) -> float:
    """Lower bound on the makespan of any plan of ``program`` (the unsharded logical program,
    ``ir.rewrites.unshard``) on ``hw``, whatever substitutions it applies (module doc). With
    ``curves`` (the shards are timed with them), no GEMM shard of an op with reduction depth ``K``
    runs above ``gemm_peak · K / (K + k_half)`` of the peak (its occupancy is at most 1 and its own
    depth at most ``K``), and no shard moves bytes above ``mem_peak`` of the bandwidth."""
    forms, loose = program_forms(program)
    return bound_over(forms, hw, curves, loose)


def bound_over(forms: list[Graph], hw: Hardware, curves: Curves | None = None,
               loose: frozenset[str] = frozenset()) -> float:
    """The bound over ``forms`` of one program: its smallest work term against its shortest chain.
    ``loose``: ops whose work and launches count nothing (``program_forms``)."""
    terms = [bound_terms(f, hw, curves, loose) for f in forms]
    work = min(w for w, _ in terms)
    if work > 0 and not loose and all(map(every_kernel_waits, forms)):
        work += min(_launch(f, hw) for f in forms)
    return max(work, min(c for _, c in terms))


def substituted_forms(program: Graph) -> list[Graph]:
    """The forms of ``program`` its bound is the smallest over (``program_forms``)."""
    return program_forms(program)[0]


def program_forms(program: Graph) -> tuple[list[Graph], frozenset[str]]:
    """``program``; each form its reassociations reach (``_reassociations``), with weights-only
    ops folded; and each of those with every attention pattern and norm fused too (module doc).
    A substitution that does not apply is skipped. Past ``FORMS_CAP`` reassociated forms, the
    forms are the program's alone and the ops that take part in a reassociation are returned as
    *loose*: the bound counts no work and no launch for them."""
    from ir.folding import fold_constants

    reached = _reassociations(program)
    loose: frozenset[str] = frozenset()
    if reached is None:
        reached, loose = [program], _reassociable(program)
    forms = [program]
    for r in reached:
        forms += [fold_constants(r), fold_constants(_fused(r))]
    return forms, loose


#: reassociated forms ``program_forms`` explores (a program with a few low-rank chains has a few)
FORMS_CAP = 64


def _reassociable(g: Graph) -> frozenset[str]:
    """The ops that take part in a reassociation site of ``g`` (as the inner or the outer op)."""
    from ir.rewrites.substitute_reassoc import KERNELS, chain_of

    return frozenset(n for o in g.ops.values() if o.kernel in KERNELS for keep in ("a", "b")
                     for n in chain_of(g, o.name, keep) or ())


def _reassociations(program: Graph) -> list[Graph] | None:
    """Every form reassociations reach from ``program``, breadth first: at any site, cheaper or
    not (a plan may take them in any order, and an order can decide what a later fold saves), or
    None past ``FORMS_CAP`` forms."""
    from ir.rewrites import reassociate
    from ir.rewrites.errors import RewriteError
    from ir.rewrites.substitute_reassoc import KERNELS, chain_of

    if not _reassociable(program):
        return [program]
    seen = {program.digest: program}
    queue = [program]
    while queue:
        g = queue.pop(0)
        for n, o in g.ops.items():
            if o.kernel not in KERNELS or o.params.get("origin"):
                continue
            for keep in ("a", "b"):
                if chain_of(g, n, keep) is None:
                    continue
                try:
                    h = reassociate(g, n, keep)
                except RewriteError:
                    continue
                if h.digest not in seen:
                    if len(seen) >= FORMS_CAP:
                        return None
                    seen[h.digest] = h
                    queue.append(h)
    return list(seen.values())


def _fused(g: Graph) -> Graph:
    """``g`` with every attention pattern and norm fused."""
    from ir.rewrites import fuse_attention, fuse_norm
    from ir.rewrites.errors import RewriteError
    from ir.rewrites.substitute_attention import attention_sites
    from ir.rewrites.substitute_norm import norm_sites

    for site in attention_sites(g):
        try:
            g = fuse_attention(g, site)
        except RewriteError:
            pass
    for norm in norm_sites(g):
        try:
            g = fuse_norm(g, norm)
        except RewriteError:
            pass
    return g


def bound_terms(program: Graph, hw: Hardware, curves: Curves | None = None,
                loose: frozenset[str] = frozenset()) -> tuple[float, float]:
    """(total work over the fleet plus one launch, the launch chain at full parallelism) of
    ``program`` as written (``costmodel.evaluate``'s module doc); ``loose`` ops count no work,
    no launch and no reads."""
    n = hw.n_devices
    ce = max(c for c, _ in hw.efficiency.values())
    me = max(m for _, m in hw.efficiency.values()) if curves is None else curves.mem_peak
    launch = _class_launch(hw)
    work = 0.0
    chain: dict[str, float] = {}
    for name in program.topo_order:
        o = program.ops[name]
        sig = program.signature(o)
        flops = 0.0 if name in loose else float(np.prod(sig.extents, dtype=np.float64)) * sig.flops_per_point
        eff = ce
        if curves is not None and class_family(kernel_class_of(o)) == "matmul" and flops > 0:
            k = max(sig.flops_per_point / 2.0, 1.0)
            eff = curves.gemm_peak * k / (k + curves.k_half)
        work += flops / (hw.peak_flops(program.tensors[o.output].dtype) * eff)
        preds = [program.producers[t] for _, t in o.inputs if t in program.producers]
        fusable = o.kernel != "fused" and ELEMENTWISE in get_kernel(o.kernel).properties and bool(preds)
        free = fusable or o.kernel in FREE_KERNELS or name in loose  # fused, or no kernel of its own
        step = 0.0 if free else launch / MULTI_TENSOR if multi_tensor(program, o) else launch
        chain[name] = max((chain[p] for p in preds), default=0.0) + step
    io = _io_bytes(program, loose)
    # the device with the most work runs at least one kernel: the shortest launch (a multi-tensor one's)
    first = _launch(program, hw) if work > 0 or io > 0 else 0.0
    work_term = max(work, io / (hw.device.mem_bandwidth * me)) / n + first
    return work_term, max(chain.values(), default=0.0)


def _class_launch(hw: Hardware) -> float:
    """The smallest launch overhead over the kernel classes of ``hw``."""
    return min([hw.device.launch_overhead] + list(hw.launch_overhead_by_class.values()))


def _launch(program: Graph, hw: Hardware) -> float:
    """The shortest launch any kernel of a plan of ``program`` pays: the smallest over the kernel
    classes, a ``MULTI_TENSOR``-th of it where the program has multi-tensor ops."""
    launch = _class_launch(hw)
    return launch / MULTI_TENSOR if any(multi_tensor(program, o) for o in program.ops.values()) else launch


def _io_bytes(program: Graph, loose: frozenset[str] = frozenset()) -> float:
    """Bytes every plan of ``program`` moves through some device's memory: each source that its
    launched readers read whole (a slice may be a view, whose readers read only the cells they
    need, so a source read through a slice, or only in part, counts nothing), and each graph
    output a launched kernel writes. ``loose`` readers count as no reader."""
    total = 0.0
    for name, t in program.tensors.items():
        if t.role == "output":
            p = program.producers.get(name)
            counted = p is not None and program.ops[p].kernel not in FREE_KERNELS
        elif t.role in SOURCE_ROLES:
            boxes = [_image(program, program.ops[r], port) for r, port in program.consumers.get(name, [])
                     if program.ops[r].kernel not in FREE_KERNELS and r not in loose]
            counted = bool(boxes) and None not in boxes and _covered(t.shape, boxes)
        else:
            counted = False
        if counted:
            total += float(np.prod(t.shape)) * ITEMSIZE[t.dtype]
    return total


def _image(program: Graph, o, port: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box ``o`` reads through ``port`` over its whole index space, or None where interval
    arithmetic gives only a hull (a row with a stride larger than its window has gaps)."""
    sig = program.signature(o)
    p = sig.inputs[port]
    return _hull(p.A, p.b, p.s, sig.extents)


@lru_cache(maxsize=4096)
def _hull(A, b, s, extents) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``ir.zspace.project_boxes`` of the whole index box ``[0, extents)``, in plain integers
    (the ranks are small), or None where the image has gaps."""
    lo, hi = [], []
    for row, bk, sk in zip(A, b, s):
        if any(abs(a) > sk for a in row):
            return None
        lo.append(bk + sum(a * (e - 1) for a, e in zip(row, extents) if a < 0))
        hi.append(bk + sk + sum(a * (e - 1) for a, e in zip(row, extents) if a > 0))
    return tuple(lo), tuple(hi)


def _covered(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether the union of ``boxes`` covers every cell of a tensor of ``shape``."""
    if any(all(x <= 0 for x in lo) and all(y >= n for y, n in zip(hi, shape)) for lo, hi in boxes):
        return True
    if not boxes or not shape:
        return bool(boxes)
    full = np.array(shape, np.int64)
    lo = np.clip(np.array([b[0] for b in boxes], np.int64), 0, full)
    hi = np.clip(np.array([b[1] for b in boxes], np.int64), 0, full)
    return union_volume(lo, np.maximum(hi, lo)) == float(np.prod(full, dtype=np.float64))


def every_kernel_waits(program: Graph) -> bool:
    """Whether, in every plan of ``program``, each kernel that computes something a result needs
    either starts after another kernel ends or ends before another kernel starts (the second
    launch of the work term; module doc of ``costmodel.evaluate``).

    Checked on the program after load-time folding (the plan's own runtime form), op by op, so
    that it holds for every kernel a plan can form from them (an op alone, an op with elementwise
    consumers fused into it, shards of either, copies, partial sums):
    - every produced tensor is a graph output or its readers together read all of it, so the
      shards some kernel waits on cover every op's whole index space;
    - each op reads a produced tensor (through a projection whose image stays inside it, so every
      shard reads some of it) from a kernel that launches, or every reader of its output is such a
      kernel and the output is not a graph output. An elementwise reader may be fused into the op;
      it then counts only through its other inputs or its own readers. Accumulates and slices may
      run without a launch (``FREE_KERNELS``), and a norm may be fused into a contraction that
      reads it (``ir.rewrites.substitute_norm``, also into one reader of several): the wait passes
      through them to their own inputs."""
    from ir.folding import fold_constants

    g = fold_constants(program)
    if not g.ops:
        return False
    producers, readers = g.producers, g.consumers
    for t, rs in readers.items():
        if t in producers and g.tensors[t].role != "output":
            boxes = [_image(g, g.ops[r], port) for r, port in rs]
            if any(b is None for b in boxes) or not _covered(g.tensors[t].shape, boxes):
                return False

    def inside(o, port: str, t: str) -> bool:
        box = _image(g, o, port)
        return box is not None and min(box[0], default=0) >= 0 and all(
            y <= n for y, n in zip(box[1], g.tensors[t].shape))

    waits: dict[str, bool] = {}
    waited: dict[str, bool] = {}

    def waits_for(name: str, skip: str | None = None) -> bool:
        """A kernel of ``name`` starts after some launched kernel ends (``skip``: its input from
        an op it may be fused into)."""
        if skip is None and name in waits:
            return waits[name]
        o = g.ops[name]
        ok = False
        for port, t in o.inputs:
            p = producers.get(t)
            if t == skip or p is None or not inside(o, port, t):
                continue
            # a norm may be fused into this reader, which then reads the norm's inputs
            if g.ops[p].kernel not in FREE_KERNELS + NORMS or waits_for(p):
                ok = True
                break
        if skip is None:
            waits[name] = ok
        return ok

    def waited_for(name: str) -> bool:
        """Every kernel that reads ``name``'s output launches, or is waited for in turn."""
        if name in waited:
            return waited[name]
        o = g.ops[name]
        rs = readers.get(o.output, [])
        ok = g.tensors[o.output].role != "output" and bool(rs)
        for r, _ in rs if ok else ():
            ro = g.ops[r]
            if ro.kernel in FREE_KERNELS:
                ok = waited_for(r)
            elif ro.kernel != "fused" and ELEMENTWISE in get_kernel(ro.kernel).properties:
                ok = waits_for(r, skip=o.output) or waited_for(r)
            if not ok:
                break
        waited[name] = ok
        return ok

    return all(waits_for(n) or waited_for(n) for n in g.topo_order)
