"""JSON form of a graph: a versioned document; loading always validates.

```
{"format": "tapestry-graph/1",
 "tensors": [{"name": "x", "shape": [8, 16], "dtype": "float32", "role": "input"}, ...],
 "ops": [{"name": "fc1", "kernel": "linear", "params": {}, "inputs": {"x": "x", "W": "W1", "b": "b1"},
          "output": "fc1.out", "shards": {"lo": [[0, 0]], "hi": [[8, 32]], "device": [0]}}, ...]}
```

**Provenance.** A plan document may name the program it was derived from: ``program_digest``
(the digest of that unsharded program) and, optionally, ``program`` (the program's own graph
document). Neither is part of the plan's graph or digest. Tools that derive plans write them
(``graph build``, ``graph rewrite``, ``export``) so that ``verify`` compares a plan with its
program, not with the plan's own unsharded form; ``load_document`` returns them, checked: an
embedded program must be an unsharded program whose digest is ``program_digest``.

**Shared shard tables.** A whole model repeats its layers, and a plan usually shards every layer
alike. Where a table of two or more shards is used by two or more ops, the writer lists it once
in ``shard_tables`` and those ops name it by its index (``"shards": 3``), under the format
``tapestry-graph/2``; a document with no such table is written as ``tapestry-graph/1``, as before.
A llama2-70b ZeRO-3 step on 512 GPUs (4.6 million shards) takes 2.9 MB so, 129 MB inline. Both
formats are read; the digest is the same either way (``Graph.canonical_json`` writes every table
inline). The loaded ops share one ``Shards`` object per table, and validation checks a table once
per index space it is used for.

Reading is bounded, so a hostile or broken file costs milliseconds and gives one clear
``GraphFormatError`` (never a traceback, never a hang): at most ``MAX_PLAN_BYTES`` of UTF-8 text
(UTF-16 and binary files are named as such), JSON nested at most ``MAX_JSON_DEPTH`` deep, no
``NaN``/``Infinity``, integers of at most ``MAX_INT_DIGITS`` digits and shapes, shard bounds and
devices within ``±MAX_COORD``, at most ``MAX_ITEMS`` tensors, ops and written shards, and at most
``MAX_SHARDS`` shards in all (a shared table counted for each op that uses it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ir.graph import FORMAT, Graph, Op, Shards, Tensor
from ir.validate import InvalidGraph, Issue, check

MAX_PLAN_BYTES = 64 << 20
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 19
MAX_COORD = 2**53
MAX_ITEMS = 1_000_000
MAX_SHARDS = 1 << 26  # ops x their shards, shared tables included: a bound on what validation walks
FORMAT_SHARED = "tapestry-graph/2"  # FORMAT with shard tables that ops share (module doc)
FORMATS = (FORMAT, FORMAT_SHARED)
MAX_RANK = 32


class GraphFormatError(InvalidGraph):
    """The document is not a graph document at all (bad JSON, missing or mistyped fields)."""


def _bad(code: str, path: str, msg: str, source: str) -> GraphFormatError:
    return GraphFormatError([Issue(code, path, msg)], source)


_LONG_DIGITS = re.compile(r"\d{%d}" % (MAX_INT_DIGITS + 1))


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"the number {text[:12]}... has {len(text.lstrip('-'))} digits; at most "
                         f"{MAX_INT_DIGITS} are allowed")
    return int(text)


def _parse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a plan may hold")


def _depth_problem(data: Any) -> str | None:
    """A value nested more than ``MAX_JSON_DEPTH`` levels deep (the top-level value is at 1)."""
    problem = f"the document is nested more than {MAX_JSON_DEPTH} levels deep"
    stack = [(data, 1)]
    while stack:
        v, d = stack.pop()
        if d > MAX_JSON_DEPTH:
            return problem
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        if items and d >= MAX_JSON_DEPTH:  # its members, containers or not, lie one level deeper
            return problem
        # only containers go on the stack (a shard table's millions of numbers are skipped in C)
        stack.extend([(x, d + 1) for x in items if type(x) is list or type(x) is dict])
    return None


_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Provenance:
    """What a plan document says about the program it derives from (see the module docstring)."""

    program_digest: str | None = None
    program: Graph | None = None


def shared_tables(g: Graph) -> dict[str, int]:
    """The shard tables that the document shares, by canonical text: tables of two or more shards
    used by two or more ops, numbered in the order of their first use (a one-shard table is
    written inline: a reference would save a few bytes)."""
    seen: dict[str, int] = {}
    for o in g.ops.values():
        sh = o.shards
        if sh is not None and len(sh) > 1:
            text = sh.canonical_text
            seen[text] = seen.get(text, 0) + 1
    index: dict[str, int] = {}
    for text, uses in seen.items():  # dicts keep first-use order
        if uses > 1:
            index[text] = len(index)
    return index


def _table_of(o: Op, index: dict[str, int]) -> int | None:
    """The index of ``o``'s shard table among the shared ones (``shared_tables``), if it is one."""
    return index.get(o.shards.canonical_text) if index and o.shards is not None and len(o.shards) > 1 else None


