"""Validation: collect every problem of a graph as structured issues (code, path, message).

Rules: tensors have a rank >= 1 shape, a known dtype and role; every op's kernel exists and
accepts its inputs (shapes, dtypes, params), and its output tensor matches the signature; the
output projection of the whole index space covers the output tensor exactly once; shards
partition the index space exactly (overlaps that still add up are caught) and none is empty;
every non-source tensor has exactly one producer and sources have none; no cycles; devices are
>= 0 and below ``MAX_DEVICES`` (below the hardware's device count when one is given); no tensor
holds more than ``MAX_TENSOR_CELLS`` cells. A fused op's stages name fresh operations and fresh
intermediate tensors, so that ``unfuse`` (and ``unshard``, which verify and eval use) gives back
a valid graph instead of overwriting a tensor of the plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ir.graph import DTYPES_OK, ROLES, SOURCE_ROLES, Graph, Shards
from ir.kernels import SignatureError, get_kernel
from ir.zspace import ZRange, partition_problem


OP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
#: device numbers at or above this are refused whatever the hardware (no fleet is that large)
MAX_DEVICES = 1 << 20
#: cells of one tensor (the cost model counts bytes in float64: exact below 2**53)
MAX_TENSOR_CELLS = 1 << 50


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


def validate(g: Graph, n_devices: int | None = None) -> list[Issue]:
    """Every problem of ``g``; an empty list means valid. ``n_devices``: the hardware's device
    count, when the plan is meant for a given hardware (devices must be below it)."""
    issues: list[Issue] = []
    add = lambda code, path, msg: issues.append(Issue(code, path, msg))  # noqa: E731

    for name, t in g.tensors.items():
        p = f"tensors.{name}"
        if len(t.shape) == 0 or any((not isinstance(x, int)) or x < 1 for x in t.shape):
            add("bad-shape", p, f"shape {list(t.shape)} must be a non-empty list of positive integers")
        elif math.prod(t.shape) > MAX_TENSOR_CELLS:
            add("bad-shape", p, f"shape {list(t.shape)} has {math.prod(t.shape):.3g} cells; at most "
                f"2**50 are supported")
        if t.dtype not in DTYPES_OK:
            add("bad-dtype", p, f"dtype {t.dtype!r} is not one of {list(DTYPES_OK)}")
        if t.role not in ROLES:
            add("bad-role", p, f"role {t.role!r} is not one of {list(ROLES)}")

    bad_tensors = {i.path.split(".", 1)[1] for i in issues}  # their ops cannot be checked further
    table_problems: dict[tuple, list[tuple[str, str, str]]] = {}
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
        declared = _declared_ports(o)
        extra = sorted(port for port, _ in o.inputs if declared is not None and port not in declared)
        if extra:
            add("unknown-port", p + ".inputs", f"kernel {o.kernel} has no input port(s) {extra[:8]}; its ports are "
                f"{sorted(declared)}")
        try:
            sig = g.signature(o)
        except SignatureError as e:
            add("signature", p, str(e))
            continue
        except Exception as e:  # noqa: BLE001  (malformed params of a plan file: any failure is a bad plan)
            add("signature", p, f"kernel {o.kernel!r} cannot take params {_short(o.params_key)}: "
                f"{type(e).__name__}: {_short(str(e))}")
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
        key = (id(sh), whole.start, whole.end)  # ops of repeated layers share a table (ir.serialize)
        found = table_problems.get(key)
        if found is None:
            found = table_problems[key] = _table_problems(sh, whole, n_devices)
        for code, where, msg in found:
            add(code, p + ".shards" + where, msg)
        if o.kernel == "fused":
            _check_fused(g, name, o, add)

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


def _table_problems(sh: Shards, whole: ZRange, n_devices: int | None) -> list[tuple[str, str, str]]:
    """``(code, where under the op's shards, message)`` of each problem of the shard table ``sh``
    over the index space ``whole``."""
    found = []
    prob = partition_problem((sh.lo, sh.hi), whole)
    if prob:
        found.append((prob[0], "", prob[1] + "; shards must partition the index space exactly"))
    empty = np.nonzero(np.any(sh.hi <= sh.lo, axis=1))[0] if sh.ndim else np.zeros(0, int)
    if empty.size:
        i = int(empty[0])
        found.append(("empty-shard", f"[{i}]", f"shard box {sh.lo[i].tolist()}..{sh.hi[i].tolist()} holds no "
                      f"index point ({empty.size} empty shard{'s' if empty.size > 1 else ''}); merge it away"))
    bad = np.nonzero(sh.device < 0)[0]
    if bad.size:
        found.append(("bad-device", f"[{int(bad[0])}]", f"device {int(sh.device[bad[0]])} is negative"))
    limit = MAX_DEVICES if n_devices is None else min(n_devices, MAX_DEVICES)
    far = np.nonzero(sh.device >= limit)[0]
    if far.size:
        what = (f"the hardware has {n_devices} devices (0..{n_devices - 1})" if n_devices is not None
                else f"device numbers are below {MAX_DEVICES}")
        found.append(("bad-device", f"[{int(far[0])}]", f"device {int(sh.device[far[0]])} does not exist: {what}"))
    return found


def _declared_ports(o) -> set[str] | None:  # noqa: ANN001
    """The input ports ``o``'s kernel declares (None: the kernel takes ports from its params)."""
    try:
        k = get_kernel(o.kernel)
    except Exception:  # noqa: BLE001  (unknown kernels are reported by the signature check)
        return None
    if k.inputs:
        return set(k.inputs)
    if o.kernel == "fused" and isinstance(o.params.get("stages"), list):
        ports: set[str] = set()
        for i, st in enumerate(o.params["stages"]):
            try:
                sk = get_kernel(st["kernel"])
            except Exception:  # noqa: BLE001
                return None
            if not sk.inputs and i == 0:  # a norm_matmul stage: its ports come from its params
                ports |= {p for p, _ in o.inputs if p.startswith("0.")}
            ports |= {f"{i}.{port}" for port in sk.inputs if not (i > 0 and port == st.get("chain"))}
        return ports
    return None


def _check_fused(g: Graph, name: str, o, add) -> None:  # noqa: ANN001
    """A fused op's stages name fresh ops and fresh intermediate tensors (what ``unfuse`` creates)."""
    p = f"ops.{name}.params.stages"
    stages = o.params.get("stages") or []
    seen_ops: set[str] = set()
    seen_via: set[str] = set()
    for i, st in enumerate(stages):
        if not isinstance(st, dict):
            add("fused-stage", f"{p}[{i}]", "a stage is an object with op, kernel, params, chain and via")
            continue
        op, via = st.get("op"), st.get("via")
        if not isinstance(op, str) or not OP_NAME.fullmatch(op):
            add("fused-stage", f"{p}[{i}].op", f"stage operation name {_short(op)} must match {OP_NAME.pattern}")
        elif op in seen_ops or op in g.ops:
            add("fused-stage", f"{p}[{i}].op", f"stage operation {op!r} repeats another stage or names an "
                "operation of the plan")
        else:
            seen_ops.add(op)
        if i == 0:
            if st.get("chain") is not None or via is not None:
                add("fused-stage", f"{p}[0]", "the first stage reads no previous stage: chain and via must be null")
            continue
        if not isinstance(via, str) or not via:
            add("fused-stage", f"{p}[{i}].via", "a later stage names its intermediate tensor in via")
        elif via in g.tensors or via in seen_via:
            add("fused-stage", f"{p}[{i}].via", f"intermediate {via!r} repeats another stage's or names a tensor "
                "of the plan; unfusing would overwrite it")
        else:
            seen_via.add(via)


def _short(text: object, n: int = 120) -> str:
    s = str(text)
    return s if len(s) <= n else s[: n - 3] + "..."


def out_size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape))


def check(g: Graph, source: str = "graph", n_devices: int | None = None) -> Graph:
    """Return ``g`` if valid, else raise ``InvalidGraph`` listing every issue."""
    issues = validate(g, n_devices)
    if issues:
        raise InvalidGraph(issues, source)
    return g
