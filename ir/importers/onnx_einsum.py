"""ONNX ``Einsum`` -> the two-operand ``einsum`` kernel, or ``reduce_sum`` + ``permute`` for one
operand (registered in ``HANDLERS``).

The kernel (``ir.kernels.contraction``) takes ``la,lb->lo``: lowercase letters, no letter twice in
one term, every output letter in an input, one extent per letter. ONNX's equation is NumPy's, so
the handler first normalises it (before -> after, for the shapes given):

- spaces are dropped: ``"bhqd, bhkd -> bhqk"`` -> ``bhqd,bhkd->bhqk``;
- an implicit output (no ``->``) is NumPy's: the ellipsis dims, then the letters that appear
  once, in character-code order (``ba,cb`` -> ``ba,cb->ac``);
- an ellipsis becomes one letter per dim it covers, letters the equation does not use, aligned
  from the right across operands as NumPy aligns them (``...ij,...jk->...ik`` on ``[2,3,4,5]``
  and ``[3,5,6]`` -> ``abij,bjk->abik``); an uppercase letter becomes an unused lowercase one;
- a matrix product with a 2-D operand, ``X·k, k·n -> X·n``, takes the letters MatMul's einsum
  has (``bsd,df->bsf`` -> ``amk,kn->amn``; the 2-D operand moved to the right if it is on the
  left), so the ``linear`` pattern (``ir.importers.patterns``) fuses a bias ``Add`` after it;
  the weight keeps its ONNX name either way;
- a letter of one operand alone that the output drops (``ij,jk->k`` sums ``i`` of the left
  operand) is summed first by ``reduce_sum`` (exact; the einsum VJP has no rule for it, its
  gradient is a broadcast), unless that would leave the operand no dims.

One operand: the letters the output drops are ``reduce_sum`` over their dims, then a ``permute``
puts the rest in the output's order (``ji`` -> a transpose, ``bij->bj`` a sum); the same order
with nothing summed is the input itself.

Refused with :class:`Unsupported` (saying what and why): three or more operands (the kernel
contracts two; write them as pairwise Einsums); a letter twice in one term (a diagonal or trace,
``ii->i``: no kernel reads a diagonal) or in the output; an output letter that is in no input; a
letter, or an ellipsis dim, with two extents (NumPy broadcasts a 1 against ``n``; the kernel
needs equal extents); an explicit output without ``...`` when the ellipsis covers dims (NumPy
refuses it too); a scalar output (graph tensors have rank >= 1); more than 26 labels.
"""

from __future__ import annotations

import re
import string
from typing import Any

from ir.importers.onnx_ops import Context, Unsupported, attr, handles

_TERM = re.compile(r"[A-Za-z]*(?:\.\.\.)?[A-Za-z]*")
#: the batch letters of MatMul's einsum (``ir.importers.onnx_ops._matmul_letters``)
_BATCH = "abcdefgh"

Label = Any  # a letter of the equation, or ("...", j): the j-th (from the left) dim an ellipsis covers


