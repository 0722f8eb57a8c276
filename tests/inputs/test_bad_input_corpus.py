"""Bad input never hurts (issue 14): a generated corpus of malformed campaign configs and plans.

Every case goes through the real command line (``optimizer.cli.main``, in this process so the
corpus stays fast) and must end with exit status 2, one ``error:`` paragraph on stderr, no
traceback, and an archive that is byte-for-byte what it was. The corpus is generated here from
one valid config and one valid plan: encodings (UTF-16, Latin-1, binary, NUL bytes), sizes
(alias bombs, 100k-deep nesting, 5000-digit numbers, huge integers), and every field wrong in
type, range or meaning.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from ir import serialize
from optimizer.cli import main
from tests.farm.conftest import small_config

# ------------------------------------------------------------------------------------------------
# configs


def _cfg_mut(path: tuple, value: Any) -> Callable[[dict], dict]:
    def f(c: dict) -> dict:
        c = copy.deepcopy(c)
        d = c
        for k in path[:-1]:
            d = d.setdefault(k, {})
        if value is _DELETE:
            d.pop(path[-1], None)
        else:
            d[path[-1]] = value
        return c
    return f


_DELETE = object()

CONFIG_MUTATIONS: dict[str, Callable[[dict], dict]] = {
    "seed -1": _cfg_mut(("search", "seed"), -1),
    "seed word": _cfg_mut(("search", "seed"), "x"),
    "seed 2**70": _cfg_mut(("search", "seed"), 2**70),
    "scheduler without port": _cfg_mut(("cluster", "scheduler"), "localhost"),
    "scheduler url without port": _cfg_mut(("cluster", "scheduler"), "tcp://10.0.0.5"),
    "scheduler port 99999": _cfg_mut(("cluster", "scheduler"), "10.0.0.5:99999"),
    "scheduler number": _cfg_mut(("cluster", "scheduler"), 8786),
    "scheduler scheme": _cfg_mut(("cluster", "scheduler"), "http://h:8786"),
    "workers 0": _cfg_mut(("cluster", "workers"), 0),
    "workers -1": _cfg_mut(("cluster", "workers"), -1),
    "workers 1e9": _cfg_mut(("cluster", "workers"), 10**9),
    "threads 0": _cfg_mut(("cluster", "threads_per_worker"), 0),
    "evaluations 0": _cfg_mut(("budget", "evaluations"), 0),
    "evaluations -5": _cfg_mut(("budget", "evaluations"), -5),
    "evaluations 10**30": _cfg_mut(("budget", "evaluations"), 10**30),
    "wall_time -1": _cfg_mut(("budget", "wall_time"), -1),
    "wall_time inf": _cfg_mut(("budget", "wall_time"), float("inf")),
    "wall_time nan": _cfg_mut(("budget", "wall_time"), float("nan")),
    "stall 0": _cfg_mut(("budget", "stall_evaluations"), 0),
    "no budget at all": _cfg_mut(("budget",), {"evaluations": None, "wall_time": None, "stall_evaluations": None}),
    "objectives empty": _cfg_mut(("objectives",), []),
    "objectives repeated": _cfg_mut(("objectives",), ["makespan", "makespan"]),
    "objectives unknown": _cfg_mut(("objectives",), ["speed"]),
    "objectives a word": _cfg_mut(("objectives",), "makespan"),
    "hardware missing": _cfg_mut(("hardware",), _DELETE),
    "hardware unknown": _cfg_mut(("hardware",), "h900-sxm-8"),
    "hardware number": _cfg_mut(("hardware",), 42),
    "hardware yaml missing": _cfg_mut(("hardware",), "/nonexistent/hw.yaml"),
    "workload missing": _cfg_mut(("workload",), _DELETE),
    "workload name and file": _cfg_mut(("workload", "file"), "plan.json"),
    "workload unknown": _cfg_mut(("workload", "name"), "resnet"),
    "workload param unknown": _cfg_mut(("workload", "params", "depth"), 3),
    "workload batch huge": _cfg_mut(("workload", "params", "batch"), 10**100),
    "workload batch word": _cfg_mut(("workload", "params", "batch"), "many"),
    "workload batch negative": _cfg_mut(("workload", "params", "batch"), -4),
    "workload widths nested": _cfg_mut(("workload", "params", "widths"), [[[[[1]]]]]),
    "workload batch inf": _cfg_mut(("workload", "params", "batch"), float("inf")),
    "workload params a list": _cfg_mut(("workload", "params"), [1, 2]),
    "workload file missing": _cfg_mut(("workload",), {"file": "/nonexistent/plan.json"}),
    "workload file with params": _cfg_mut(("workload",), {"file": "plan.json", "params": {"batch": 3}}),
    "workload batch true": _cfg_mut(("workload", "params", "batch"), True),
    "workload widths with a bool": _cfg_mut(("workload", "params", "widths"), [64, True, 64]),
    "name empty": _cfg_mut(("name",), ""),
    "name path": _cfg_mut(("name",), "../evil"),
    "name long": _cfg_mut(("name",), "x" * 300),
    "unknown top key": _cfg_mut(("serach",), {}),
    "unknown nested key": _cfg_mut(("search", "islnds"), 2),
    "islands 0": _cfg_mut(("search", "islands"), 0),
    "population 1e9": _cfg_mut(("search", "population"), 10**9),
    "steps 0": _cfg_mut(("search", "steps_per_task"), 0),
    "mutation unknown": _cfg_mut(("search", "mutation_weights"), {"teleport": 1.0}),
    "mutation negative": _cfg_mut(("search", "mutation_weights"), {"spread": -1.0}),
    "strategy unknown": _cfg_mut(("search", "strategy"), "annealing"),
    "epsilon 0": _cfg_mut(("search", "epsilon"), 0),
    "epsilon 2": _cfg_mut(("search", "epsilon"), 2),
    "sampling rate 2": _cfg_mut(("sampling", "rate"), 2),
    "sampling backend tpu": _cfg_mut(("sampling", "backend"), "tpu"),
    "max_devices 0": _cfg_mut(("constraints", "max_devices"), 0),
    "max_devices beyond hardware": _cfg_mut(("constraints", "max_devices"), 999),
    "checkpoint 0": _cfg_mut(("checkpoint_seconds",), 0),
    "storage url number": _cfg_mut(("storage", "url"), 5),
}


def _raw_configs(tmp: Path, good: dict) -> dict[str, Path]:
    """Files that are not a config at all."""
    text = yaml.safe_dump(good)
    laughs = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    laughs += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    out = {
        "alias bomb": "\n".join(laughs) + "\nname: *a9\n",
        "alias bomb in params": text + "\n".join(laughs).replace("a0:", "x0:", 0) + "\n",
        "recursive alias": "name: &a [*a]\n",
        "not utf-8": text.encode("latin-1", "replace") + "\n# caf\xe9\n".encode("latin-1"),
        "utf-16": text.encode("utf-16"),
        "binary": bytes(range(256)) * 8,
        "nul bytes": text.encode() + b"\x00\x00",
        "deep nesting": "x: " + "[" * 100_000 + "]" * 100_000 + "\n",
        "empty": "",
        "only comments": "# nothing here\n",
        "a list": "- 1\n- 2\n",
        "a scalar": "42\n",
        "bad yaml": "name: [unclosed\n",
        "tabs": "name:\tx\n\tworkload: y\n",
        "too large": "# " + "x" * (1 << 20) + "\n" + text,
        "a key given twice": text + "search: {islands: 3}\n",
    }
    paths = {}
    for name, body in out.items():
        p = tmp / ("raw-" + name.replace(" ", "-") + ".yaml")
        p.write_bytes(body if isinstance(body, bytes) else body.encode())
        paths[name] = p
    (tmp / "a-folder.yaml").mkdir()
    paths["a folder"] = tmp / "a-folder.yaml"
    paths["missing"] = tmp / "missing.yaml"
    return paths


def _run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def _assert_refused(code: int, err: str, what: str) -> None:
    assert code == 2, f"{what}: exit {code}, stderr {err[-800:]}"
    assert err.startswith("error: "), f"{what}: {err[:300]}"
    assert "Traceback" not in err, f"{what}: {err[-1500:]}"
    assert len(err) < 6000, f"{what}: a {len(err)}-character error is not one paragraph"


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    """An archive holding one campaign, which no refused command may change."""
    from storage import Archive

    db = tmp_path_factory.mktemp("archive") / "farm.db"
    with Archive.open(str(db)) as a:
        a.create_campaign("existing", {"config": {}}, "h", ["makespan"], [1.0])
        a.add_results("existing", [{"digest": "a" * 64, "graph_json": "{}", "objectives": {
            "makespan": 1.0, "energy": 1.0, "peak_memory": 1.0, "devices": 1, "bytes_moved": 0.0},
            "feasible": True, "seq": 1}])
    return db


def _bytes(db: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(db.parent.iterdir()) if p.name.startswith(db.name)}


def test_corpus_of_malformed_configs(tmp_path, capsys, archive):
    good = small_config("corpus", str(archive))
    good["cluster"] = {"workers": 1}
    files = {name: tmp_path / f"cfg-{i}.yaml" for i, name in enumerate(CONFIG_MUTATIONS)}
    for name, mutate in CONFIG_MUTATIONS.items():
        files[name].write_text(yaml.safe_dump(mutate(good), allow_unicode=True))
    files.update(_raw_configs(tmp_path, good))
    assert len(files) >= 50
    before = _bytes(archive)
    for name, path in files.items():
        code, err = _run(capsys, "run", str(path), "--db", str(archive), "--quiet")
        _assert_refused(code, err, f"config {name!r}")
    assert _bytes(archive) == before


def test_bad_command_line_budgets_and_addresses(tmp_path, capsys, archive):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(yaml.safe_dump(small_config("cli", str(archive))))
    before = _bytes(archive)
    for extra in (["--evaluations", "-5"], ["--wall-time", "-1"], ["--stall-evaluations", "0"],
                  ["--scheduler", "localhost"], ["--scheduler", "tcp://h"], ["--workers", "0"]):
        code, err = _run(capsys, "run", str(cfg), "--db", str(archive), "--quiet", *extra)
        _assert_refused(code, err, f"run {extra}")
    for extra in (["--evaluations", "-5"], ["--wall-time", "-1"], ["--evaluations", "1"]):
        code, err = _run(capsys, "resume", "existing", "--db", str(archive), "--quiet", *extra)
        _assert_refused(code, err, f"resume {extra}")
    assert _bytes(archive) == before


# ------------------------------------------------------------------------------------------------
# plans


def _good_plan() -> dict:
    from ir import workloads
    from ir.rewrites import parse_move, unshard

    g = workloads.mlp(batch=8, widths=(16, 32, 8))
    p = g
    for m in ("fuse{producer=fc1,consumer=act1}", "split{op=fc1+act1,dim=n,parts=2}",
              "place{op=fc1+act1,devices=[0,1]}", "split{op=fc2,dim=n,parts=2}"):
        p = parse_move(m).apply(p)
    return json.loads(serialize.dumps(p, program=unshard(g)))


def _op(d: dict, kernel: str | None = None, fused: bool = False) -> dict:
    for o in d["ops"]:
        if (fused and o["kernel"] == "fused") or (not fused and (kernel is None or o["kernel"] == kernel)):
            return o
    raise AssertionError(f"no op {kernel or 'fused'} in the plan")


def _plan_mut(fn: Callable[[dict], Any]) -> Callable[[dict], dict]:
    def f(d: dict) -> dict:
        d = copy.deepcopy(d)
        fn(d)
        return d
    return f


def _t(d: dict, role: str = "input") -> dict:
    return next(t for t in d["tensors"] if t["role"] == role)


PLAN_MUTATIONS: dict[str, Callable[[dict], dict]] = {
    "format missing": _plan_mut(lambda d: d.pop("format")),
    "format old": _plan_mut(lambda d: d.update(format="tapestry-graph/0")),
    "format number": _plan_mut(lambda d: d.update(format=1)),
    "tensors an object": _plan_mut(lambda d: d.update(tensors={})),
    "ops a string": _plan_mut(lambda d: d.update(ops="fc1")),
    "tensor without name": _plan_mut(lambda d: d["tensors"][0].pop("name")),
    "tensor name number": _plan_mut(lambda d: d["tensors"][0].update(name=7)),
    "tensor duplicate": _plan_mut(lambda d: d["tensors"].append(dict(d["tensors"][0]))),
    "tensor unknown field": _plan_mut(lambda d: d["tensors"][0].update(colour="red")),
    "dtype number": _plan_mut(lambda d: d["tensors"][0].update(dtype=5)),
    "dtype float128": _plan_mut(lambda d: d["tensors"][0].update(dtype="float128")),
    "role unknown": _plan_mut(lambda d: d["tensors"][0].update(role="weird")),
    "role list": _plan_mut(lambda d: d["tensors"][0].update(role=["input"])),
    "shape negative": _plan_mut(lambda d: _t(d).update(shape=[-8, 16])),
    "shape zero": _plan_mut(lambda d: _t(d).update(shape=[0, 16])),
    "shape empty": _plan_mut(lambda d: _t(d).update(shape=[])),
    "shape float": _plan_mut(lambda d: _t(d).update(shape=[8.5, 16])),
    "shape bool": _plan_mut(lambda d: _t(d).update(shape=[True, 16])),
    "shape 2**70": _plan_mut(lambda d: _t(d).update(shape=[2**70, 16])),
    "shape 2**60": _plan_mut(lambda d: _t(d).update(shape=[2**60, 16])),
    "shape too many cells": _plan_mut(lambda d: _t(d).update(shape=[2**40, 2**40])),
    "shape rank 40": _plan_mut(lambda d: _t(d).update(shape=[1] * 40)),
    "shape nested": _plan_mut(lambda d: _t(d).update(shape=[[8], [16]])),
    "op without name": _plan_mut(lambda d: d["ops"][0].pop("name")),
    "op duplicate": _plan_mut(lambda d: d["ops"].append(copy.deepcopy(d["ops"][0]))),
    "op name with braces": _plan_mut(lambda d: d["ops"][-1].update(name="fc{2}")),
    "op unknown field": _plan_mut(lambda d: d["ops"][0].update(priority=1)),
    "kernel missing": _plan_mut(lambda d: d["ops"][0].pop("kernel")),
    "kernel unknown": _plan_mut(lambda d: d["ops"][0].update(kernel="teleport")),
    "kernel number": _plan_mut(lambda d: d["ops"][0].update(kernel=7)),
    "kernel swapped": _plan_mut(lambda d: _op(d, "linear").update(kernel="relu")),
    "inputs a list": _plan_mut(lambda d: d["ops"][0].update(inputs=["x"])),
    "inputs value number": _plan_mut(lambda d: d["ops"][0]["inputs"].update(x=3)),
    "inputs value list": _plan_mut(lambda d: d["ops"][0]["inputs"].update(x=["x"])),
    "input unknown tensor": _plan_mut(lambda d: d["ops"][0]["inputs"].update(x="nope")),
    "input port unknown": _plan_mut(lambda d: d["ops"][0]["inputs"].update(q="x")),
    "output unknown": _plan_mut(lambda d: d["ops"][0].update(output="nope")),
    "output number": _plan_mut(lambda d: d["ops"][0].update(output=1)),
    "params a list": _plan_mut(lambda d: d["ops"][0].update(params=[1])),
    "params unknown": _plan_mut(lambda d: _op(d, "linear").update(params={"bias": "maybe"})),
    "params deep": _plan_mut(lambda d: d["ops"][0].update(params={"a": json.loads("[" * 500 + "]" * 500)})),
    "shards missing": _plan_mut(lambda d: d["ops"][0].pop("shards")),
    "shards list": _plan_mut(lambda d: d["ops"][0].update(shards=[])),
    "shards without device": _plan_mut(lambda d: d["ops"][0]["shards"].pop("device")),
    "shards ragged": _plan_mut(lambda d: d["ops"][0]["shards"].update(lo=[[0, 0], [4]])),
    "shards lo/hi differ": _plan_mut(lambda d: d["ops"][0]["shards"].update(hi=[[8, 32, 1]])),
    "shards float": _plan_mut(lambda d: d["ops"][0]["shards"].update(device=[0.5, 1])),
    "shards bool": _plan_mut(lambda d: d["ops"][0]["shards"].update(device=[True, False])),
    "shards 2**70": _plan_mut(lambda d: d["ops"][0]["shards"]["hi"][0].__setitem__(0, 2**70)),
    "device negative": _plan_mut(lambda d: d["ops"][0]["shards"].update(device=[-1, 0])),
    "device 2**30": _plan_mut(lambda d: d["ops"][0]["shards"].update(device=[0, 2**30])),
    "device beyond the hardware": _plan_mut(lambda d: d["ops"][0]["shards"].update(device=[0, 64])),
    "zero-size shard": _plan_mut(lambda d: (d["ops"][-1]["shards"]["lo"].append(list(d["ops"][-1]["shards"]["hi"][0])),
                                            d["ops"][-1]["shards"]["hi"].append(list(d["ops"][-1]["shards"]["hi"][0])),
                                            d["ops"][-1]["shards"]["device"].append(0))),
    "overlapping shards": _plan_mut(lambda d: d["ops"][0]["shards"].update(
        lo=[[0, 0], [0, 0]], hi=[list(d["ops"][0]["shards"]["hi"][1]), list(d["ops"][0]["shards"]["hi"][1])])),
    "shards miss cells": _plan_mut(lambda d: d["ops"][0]["shards"].update(
        lo=d["ops"][0]["shards"]["lo"][:1], hi=d["ops"][0]["shards"]["hi"][:1], device=[0])),
    "cycle": _plan_mut(lambda d: d["ops"][0]["inputs"].update(x=d["ops"][-1]["output"])),
    "two producers": _plan_mut(lambda d: d["ops"].append({**copy.deepcopy(d["ops"][0]), "name": "again"})),
    "produced input": _plan_mut(lambda d: d["ops"][0].update(output=_t(d)["name"])),
    "no producer": _plan_mut(lambda d: d["tensors"].append({"name": "orphan", "shape": [2], "dtype": "float32",
                                                            "role": "intermediate"})),
    "output shape wrong": _plan_mut(lambda d: next(t for t in d["tensors"] if t["role"] == "output").update(
        shape=[3, 3])),
    "output dtype wrong": _plan_mut(lambda d: next(t for t in d["tensors"] if t["role"] == "output").update(
        dtype="float16")),
    "fused extra stage via a tensor": _plan_mut(lambda d: _op(d, fused=True)["params"]["stages"].append(
        {**_op(d, fused=True)["params"]["stages"][-1], "op": "extra", "via": _op(d, fused=True)["output"]})),
    "fused extra stage via an input": _plan_mut(lambda d: _op(d, fused=True)["params"]["stages"].append(
        {**_op(d, fused=True)["params"]["stages"][-1], "op": "extra", "via": _t(d)["name"]})),
    "fused stage op clash": _plan_mut(lambda d: _op(d, fused=True)["params"]["stages"][-1].update(
        op=d["ops"][0]["name"])),
    "fused first stage chained": _plan_mut(lambda d: _op(d, fused=True)["params"]["stages"][0].update(
        chain="x", via="t")),
    "fused single stage": _plan_mut(lambda d: _op(d, fused=True)["params"].update(
        stages=_op(d, fused=True)["params"]["stages"][:1])),
    "fused stages not a list": _plan_mut(lambda d: _op(d, fused=True)["params"].update(stages="all")),
    "fused stage a number": _plan_mut(lambda d: _op(d, fused=True)["params"]["stages"].append(3)),
    "shared table missing": _plan_mut(lambda d: (d.update(format="tapestry-graph/2"), d["ops"][0].update(shards=0))),
    "shared table index past the end": _plan_mut(lambda d: (
        d.update(format="tapestry-graph/2", shard_tables=[d["ops"][0]["shards"]]), d["ops"][0].update(shards=1))),
    "shared table that another op does not fit": _plan_mut(lambda d: (
        d.update(format="tapestry-graph/2", shard_tables=[d["ops"][0]["shards"]]), d["ops"][0].update(shards=0),
        d["ops"][-1].update(shards=0))),
    "shared table index in a tapestry-graph/1 plan": _plan_mut(lambda d: d["ops"][0].update(shards=0)),
    "program digest short": _plan_mut(lambda d: d.update(program_digest="abc")),
    "program edited": _plan_mut(lambda d: d["program"]["ops"][0].update(name="renamed")),
    "program sharded": _plan_mut(lambda d: d.update(program=copy.deepcopy({k: d[k] for k in ("format", "tensors",
                                                                                               "ops")}))),
}

#: cases that are malformed only for a given hardware
HARDWARE_ONLY = {"device beyond the hardware"}

RAW_PLANS: dict[str, bytes] = {
    "empty": b"",
    "null": b"null",
    "a list": b"[]",
    "a number": b"42",
    "a string": b'"plan"',
    "truncated": b'{"format": "tapestry-graph/1", "tensors": [',
    "trailing garbage": b'{"format": "tapestry-graph/1", "tensors": [], "ops": []} xyz',
    "deep nesting 100k": b"[" * 100_000 + b"]" * 100_000,
    "deep object nesting": b'{"a":' * 5000 + b"1" + b"}" * 5000,
    "5000-digit number": b'{"format": "tapestry-graph/1", "tensors": [{"name": "x", "shape": [' + b"9" * 5000
                         + b'], "dtype": "float32", "role": "input"}], "ops": []}',
    "25-digit number": b'{"format": "tapestry-graph/1", "tensors": [], "ops": [], "x": ' + b"1" * 25 + b"}",
    "NaN": b'{"format": "tapestry-graph/1", "tensors": [{"name": "x", "shape": [NaN], "dtype": "float32"}], "ops": []}',
    "Infinity in params": b'{"format": "tapestry-graph/1", "tensors": [], "ops": [{"name": "a", "params": '
                          b'{"eps": Infinity}}]}',
    "binary": bytes(range(256)) * 16,
    "nul bytes": b'{"format": "tapestry-graph/1"\x00}',
    "latin-1": '{"format": "tapestry-graph/1", "tensors": [{"name": "caf\xe9"}], "ops": []}'.encode("latin-1"),
}


def _plan_files(tmp: Path) -> dict[str, Path]:
    good = _good_plan()
    files: dict[str, Path] = {}
    for i, (name, mutate) in enumerate(PLAN_MUTATIONS.items()):
        p = tmp / f"plan-{i}.json"
        p.write_text(json.dumps(mutate(good)))
        files[name] = p
    text = json.dumps(good)
    extra = {**RAW_PLANS, "utf-16": text.encode("utf-16"), "utf-16 without BOM": text.encode("utf-16-le"),
             "utf-32": text.encode("utf-32")}
    for i, (name, body) in enumerate(extra.items()):
        p = tmp / f"raw-{i}.json"
        p.write_bytes(body)
        files[name] = p
    (tmp / "folder.json").mkdir()
    files["a folder"] = tmp / "folder.json"
    files["missing"] = tmp / "missing.json"
    return files


def test_the_good_plan_passes(tmp_path, capsys):
    p = tmp_path / "good.json"
    p.write_text(json.dumps(_good_plan()))
    assert _run(capsys, "graph", "validate", str(p), "--hardware", "h100-sxm-8")[0] == 0
    code, err = _run(capsys, "verify", str(p))
    assert code == 0, err


def test_corpus_of_malformed_plans(tmp_path, capsys, archive):
    files = _plan_files(tmp_path)
    assert len(files) >= 75
    before = _bytes(archive)
    for name, path in files.items():
        for argv in (["graph", "validate", str(path), "--hardware", "h100-sxm-8"],
                     ["verify", str(path), "--db", str(archive)],
                     ["eval", str(path), "--hardware", "h100-sxm-8"]):
            if name in HARDWARE_ONLY and "--hardware" not in argv:
                continue  # a plan for 128 devices is fine where no hardware is named
            code, err = _run(capsys, *argv)
            _assert_refused(code, err, f"plan {name!r}: {argv[0]}")
    assert _bytes(archive) == before


def test_oversized_plan_is_refused_by_size(tmp_path, capsys, monkeypatch):
    p = tmp_path / "big.json"
    p.write_text(json.dumps(_good_plan()))
    monkeypatch.setattr(serialize, "MAX_PLAN_BYTES", 1000)
    code, err = _run(capsys, "graph", "validate", str(p))
    _assert_refused(code, err, "oversized plan")
    assert "at most 1000 bytes" in err


def test_valid_plan_too_large_to_execute_is_refused_at_once(tmp_path, capsys):
    """A valid plan with 2**20 rows ran verify until killed; now it is refused before running."""
    import time

    p = tmp_path / "rows.json"
    assert _run(capsys, "graph", "build", "mlp", "-o", str(p), "--set", f"batch={2**20}",
                "--set", "widths=[1024,4096,1024]")[0] == 0
    t0 = time.monotonic()
    code, err = _run(capsys, "verify", str(p))
    _assert_refused(code, err, "2**20 rows")
    assert "--max-bytes" in err and time.monotonic() - t0 < 30


# ------------------------------------------------------------------------------------------------
# command-line arguments (each once raised a traceback or was silently accepted)

BAD_COMMANDS: dict[str, list[str]] = {
    "build batch true": ["graph", "build", "mlp", "--set", "batch=true", "-o", "{tmp}/x.json"],
    "build batch huge": ["graph", "build", "mlp", "--set", f"batch={10**23}", "-o", "{tmp}/x.json"],
    "build batch half": ["graph", "build", "mlp", "--set", "batch=8.5", "-o", "{tmp}/x.json"],
    "build batch null": ["graph", "build", "mlp", "--set", "batch=null", "-o", "{tmp}/x.json"],
    "build widths a number": ["graph", "build", "mlp", "--set", "widths=5", "-o", "{tmp}/x.json"],
    "build widths with a bool": ["graph", "build", "mlp", "--set", "widths=[64,true,64]", "-o", "{tmp}/x.json"],
    "build heads 0": ["graph", "build", "transformer", "--set", "heads=0", "-o", "{tmp}/x.json"],
    "build heads -2": ["graph", "build", "transformer", "--set", "heads=-2", "-o", "{tmp}/x.json"],
    "build d_model 0": ["graph", "build", "transformer", "--set", "d_model=0", "-o", "{tmp}/x.json"],
    "build channels empty": ["graph", "build", "convnet", "--set", "channels=[]", "-o", "{tmp}/x.json"],
    "build layers true": ["graph", "build", "gpt", "--set", "layers=true", "-o", "{tmp}/x.json"],
    "build d_ff 0": ["graph", "build", "llama", "--set", "d_ff=0", "-o", "{tmp}/x.json"],
    "build kv_heads 0": ["graph", "build", "llama", "--set", "kv_heads=0", "-o", "{tmp}/x.json"],
    "build tied 3": ["graph", "build", "gpt", "--set", "tied=3", "-o", "{tmp}/x.json"],
    "build into a folder": ["graph", "build", "mlp", "-o", "{tmp}"],
    "move parts a word": ["graph", "rewrite", "{plan}", "split{op=fc1,dim=o,parts=abc}", "-o", "{tmp}/x.json"],
    "move parts 1e3": ["graph", "rewrite", "{plan}", "split{op=fc1,dim=o,parts=1e3}", "-o", "{tmp}/x.json"],
    "two moves without ;": ["graph", "rewrite", "{plan}", "split{op=fc1,dim=o,parts=4} place{op=fc1,devices=[0,1]}",
                            "-o", "{tmp}/x.json"],
    "devices a number": ["graph", "rewrite", "{plan}", "place{op=fc1,devices=0}", "-o", "{tmp}/x.json"],
    "device 10**23": ["graph", "rewrite", "{plan}", f"place{{op=fc1,devices=[{10**23}]}}", "-o", "{tmp}/x.json"],
    "mesh 0": ["graph", "rewrite", "{plan}", "layout{ops=all,mesh=0,use=b}", "-o", "{tmp}/x.json"],
    "no move": ["graph", "rewrite", "{plan}", ";", "-o", "{tmp}/x.json"],
    "rewrite into a folder": ["graph", "rewrite", "{plan}", "split{op=fc1,dim=o,parts=2}", "-o", "{tmp}"],
    "gantt into a folder": ["eval", "{plan}", "--hardware", "h100-sxm-8", "--gantt", "{tmp}/d.svg"],
    "gantt folder missing": ["eval", "{plan}", "--hardware", "h100-sxm-8", "--gantt", "{tmp}/no/g.png"],
    "verify seed -1": ["verify", "{plan}", "--seed", "-1"],
    "verify max-bytes nan": ["verify", "{plan}", "--max-bytes", "nan"],
    "verify max-bytes -1": ["verify", "{plan}", "--max-bytes", "-1"],
    "verify values a folder": ["verify", "{plan}", "--values", "{tmp}"],
    "verify values not npz": ["verify", "{plan}", "--values", "{plan}"],
    "execute seed -1": ["execute", "{plan}", "--seed", "-1"],
    "experts unknown fleet": ["experts", "{plan}", "--hardware", "h100-sxm-8,h100-sxm-9"],
    "experts no fleet": ["experts", "{plan}", "--hardware", ","],
    "experts layers some": ["experts", "{plan}", "--hardware", "h100-sxm-8", "--layers", "some"],
    "experts out a file": ["experts", "{plan}", "--hardware", "h100-sxm-8", "--out", "{plan}"],
    "experts missing program": ["experts", "{tmp}/none.json", "--hardware", "h100-sxm-8"],
}


def test_bad_command_line_arguments(tmp_path, capsys):
    plan = tmp_path / "mlp.json"
    assert _run(capsys, "graph", "build", "mlp", "-o", str(plan))[0] == 0
    (tmp_path / "d.svg").mkdir()
    for name, argv in BAD_COMMANDS.items():
        code, err = _run(capsys, *(a.replace("{tmp}", str(tmp_path)).replace("{plan}", str(plan)) for a in argv))
        _assert_refused(code, err, name)
    assert not (tmp_path / "x.json").exists()


def test_an_sqlite_file_of_another_program_is_not_made_an_archive(tmp_path, capsys):
    """``run --db other.db`` on an unrelated SQLite database added the archive's tables to it
    (and switched it to WAL); it is refused and the file is left byte for byte."""
    import sqlite3

    db = tmp_path / "other.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE people (name TEXT)")
    conn.commit()
    conn.close()
    before = db.read_bytes()
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(yaml.safe_dump(small_config("other", str(db))))
    for argv in (["run", str(cfg), "--db", str(db), "--quiet"], ["archive", "compact", "other", "--db", str(db)]):
        code, err = _run(capsys, *argv)
        _assert_refused(code, err, " ".join(argv[:2]))
        assert "not a Tapestry archive" in " ".join(err.split())
    assert db.read_bytes() == before


def test_sql_with_a_limit_beyond_a_c_int_and_an_empty_front_export(tmp_path, capsys, archive):
    """``sql --limit 2147483647`` overflowed the driver's fetch (a traceback); exporting a campaign
    whose front is empty (stopped at once) failed drawing log axes with no data."""
    before = _bytes(archive)
    code, err = _run(capsys, "sql", "--db", str(archive), "SELECT 1 AS one", "--limit", str(2**31 - 1))
    assert code == 0, err
    assert _bytes(archive) == before
    from costmodel.presets import PRESETS
    from storage import Archive

    db = tmp_path / "empty.db"
    with Archive.open(str(db)) as a:  # a campaign created, stopped before its first evaluation
        a.create_campaign("empty", {"config": {}, "hardware": PRESETS["h100-sxm-8"].to_dict()}, "h",
                          ["makespan", "peak_memory"], [1.0, 1.0])
    out = tmp_path / "exp"
    code, err = _run(capsys, "export", "empty", "--db", str(db), "--out", str(out))
    assert code == 0, err
    assert (out / "pareto.png").stat().st_size > 1000 and "front plans: 0" in (out / "summary.md").read_text()