def document(g: Graph) -> dict:
    """The plan's JSON document as a dict: ``tapestry-graph/2`` with ``shard_tables`` where ops share
    tables, else ``tapestry-graph/1`` (``Graph.to_json``)."""
    index = shared_tables(g)
    if not index:
        return g.to_json()
    tables: list[dict] = [{}] * len(index)
    ops = []
    for o in g.ops.values():
        i = _table_of(o, index)
        if i is None:
            ops.append(o.to_json())
            continue
        if not tables[i]:  # each table's lists once (``tolist`` of every op's table was 5 s of a 70B plan)
            tables[i] = o.shards.to_json()
        ops.append({"name": o.name, "kernel": o.kernel, "params": o.params, "inputs": dict(o.inputs),
                    "output": o.output, "shards": i})
    return {"format": FORMAT_SHARED, "tensors": [t.to_json() for t in g.tensors.values()], "ops": ops,
            "shard_tables": tables}


def _compact_text(g: Graph) -> str:
    """``document(g)`` as compact JSON, joined from each op's cached canonical text, so a plan that
    shares most ops with one written before (a search's child) costs its new ops only."""
    index = shared_tables(g)
    ops = []
    for o in g.ops.values():
        text = o.canonical_text
        i = _table_of(o, index)
        if i is not None:  # the canonical text ends with the table's text and the op's closing brace
            text = f"{text[:len(text) - len(o.shards.canonical_text) - 1]}{i}}}"
        ops.append(text)
    compact = (",", ":")
    parts = ['{"format":', json.dumps(FORMAT_SHARED if index else FORMAT), ',"tensors":[',
             ",".join(json.dumps(t.to_json(), separators=compact) for t in g.tensors.values()),
             '],"ops":[', ",".join(ops), "]"]
    if index:
        parts += [',"shard_tables":[', ",".join(index), "]"]
    return "".join(parts + ["}"])


def dumps(g: Graph, indent: int | None = 1, program: Graph | None = None, program_digest: str | None = None) -> str:
    """The plan's JSON document (``document``); with ``program`` (embedded, and its digest) or
    ``program_digest`` the document records the program the plan was derived from."""
    if indent is None and program is None and program_digest is None:
        return _compact_text(g)  # a whole model: 1.6 s -> ms
    doc = document(g)
    if program is not None:
        doc["program_digest"] = program.digest
        doc["program"] = document(program)
    elif program_digest is not None:
        doc["program_digest"] = program_digest
    return json.dumps(doc) if indent is None else _lines(doc, " " * indent)


