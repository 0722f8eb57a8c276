"""A program under construction: tensors, pending ops and constant values, before it is a ``Graph``.

Importers append ops here one at a time (``emit`` computes each output's shape from the kernel's
signature, so a bad mapping fails at the op that caused it), run the peephole patterns of
``ir.importers.patterns`` over the pending ops, then ``build`` the validated graph with every op
on one shard of device 0, like ``GraphBuilder``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import TensorSpec, get_kernel
from ir.validate import check

_BAD = re.compile(r"[^A-Za-z0-9_.+-]")  # characters op names may not hold (ir.validate.OP_NAME)


@dataclass
class PendingOp:
    name: str
    kernel: str
    inputs: dict[str, str]  # port -> tensor
    params: dict[str, Any]
    output: str


@dataclass
class Program:
    """Tensors (name -> ``Tensor``), ops in order, and values of the parameter tensors."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    ops: dict[str, PendingOp] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)

    # -- naming --------------------------------------------------------------------------
    def op_name(self, wanted: str) -> str:
        """A legal, unused op name close to ``wanted`` (ONNX names like ``/h.0/attn/MatMul``)."""
        base = _BAD.sub("_", wanted).strip("_.+-") or "op"
        name, k = base, 1
        while name in self.ops:
            k += 1
            name = f"{base}_{k}"
        return name

    def tensor_name(self, wanted: str) -> str:
        name, k = wanted, 1
        while name in self.tensors:
            k += 1
            name = f"{wanted}_{k}"
        return name

    # -- construction --------------------------------------------------------------------
    def source(self, name: str, shape: tuple[int, ...], dtype: str, role: str,
               value: np.ndarray | None = None) -> str:
        self.tensors[name] = Tensor(name, tuple(int(d) for d in shape), dtype, role)
        if value is not None:
            self.values[name] = value
        return name

    def emit(self, kernel: str, inputs: Mapping[str, str], params: Mapping[str, Any] | None = None,
             out: str | None = None, name: str | None = None) -> str:
        """Append one op; returns the name of its output tensor (``out`` when given)."""
        params = dict(params or {})
        k = get_kernel(kernel)
        specs = {p: self.tensors[t].spec for p, t in inputs.items()}
        sig = k.signature(specs, params)
        op = self.op_name(name or out or kernel)
        # Intermediate names follow op-name rules (ONNX's "/h.0/attn/Add_output_0" would leak into
        # names derived from them, e.g. autodiff's ops); graph outputs get their ONNX names back.
        out = self.tensor_name(_BAD.sub("_", out).strip("_.+-") or f"{op}.out" if out else f"{op}.out")
        self.tensors[out] = Tensor(out, sig.out_spec.shape, sig.out_spec.dtype, "intermediate")
        self.ops[op] = PendingOp(op, kernel, {p: inputs[p] for p in k.inputs}, params, out)
        return out

    def spec(self, tensor: str) -> TensorSpec:
        return self.tensors[tensor].spec

    # -- queries for the patterns --------------------------------------------------------
    def producer(self, tensor: str) -> PendingOp | None:
        for o in self.ops.values():
            if o.output == tensor:
                return o
        return None

    def readers(self, tensor: str) -> list[PendingOp]:
        return [o for o in self.ops.values() if tensor in o.inputs.values()]

    def scalar(self, tensor: str) -> float | None:
        """The value of a one-cell constant parameter, else None."""
        v = self.values.get(tensor)
        return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None

    def rename(self, old: str, new: str) -> None:
        """Rename tensor ``old`` to ``new`` everywhere (graph outputs keep their ONNX names)."""
        t = self.tensors.pop(old)
        self.tensors[new] = Tensor(new, t.shape, t.dtype, t.role)
        if old in self.values:
            self.values[new] = self.values.pop(old)
        for o in self.ops.values():
            o.inputs = {p: (new if x == old else x) for p, x in o.inputs.items()}
            if o.output == old:
                o.output = new

    def prune(self, keep: set[str]) -> None:
        """Drop ops whose outputs reach no tensor in ``keep``, then tensors nobody uses."""
        live = set(keep)
        for o in reversed(list(self.ops.values())):
            if o.output in live:
                live.update(o.inputs.values())
        self.ops = {n: o for n, o in self.ops.items() if o.output in live}
        used = {o.output for o in self.ops.values()} | {t for o in self.ops.values() for t in o.inputs.values()}
        used |= keep | {n for n, t in self.tensors.items() if t.role == "input"}
        self.tensors = {n: t for n, t in self.tensors.items() if n in used}
        self.values = {n: v for n, v in self.values.items() if n in self.tensors}

    def build(self, outputs: list[str], what: str) -> Graph:
        """The validated graph; ``outputs`` get role ``output``."""
        self.prune(set(outputs))
        tensors = {n: (Tensor(t.name, t.shape, t.dtype, "output") if n in outputs else t)
                   for n, t in self.tensors.items()}
        ops = {}
        for o in self.ops.values():
            sig = get_kernel(o.kernel).signature({p: tensors[t].spec for p, t in o.inputs.items()}, o.params)
            ops[o.name] = Op(o.name, o.kernel, tuple(o.inputs.items()), o.output, o.params, Shards.whole(sig.extents))
        return check(Graph(tensors, ops), what)
