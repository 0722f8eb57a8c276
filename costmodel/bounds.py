"""The lower bound on a plan's makespan (``lower_bound``; the reasoning is in
``costmodel.evaluate``'s module doc), valid for the program's substituted forms too.

A plan may compute its program through substitutions that the bound's two terms would otherwise
overcount: ``fuse_attention`` runs scores, mask, softmax and values as one kernel (one launch on
the chain where the program has three), ``fuse_norm`` runs a norm inside the contractions that
read it, and ``reassociate`` evaluates ``(A·B)·R`` as ``A·(B·R)``, which costs fewer FLOPs and,
where ``B·R`` is weights-only, is folded at load time (``ir.folding``) so the step reads one
smaller weight. So each term is the smallest of its values over three forms of the program: as
written; every cheaper reassociation applied and the weights-only ops folded; and that with every
attention pattern and norm fused as well. Work is a sum over ops and the chain a longest path, so
a plan that applies some of the substitutions lies between those forms term by term.
"""

from __future__ import annotations

import numpy as np

from costmodel.efficiency import Curves
from costmodel.hardware import Hardware, class_family
from costmodel.lowering import MULTI_TENSOR, kernel_class_of, multi_tensor
from ir.graph import SOURCE_ROLES, Graph
from ir.kernels import ELEMENTWISE, ITEMSIZE, get_kernel

__all__ = ["bound_over", "bound_terms", "lower_bound", "substituted_forms"]


def lower_bound(program: Graph, hw: Hardware, curves: Curves | None = None) -> float:
    """Lower bound on the makespan of any plan of ``program`` (the unsharded logical program,
    ``ir.rewrites.unshard``) on ``hw``, whatever substitutions it applies (module doc). With
    ``curves`` (the shards are timed with them), no GEMM shard of an op with reduction depth ``K``
    runs above ``gemm_peak · K / (K + k_half)`` of the peak (its occupancy is at most 1 and its own
    depth at most ``K``), and no shard moves bytes above ``mem_peak`` of the bandwidth."""
    return bound_over(substituted_forms(program), hw, curves)


def bound_over(forms: list[Graph], hw: Hardware, curves: Curves | None = None) -> float:
    """The bound over ``forms`` of one program: its smallest work term against its shortest chain."""
    terms = [bound_terms(f, hw, curves) for f in forms]
    return max(min(w for w, _ in terms), min(c for _, c in terms))


def substituted_forms(program: Graph) -> list[Graph]:
    """``program``; with its cheaper reassociations applied and weights-only ops folded; and
    that with every attention pattern and norm fused too (module doc). A substitution that does
    not apply is skipped."""
    from ir.folding import fold_constants
    from ir.rewrites import fuse_attention, fuse_norm, reassociate
    from ir.rewrites.errors import RewriteError
    from ir.rewrites.substitute_attention import attention_sites
    from ir.rewrites.substitute_norm import norm_sites
    from ir.rewrites.substitute_reassoc import reassociation_sites

    cheap = program
    for _ in range(len(program.ops)):  # a chain of three or more offers new sites once one is taken
        sites = reassociation_sites(cheap)
        if not sites:
            break
        cheap = reassociate(cheap, *sites[0])
    fused = cheap
    for site in attention_sites(fused):
        try:
            fused = fuse_attention(fused, site)
        except RewriteError:
            pass
    for norm in norm_sites(fused):
        try:
            fused = fuse_norm(fused, norm)
        except RewriteError:
            pass
    return [program, fold_constants(cheap), fold_constants(fused)]


def bound_terms(program: Graph, hw: Hardware, curves: Curves | None = None) -> tuple[float, float]:
    """(total work over the fleet plus one launch, the launch chain at full parallelism) of
    ``program`` as written (``costmodel.evaluate``'s module doc)."""
    n = hw.n_devices
    ce = max(c for c, _ in hw.efficiency.values())
    me = max(m for _, m in hw.efficiency.values()) if curves is None else curves.mem_peak
    launch = min([hw.device.launch_overhead] + list(hw.launch_overhead_by_class.values()))
    work = 0.0
    chain: dict[str, float] = {}
    for name in program.topo_order:
        o = program.ops[name]
        sig = program.signature(o)
        flops = float(np.prod(sig.extents, dtype=np.float64)) * sig.flops_per_point
        eff = ce
        if curves is not None and class_family(kernel_class_of(o)) == "matmul" and flops > 0:
            k = max(sig.flops_per_point / 2.0, 1.0)
            eff = curves.gemm_peak * k / (k + curves.k_half)
        work += flops / (hw.peak_flops(program.tensors[o.output].dtype) * eff)
        preds = [program.producers[t] for _, t in o.inputs if t in program.producers]
        fusable = o.kernel != "fused" and ELEMENTWISE in get_kernel(o.kernel).properties and bool(preds)
        step = 0.0 if fusable else launch / MULTI_TENSOR if multi_tensor(program, o) else launch
        chain[name] = max((chain[p] for p in preds), default=0.0) + step
    io = sum(float(np.prod(t.shape)) * ITEMSIZE[t.dtype] for t in program.tensors.values()
             if t.role in SOURCE_ROLES or t.role == "output")
    work_term = max(work, io / (hw.device.mem_bandwidth * me)) / n + (launch if work > 0 or io > 0 else 0.0)
    return work_term, max(chain.values(), default=0.0)