def _lines(doc: dict, pad: str, depth: int = 1) -> str:
    """``doc`` with each tensor, op and shard table on a line of its own (an embedded program's
    too): readable, and written by the C encoder (``json.dumps`` with ``indent`` is pure Python and
    writes every number on a line: a 70B plan took 9 s and 10 MB)."""
    inner, outer = pad * (depth + 1), pad * depth
    fields = []
    for key, value in doc.items():
        if isinstance(value, list) and value:
            items = f",\n{inner}".join(json.dumps(x) for x in value)
            text = f"[\n{inner}{items}\n{outer}]"
        elif key == "program" and isinstance(value, dict):
            text = _lines(value, pad, depth + 1)
        else:
            text = json.dumps(value)
        fields.append(f"{outer}{json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(fields) + "\n" + pad * (depth - 1) + "}"


def save(g: Graph, path: str | Path, program: Graph | None = None) -> None:
    Path(path).write_text(dumps(g, program=program) + "\n")


def loads(text: str, source: str = "graph", n_devices: int | None = None) -> Graph:
    """Parse and validate a plan document (see the module docstring for the limits)."""
    return loads_document(text, source, n_devices)[0]


def loads_document(text: str, source: str = "graph", n_devices: int | None = None) -> tuple[Graph, Provenance]:
    """The plan and its provenance, both checked (``InvalidGraph`` otherwise)."""
    if len(text) > MAX_PLAN_BYTES:
        raise _bad("too-large", "$", f"the document holds {len(text)} characters; plans are at most "
                   f"{MAX_PLAN_BYTES} bytes", source)
    try:
        # the digit limit needs a hook per integer (seconds on a whole-model plan); a document without
        # a run of more digits anywhere parses the same without it
        hook = _parse_int if _LONG_DIGITS.search(text) else None
        data = json.loads(text, parse_int=hook, parse_constant=_parse_constant)
    except json.JSONDecodeError as e:
        raise _bad("bad-json", f"line {e.lineno} column {e.colno}", e.msg, source) from None
    except ValueError as e:
        raise _bad("bad-number", "$", str(e), source) from None
    except RecursionError:
        raise _bad("too-deep", "$", f"the document is nested too deeply (plans nest at most {MAX_JSON_DEPTH} "
                   "levels)", source) from None
    problem = _depth_problem(data)
    if problem:
        raise _bad("too-deep", "$", problem, source)
    g = from_json(data, source, n_devices=n_devices)
    return g, _provenance(data, source)


def _provenance(data: dict, source: str) -> Provenance:
    digest, program_doc = data.get("program_digest"), data.get("program")
    if digest is None and program_doc is None:
        return Provenance()
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise _bad("bad-provenance", "$.program_digest", "program_digest must be the 64 hex digits of the "
                   "program's digest", source)
    if program_doc is None:
        return Provenance(digest)
    program = from_json(program_doc, f"{source} (embedded program)")
    if program.digest != digest:
        raise _bad("bad-provenance", "$.program", f"the embedded program's digest is {program.digest[:12]}..., not "
                   f"program_digest {digest[:12]}...: the file was edited", source)
    if any(len(o.shards) != 1 for o in program.ops.values()):
        raise _bad("bad-provenance", "$.program", "the embedded program must be unsharded (one shard per op)", source)
    return Provenance(digest, program)


def load(path: str | Path, n_devices: int | None = None) -> Graph:
    """Read, parse and validate a plan file; ``n_devices``: devices of the hardware it is for."""
    return load_document(path, n_devices)[0]