def parse_equation(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[str], str]:
    """``(input terms, output term)`` in the kernel's form (lowercase letters, explicit output,
    no ellipsis) for operands of ``shapes``; raises :class:`Unsupported` saying what is not."""
    eq = "".join(str(equation).split())
    lhs, arrow, rhs = eq.partition("->")
    if not lhs or "->" in rhs:
        raise Unsupported(f"equation {equation!r} is malformed (NumPy einsum notation: 'ij,jk->ik')")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise Unsupported(f"equation {equation!r} has {len(terms)} operand terms for {len(shapes)} inputs")
    if len(shapes) > 2:
        raise Unsupported(f"equation {equation!r} has {len(shapes)} operands; the einsum kernel contracts two "
                          f"(write it as pairwise Einsums)")
    for t in terms + ([rhs] if arrow else []):
        if not _TERM.fullmatch(t):
            raise Unsupported(f"equation {equation!r}: term {t!r} is not letters with at most one '...'")
    n_ell = 0
    for t, shape in zip(terms, shapes):
        letters = len(t.replace("...", ""))
        if "..." not in t and letters != len(shape):
            raise Unsupported(f"equation {equation!r}: term {t!r} has {letters} letters for an operand of rank "
                              f"{len(shape)}")
        if letters > len(shape):
            raise Unsupported(f"equation {equation!r}: term {t!r} has more letters than its operand's rank "
                              f"{len(shape)}")
        n_ell = max(n_ell, len(shape) - letters if "..." in t else 0)
    ins = []
    for t, shape in zip(terms, shapes):
        head, dots, tail = t.partition("...")
        first = n_ell - (len(shape) - len(head) - len(tail))
        ins.append(list(head) + ([("...", j) for j in range(first, n_ell)] if dots else []) + list(tail))
    for t, labels in zip(terms, ins):
        twice = sorted({L for L in labels if labels.count(L) > 1})
        if twice:
            raise Unsupported(f"equation {equation!r}: letter(s) {twice} repeat within the term {t!r} (a diagonal "
                              f"or trace); the einsum kernel reads each operand dim once")
    if arrow:
        head, dots, tail = rhs.partition("...")
        if not dots and n_ell:
            raise Unsupported(f"equation {equation!r}: the output has no '...' but the ellipsis covers {n_ell} "
                              f"dim(s) (NumPy refuses this too)")
        out = list(head) + ([("...", j) for j in range(n_ell)] if dots else []) + list(tail)
        twice = sorted({L for L in out if out.count(L) > 1})
        if twice:
            raise Unsupported(f"equation {equation!r}: output letter(s) {twice} repeat")
        lost = sorted({L for L in out if not any(L in labels for labels in ins)})
        if lost:
            raise Unsupported(f"equation {equation!r}: output letter(s) {lost} appear in no input")
    else:  # NumPy's implicit output: the ellipsis dims, then the letters that appear once, sorted
        letters = [L for labels in ins for L in labels if isinstance(L, str)]
        out = [("...", j) for j in range(n_ell)] + sorted(L for L in set(letters) if letters.count(L) == 1)
    if not out:
        raise Unsupported(f"equation {equation!r} has a scalar output; graph tensors have rank >= 1")
    extent: dict[Label, int] = {}
    for labels, shape in zip(ins, shapes):
        for L, e in zip(labels, shape):
            if extent.setdefault(L, e) != e:
                what = f"ellipsis dim {L[1]}" if isinstance(L, tuple) else f"letter {L!r}"
                raise Unsupported(f"equation {equation!r}: {what} has extents {extent[L]} and {e} (NumPy broadcasts "
                                  f"a 1; the einsum kernel needs one extent per letter)")
    used = {L for labels in ins for L in labels if isinstance(L, str) and L.islower()}
    fresh = iter(c for c in string.ascii_lowercase if c not in used)
    names: dict[Label, str] = {}
    for L in dict.fromkeys([L for labels in ins for L in labels] + out):
        if isinstance(L, str) and L.islower():
            names[L] = L
            continue
        names[L] = next(fresh, "")
        if not names[L]:
            raise Unsupported(f"equation {equation!r} needs more than 26 labels (ellipsis dims included)")
    return ["".join(names[L] for L in labels) for labels in ins], "".join(names[L] for L in out)


def _matmul_form(la: str, lb: str, lo: str) -> tuple[str, str, str] | None:
    """``la,lb->lo`` relabelled as MatMul's einsum (``abmk,kn->abmn``) when it is one: ``lb`` a
    matrix ``kn``, ``la`` ending in ``k``, the output ``la`` without ``k`` then ``n``; else None."""
    if len(lb) != 2 or len(la) < 2 or len(la) - 2 > len(_BATCH):
        return None
    k, n = lb
    if la[-1] != k or n in la or lo != la[:-1] + n:
        return None
    batch = _BATCH[: len(la) - 2]
    return batch + "mk", "kn", batch + "mn"


def _sum_alone(ctx: Context, x: str, mine: str, keep: str, label: str) -> tuple[str, str]:
    """``x`` (letters ``mine``) with the letters not in ``keep`` summed by ``reduce_sum`` (the last
    dim first, so the others keep their positions), at least one dim left."""
    drop = [i for i, L in enumerate(mine) if L not in keep]
    if len(drop) == len(mine):
        drop = drop[:-1]
    for k, i in enumerate(sorted(drop, reverse=True)):
        x = ctx.emit("reduce_sum", {"x": x}, {"dim": i}, name=label if k == 0 else f"{label}.{k}")
        mine = mine[:i] + mine[i + 1:]
    return x, mine


@handles("Einsum")
def _einsum(ctx, node, label):
    equation = attr(node, "equation", None)
    if not equation:
        raise Unsupported("no equation attribute")
    names = [x for x in node.input if x]
    terms, lo = parse_equation(equation, [ctx.shape(x) for x in names])
    xs = [ctx.use(x) for x in names]
    if len(xs) == 1:
        x, la = _sum_alone(ctx, xs[0], terms[0], lo, f"{label}.sum")
        perm = [la.index(L) for L in lo]
        if perm == list(range(len(perm))):
            ctx.set(node.output[0], x)
        else:
            ctx.emit("permute", {"x": x}, {"perm": perm}, out=node.output[0], name=label)
        return
    (a, b), (la, lb) = xs, terms
    a, la = _sum_alone(ctx, a, la, lb + lo, f"{label}.sum_a")
    b, lb = _sum_alone(ctx, b, lb, la + lo, f"{label}.sum_b")
    form = _matmul_form(la, lb, lo)
    if form is None and _matmul_form(lb, la, lo) is not None:  # the matrix on the left: operands swapped
        a, b, la, lb = b, a, lb, la
        form = _matmul_form(la, lb, lo)
    la, lb, lo = form or (la, lb, lo)
    ctx.emit("einsum", {"a": a, "b": b}, {"equation": f"{la},{lb}->{lo}"}, out=node.output[0], name=label)
