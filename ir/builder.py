"""``GraphBuilder``: write tensor programs in Python.

```
b = GraphBuilder()
x = b.input("x", (8, 16))
h = b.linear(x, b.parameter("W1", (16, 32)), b.parameter("b1", (32,)), name="fc1")
y = b.relu(h, name="act1")
g = b.build(outputs=[y])
```
Every kernel in the registry is a method: ``b.<kernel>(*inputs, name=..., **params)`` with
inputs in the kernel's port order (or by port name). Each op starts with one shard on device 0.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import REGISTRY, get_kernel
from ir.validate import check


class GraphBuilder:
    def __init__(self, dtype: str = "float32") -> None:
        self.dtype = dtype
        self._tensors: dict[str, Tensor] = {}
        self._ops: dict[str, Op] = {}

    def _add_tensor(self, t: Tensor) -> str:
        if t.name in self._tensors:
            raise ValueError(f"tensor {t.name!r} already exists")
        self._tensors[t.name] = t
        return t.name

    def input(self, name: str, shape: Sequence[int], dtype: str | None = None) -> str:
        return self._add_tensor(Tensor(name, tuple(shape), dtype or self.dtype, "input"))

    def parameter(self, name: str, shape: Sequence[int], dtype: str | None = None) -> str:
        return self._add_tensor(Tensor(name, tuple(shape), dtype or self.dtype, "parameter"))

    def state(self, name: str, shape: Sequence[int], dtype: str | None = None) -> str:
        """A loop-carried non-parameter source (optimizer moments); see ``ir.graph``."""
        return self._add_tensor(Tensor(name, tuple(shape), dtype or self.dtype, "state"))

    @classmethod
    def from_graph(cls, g: Graph, dtype: str = "float32") -> GraphBuilder:
        """A builder holding ``g``'s tensors and ops (outputs demoted to intermediates), to extend it."""
        b = cls(dtype)
        for n, t in g.tensors.items():
            b._tensors[n] = Tensor(t.name, t.shape, t.dtype, "intermediate") if t.role == "output" else t
        b._ops.update(g.ops)
        return b

    def tensor(self, name: str) -> Tensor:
        return self._tensors[name]

    def rename_outputs(self, names: dict[str, str]) -> None:
        """Give produced tensors new names (``old -> new``); where ops read the old tensor (or no op
        produces it), a copy (``scale`` by 1) gets the new name instead."""
        read = {t for o in self._ops.values() for _, t in o.inputs}
        producer = {o.output: n for n, o in self._ops.items()}
        for old, new in names.items():
            if old in read or old not in producer:
                self.op("scale", re.sub(r"[^A-Za-z0-9_.+-]", "_", new), {"x": old}, out=new, alpha=1.0)
                continue
            t = self._tensors.pop(old)
            self._add_tensor(Tensor(new, t.shape, t.dtype, t.role))
            n = producer.pop(old)
            self._ops[n] = self._ops[n].replace(output=new)
            producer[new] = n

    def op(self, kernel: str, name: str, inputs: dict[str, str], out: str | None = None, **params: Any) -> str:
        """Add an op reading ``inputs`` (port → tensor); returns its output tensor's name
        (``out``, default ``<name>.out``)."""
        if name in self._ops:
            raise ValueError(f"operation {name!r} already exists")
        k = get_kernel(kernel)
        specs = {p: self._tensors[t].spec for p, t in inputs.items()}
        sig = k.signature(specs, params)
        out = self._add_tensor(Tensor(out or f"{name}.out", sig.out_spec.shape, sig.out_spec.dtype, "intermediate"))
        ports = tuple((p, inputs[p]) for p in k.inputs if p in inputs)  # optional ports may be absent
        self._ops[name] = Op(name, kernel, ports, out, dict(params), Shards.whole(sig.extents))
        return out

    def __getattr__(self, kernel: str):
        if kernel.startswith("_") or kernel not in REGISTRY:
            raise AttributeError(kernel)
        ports = REGISTRY[kernel].inputs

        def apply(*args: str, name: str, **kw: Any) -> str:
            inputs = dict(zip(ports, args))
            params = {}
            for key, v in kw.items():
                (inputs if key in ports else params)[key] = v
            return self.op(kernel, name, inputs, **params)

        return apply

    def build(self, outputs: Sequence[str] = ()) -> Graph:
        """The validated graph; ``outputs`` (default: tensors nobody reads) get role output."""
        read = {t for o in self._ops.values() for _, t in o.inputs}
        outs = set(outputs) or {o.output for o in self._ops.values() if o.output not in read}
        tensors = {n: (Tensor(t.name, t.shape, t.dtype, "output") if n in outs else t)
                   for n, t in self._tensors.items()}
        return check(Graph(tensors, dict(self._ops)), "built graph")