def load_document(path: str | Path, n_devices: int | None = None) -> tuple[Graph, Provenance]:
    """Read, parse and validate a plan file and its provenance."""
    p = Path(path)
    src = str(p)
    try:
        if p.is_dir():
            raise _bad("no-file", src, "is a folder, not a plan file", src)
        size = p.stat().st_size
        if size > MAX_PLAN_BYTES:
            raise _bad("too-large", src, f"the file is {size} bytes; plans are at most {MAX_PLAN_BYTES} bytes", src)
        raw = p.read_bytes()
    except OSError as e:
        raise _bad("no-file", src, e.strerror or str(e), src) from None
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or (len(raw) > 3 and (raw[0] == 0) != (raw[1] == 0)):
        raise _bad("bad-encoding", src, "the file is UTF-16 (or UTF-32) text; save the plan as UTF-8", src)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _bad("bad-encoding", src, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): is it a "
                   "plan file?", src) from None
    if "\x00" in text:
        raise _bad("bad-encoding", src, "the file holds NUL bytes: it is binary, not a JSON plan", src)
    return loads_document(text, src, n_devices)


def _all_ints(v: Any) -> bool:
    """``v`` is an int (not a bool) within ``±MAX_COORD``, or a (nested) list of them."""
    if isinstance(v, list):
        if all(type(x) is int for x in v):  # a flat row (the common case): bounds checked in C
            return not v or (-MAX_COORD <= min(v) and max(v) <= MAX_COORD)
        return all(_all_ints(x) for x in v)
    return isinstance(v, int) and not isinstance(v, bool) and -MAX_COORD <= v <= MAX_COORD


