"""Validation: collect every problem of a graph as structured issues (code, path, message).

Rules: tensors have a rank >= 1 shape, a known dtype and role; every op's kernel exists and
accepts its inputs (shapes, dtypes, params), and its output tensor matches the signature; the
output projection of the whole index space covers the output tensor exactly once; shards
partition the index space exactly (overlaps that still add up are caught); every non-source
tensor has exactly one producer and sources have none; no cycles; devices are >= 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ir.graph import DTYPES_OK, ROLES, SOURCE_ROLES, Graph
from ir.kernels import SignatureError
from ir.zspace import ZRange, partition_problem


OP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


@dataclass(frozen=True)
class Issue:
    code: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message} [{self.code}]"


class InvalidGraph(ValueError):
    """A graph failed validation; ``issues`` lists every problem found."""

    def __init__(self, issues: list[Issue], source: str = "graph") -> None:
        self.issues = issues
        head = f"{source} is not a valid plan ({len(issues)} problem{'s' if len(issues) != 1 else ''}):"
        super().__init__("\n".join([head] + [f"  - {i}" for i in issues[:20]]
                                   + ([f"  ... and {len(issues) - 20} more"] if len(issues) > 20 else [])))


def validate(g: Graph) -> list[Issue]:
    """Every problem of ``g``; an empty list means valid."""
    issues: list[Issue] = []
    add = lambda code, path, msg: issues.append(Issue(code, path, msg))  # noqa: E731

    for name, t in g.tensors.items():
        p = f"tensors.{name}"
        if len(t.shape) == 0 or any((not isinstance(x, int)) or x < 1 for x in t.shape):
            add("bad-shape", p, f"shape {list(t.shape)} must be a non-empty list of positive integers")
        if t.dtype not in DTYPES_OK:
            add("bad-dtype", p, f"dtype {t.dtype!r} is not one of {list(DTYPES_OK)}")
        if t.role not in ROLES:
            add("bad-role", p, f"role {t.role!r} is not one of {list(ROLES)}")

    bad_tensors = {i.path.split(".", 1)[1] for i in issues}  # their ops cannot be checked further
    producers: dict[str, list[str]] = {}
    for name, o in g.ops.items():
        p = f"ops.{name}"
        if not OP_NAME.fullmatch(name):
            add("bad-name", p, f"operation name {name!r} must match {OP_NAME.pattern} (rewrite moves name ops "
                "in text such as split{op=NAME,...})")
        producers.setdefault(o.output, []).append(name)
        missing = [t for _, t in o.inputs if t not in g.tensors]
        if missing:
            add("unknown-tensor", p + ".inputs", f"reads unknown tensor(s) {missing}")
        if o.output not in g.tensors:
            add("unknown-tensor", p + ".output", f"writes unknown tensor {o.output!r}")
        if missing or o.output not in g.tensors or any(t in bad_tensors for _, t in o.inputs + (("y", o.output),)):
            continue
        try:
            sig = g.signature(o)
        except SignatureError as e:
            add("signature", p, str(e))
            continue
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:  # malformed params
            add("signature", p, f"kernel {o.kernel!r} cannot take params {o.params_key}: {type(e).__name__}: {e}")
            continue
        out = g.tensors[o.output]
        if sig.out_spec.shape != out.shape or sig.out_spec.dtype != out.dtype:
            add("output-mismatch", p + ".output",
                f"kernel {o.kernel} produces {sig.out_spec.dtype}{list(sig.out_spec.shape)} but tensor "
                f"{o.output!r} is {out.dtype}{list(out.shape)}")
            continue
        whole = sig.index
        img = sig.output.apply(whole)
        if img != ZRange.of_shape(out.shape) or whole.size * int(np.prod(sig.output.s)) != out_size(out.shape):
            add("output-coverage", p + ".output", f"the index space {whole!r} writes {img!r}, not exactly "
                f"the cells of {o.output!r} {list(out.shape)}")
        sh = o.shards
        if sh is None or len(sh) == 0:
            add("shard-coverage", p + ".shards", "the op has no shards")
            continue
        if sh.ndim != len(sig.dims):
            add("shard-rank", p + ".shards", f"shards have rank {sh.ndim}, the index space {list(sig.dims)} "
                f"has rank {len(sig.dims)}")
            continue
        prob = partition_problem((sh.lo, sh.hi), whole)
        if prob:
            add(prob[0], p + ".shards", prob[1] + "; shards must partition the index space exactly")
        bad = np.nonzero(sh.device < 0)[0]
        if bad.size:
            add("bad-device", f"{p}.shards[{int(bad[0])}]", f"device {int(sh.device[bad[0]])} is negative")

    for name, t in g.tensors.items():
        prods = producers.get(name, [])
        if t.role in SOURCE_ROLES and prods:
            add("produced-source", f"tensors.{name}", f"{t.role} tensor is written by {prods}")
        elif t.role not in SOURCE_ROLES and not prods:
            add("no-producer", f"tensors.{name}", f"{t.role} tensor has no producing operation")
        elif len(prods) > 1:
            add("multiple-producers", f"tensors.{name}", f"written by several operations {prods}")

    try:
        g.topo_order
    except ValueError as e:
        add("cycle", "ops", str(e))
    return issues


def out_size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape))


def check(g: Graph, source: str = "graph") -> Graph:
    """Return ``g`` if valid, else raise ``InvalidGraph`` listing every issue."""
    issues = validate(g)
    if issues:
        raise InvalidGraph(issues, source)
    return g
