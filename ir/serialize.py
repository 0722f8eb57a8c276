"""JSON form of a graph: a versioned document; loading always validates.

```
{"format": "tapestry-graph/1",
 "tensors": [{"name": "x", "shape": [8, 16], "dtype": "float32", "role": "input"}, ...],
 "ops": [{"name": "fc1", "kernel": "linear", "params": {}, "inputs": {"x": "x", "W": "W1", "b": "b1"},
          "output": "fc1.out", "shards": {"lo": [[0, 0]], "hi": [[8, 32]], "device": [0]}}, ...]}
```
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ir.graph import FORMAT, Graph, Op, Shards, Tensor
from ir.validate import InvalidGraph, Issue, check


class GraphFormatError(InvalidGraph):
    """The document is not a graph document at all (bad JSON, missing or mistyped fields)."""


def dumps(g: Graph, indent: int | None = 1) -> str:
    return json.dumps(g.to_json(), indent=indent)


def save(g: Graph, path: str | Path) -> None:
    Path(path).write_text(dumps(g) + "\n")


def loads(text: str, source: str = "graph") -> Graph:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphFormatError([Issue("bad-json", f"line {e.lineno} column {e.colno}", e.msg)], source) from None
    return from_json(data, source)


def load(path: str | Path) -> Graph:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise GraphFormatError([Issue("no-file", str(p), e.strerror or str(e))], str(p)) from None
    return loads(text, str(p))


def _all_ints(v: Any) -> bool:
    """``v`` is an int (not a bool) or a (nested) list of them."""
    if isinstance(v, list):
        return all(_all_ints(x) for x in v)
    return isinstance(v, int) and not isinstance(v, bool)


def _need(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise GraphFormatError([Issue("bad-format", path, msg)], "document")


def from_json(data: Any, source: str = "graph", validate: bool = True) -> Graph:
    """Build a graph from its JSON document and validate it (raises ``InvalidGraph``)."""
    try:
        return _from_json(data, source, validate)
    except GraphFormatError as e:
        raise GraphFormatError(e.issues, source) from None


def _from_json(data: Any, source: str, validate: bool) -> Graph:
    _need(isinstance(data, dict), "$", "a graph document is a JSON object")
    _need(data.get("format") == FORMAT, "$.format",
          f"format must be {FORMAT!r} (got {data.get('format')!r}); re-export the plan with this version")
    _need(isinstance(data.get("tensors"), list), "$.tensors", "tensors must be a list")
    _need(isinstance(data.get("ops"), list), "$.ops", "ops must be a list")
    tensors: dict[str, Tensor] = {}
    for i, t in enumerate(data["tensors"]):
        p = f"$.tensors[{i}]"
        _need(isinstance(t, dict) and isinstance(t.get("name"), str), p, "a tensor needs a string name")
        _need(t["name"] not in tensors, p, f"duplicate tensor name {t['name']!r}")
        shape = t.get("shape")
        _need(isinstance(shape, list) and all(not isinstance(x, list) and _all_ints(x) for x in shape),
              p + ".shape", "shape must be a list of integers")
        unknown = set(t) - {"name", "shape", "dtype", "role"}
        _need(not unknown, p, f"unknown tensor field(s) {sorted(unknown)}")
        tensors[t["name"]] = Tensor(t["name"], tuple(t["shape"]), t.get("dtype", "float32"),
                                    t.get("role", "intermediate"))
    ops: dict[str, Op] = {}
    for i, o in enumerate(data["ops"]):
        p = f"$.ops[{i}]"
        _need(isinstance(o, dict) and isinstance(o.get("name"), str), p, "an op needs a string name")
        _need(o["name"] not in ops, p, f"duplicate op name {o['name']!r}")
        unknown = set(o) - {"name", "kernel", "params", "inputs", "output", "shards"}
        _need(not unknown, p, f"unknown op field(s) {sorted(unknown)}")
        _need(isinstance(o.get("kernel"), str), p + ".kernel", "kernel must be a string")
        _need(isinstance(o.get("inputs"), dict), p + ".inputs", "inputs must map port names to tensor names")
        _need(isinstance(o.get("output"), str), p + ".output", "output must be a tensor name")
        _need(isinstance(o.get("params", {}), dict), p + ".params", "params must be an object")
        sh = o.get("shards")
        _need(isinstance(sh, dict) and all(k in sh for k in ("lo", "hi", "device")), p + ".shards",
              "shards must be an object with lo, hi and device lists")
        for key in ("lo", "hi", "device"):  # numpy would silently truncate 0.5 or true to an integer
            _need(_all_ints(sh[key]), f"{p}.shards.{key}", f"shard {key} must hold integers only")
        try:
            shards = Shards(sh["lo"], sh["hi"], sh["device"])
            _need(shards.lo.shape == shards.hi.shape, p + ".shards", "lo and hi differ in shape")
        except (ValueError, TypeError) as e:
            raise GraphFormatError([Issue("bad-format", p + ".shards", f"malformed shard table: {e}")]) from None
        ops[o["name"]] = Op(o["name"], o["kernel"], tuple(o["inputs"].items()), o["output"],
                            o.get("params", {}), shards)
    g = Graph(tensors, ops)
    return check(g, source) if validate else g