def _need(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise GraphFormatError([Issue("bad-format", path, msg)], "document")


def from_json(data: Any, source: str = "graph", validate: bool = True, n_devices: int | None = None) -> Graph:
    """Build a graph from its JSON document and validate it (raises ``InvalidGraph``;
    ``n_devices``: the device count of the hardware the plan is for, if any)."""
    try:
        return _from_json(data, source, validate, n_devices)
    except GraphFormatError as e:
        raise GraphFormatError(e.issues, source) from None
    except InvalidGraph:
        raise
    except RecursionError:
        raise _bad("too-deep", "$", "the document is nested too deeply", source) from None
    except Exception as e:  # noqa: BLE001  (a document no check above foresaw: still bad input, not a crash)
        raise _bad("unreadable", "$", f"the plan cannot be read: {type(e).__name__}: {str(e)[:200]}", source) from None


def _shards(sh: Any, p: str) -> Shards:
    """One shard table from its JSON object (``p``: where it lies in the document)."""
    _need(isinstance(sh, dict) and all(k in sh for k in ("lo", "hi", "device")), p,
          "shards must be an object with lo, hi and device lists" + (
              " (an index into shard_tables needs the format tapestry-graph/2)" if type(sh) is int else ""))
    for key in ("lo", "hi", "device"):  # numpy would silently truncate 0.5 or true to an integer
        _need(isinstance(sh[key], list) and _all_ints(sh[key]), f"{p}.{key}",
              f"shard {key} must be a list of integers within ±2**53")
    try:
        shards = Shards(sh["lo"], sh["hi"], sh["device"])
    except (ValueError, TypeError, OverflowError) as e:
        raise GraphFormatError([Issue("bad-format", p, f"malformed shard table: {e}")]) from None
    _need(shards.lo.shape == shards.hi.shape, p, "lo and hi differ in shape")
    return shards


def _from_json(data: Any, source: str, validate: bool, n_devices: int | None = None) -> Graph:
    _need(isinstance(data, dict), "$", "a graph document is a JSON object")
    _need("format" in data or not {"expressible", "not_expressible", "tensors"} <= set(data), "$",
          "this is the DTensor placements file written beside a generated program, not a plan; "
          "pass the plan itself (NN_<digest>.json, without .placements)")
    _need(data.get("format") in FORMATS, "$.format",
          f"format must be {FORMAT!r} or {FORMAT_SHARED!r} (got {str(data.get('format'))[:40]!r}); re-export the "
          "plan with this version")
    _need(isinstance(data.get("tensors"), list), "$.tensors", "tensors must be a list")
    _need(isinstance(data.get("ops"), list), "$.ops", "ops must be a list")
    _need(len(data["tensors"]) <= MAX_ITEMS and len(data["ops"]) <= MAX_ITEMS, "$",
          f"a plan holds at most {MAX_ITEMS} tensors and {MAX_ITEMS} ops")
    tables: list[Shards] = []
    n_shards = 0  # written: inline tables and shared ones, each once
    if data["format"] == FORMAT_SHARED:
        _need(isinstance(data.get("shard_tables"), list), "$.shard_tables",
              f"a {FORMAT_SHARED} document lists the shard tables its ops share in shard_tables")
        for j, sh in enumerate(data["shard_tables"]):
            tables.append(_shards(sh, f"$.shard_tables[{j}]"))
            n_shards += len(tables[-1])
            _need(n_shards <= MAX_ITEMS, f"$.shard_tables[{j}]", f"a plan holds at most {MAX_ITEMS} shards in all")
    in_all = 0  # each op's shards, a shared table counted for every op that uses it
    tensors: dict[str, Tensor] = {}
    for i, t in enumerate(data["tensors"]):
        p = f"$.tensors[{i}]"
        _need(isinstance(t, dict) and isinstance(t.get("name"), str), p, "a tensor needs a string name")
        _need(t["name"] not in tensors, p, f"duplicate tensor name {t['name']!r}")
        shape = t.get("shape")
        _need(isinstance(shape, list) and len(shape) <= MAX_RANK
              and all(not isinstance(x, list) and _all_ints(x) for x in shape),
              p + ".shape", f"shape must be a list of at most {MAX_RANK} integers, each within ±2**53")
        unknown = set(t) - {"name", "shape", "dtype", "role"}
        _need(not unknown, p, f"unknown tensor field(s) {sorted(unknown)[:10]}")
        _need(isinstance(t.get("dtype", ""), str) and isinstance(t.get("role", ""), str), p,
              "dtype and role must be strings")
        tensors[t["name"]] = Tensor(t["name"], tuple(t["shape"]), t.get("dtype", "float32"),
                                    t.get("role", "intermediate"))
    ops: dict[str, Op] = {}
    for i, o in enumerate(data["ops"]):
        p = f"$.ops[{i}]"
        _need(isinstance(o, dict) and isinstance(o.get("name"), str), p, "an op needs a string name")
        _need(o["name"] not in ops, p, f"duplicate op name {o['name']!r}")
        unknown = set(o) - {"name", "kernel", "params", "inputs", "output", "shards"}
        _need(not unknown, p, f"unknown op field(s) {sorted(unknown)[:10]}")
        _need(isinstance(o.get("kernel"), str), p + ".kernel", "kernel must be a string")
        _need(isinstance(o.get("inputs"), dict) and all(isinstance(v, str) for v in o["inputs"].values()),
              p + ".inputs", "inputs must map port names to tensor names")
        _need(isinstance(o.get("output"), str), p + ".output", "output must be a tensor name")
        _need(isinstance(o.get("params", {}), dict), p + ".params", "params must be an object")
        sh = o.get("shards")
        if type(sh) is int and data["format"] == FORMAT_SHARED:
            _need(0 <= sh < len(tables), p + ".shards", f"shard table {sh} does not exist: shard_tables holds "
                  f"{len(tables)}" + (f" (0..{len(tables) - 1})" if tables else ""))
            shards = tables[sh]
        else:
            shards = _shards(sh, p + ".shards")
            n_shards += len(shards)
            _need(n_shards <= MAX_ITEMS, p + ".shards", f"a plan holds at most {MAX_ITEMS} shards in all")
        in_all += len(shards)
        _need(in_all <= MAX_SHARDS, p + ".shards", f"a plan holds at most {MAX_SHARDS} shards in all, counting a "
              "shared table for each op that uses it")
        ops[o["name"]] = Op(o["name"], o["kernel"], tuple(o["inputs"].items()), o["output"],
                            o.get("params", {}), shards)
    g = Graph(tensors, ops)
    return check(g, source, n_devices) if validate else g
