"""Test data builders and subprocess workers for the storage tests.

Imported by the test modules and, under multiprocessing spawn, by worker processes: it imports
nothing but the standard library and ``storage``.
"""

from __future__ import annotations

import hashlib
import json
import traceback
from typing import Any

from storage import Archive

OBJECTIVES = ["makespan", "energy", "peak_memory", "devices", "bytes_moved"]
REFERENCE_POINT = [1.0, 5000.0, 8e10, 64.0, 1e12]


def graph_json(tag: str) -> str:
    """A small graph-like JSON document, distinct per tag."""
    doc = {
        "format": 1,
        "tag": tag,
        "tensors": {"x": {"shape": [1024, 4096], "dtype": "float32", "role": "input"}},
        "ops": [{"kernel": "linear", "shards": [[0, 256], [256, 512]], "devices": [0, 1]}],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def digest_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def result(
    tag: str,
    seq: int,
    *,
    parent: str | None = None,
    makespan: float = 0.0125,
    devices: int = 4,
    feasible: bool = True,
    rewrite: str | None = "split{op=fc1,dim=o,parts=4}",
) -> dict[str, Any]:
    """One add_results item with realistic objective values."""
    text = graph_json(tag)
    return {
        "digest": digest_of(text),
        "graph_json": text,
        "parent_digest": parent,
        "rewrite": rewrite,
        "objectives": {
            "makespan": makespan,
            "energy": makespan * 700.0 * devices,
            "peak_memory": 3.5e9 + seq,
            "devices": devices,
            "bytes_moved": 1.25e8 * devices,
        },
        "feasible": feasible,
        "lower_bound": makespan / 2,
        "gap": 1.0,
        "worker": "tcp://127.0.0.1:40001",
        "eval_seconds": 0.0031,
        "seq": seq,
    }


def new_campaign(archive: Archive, name: str = "mlp-h100x8") -> int:
    return archive.create_campaign(
        name,
        {"workload": "mlp", "hardware": "h100_sxm_x8", "strategy": {"kind": "island", "seed": 7}},
        "cfg-" + digest_of(name)[:16],
        OBJECTIVES,
        REFERENCE_POINT,
    )


def write_batches(
    url: str, campaign: str, worker: int, n_batches: int, barrier: Any, errors: Any
) -> None:
    """Worker: store ``n_batches`` batches of 3 own + 1 shared candidate each."""
    try:
        with Archive.open(url) as archive:
            barrier.wait(timeout=60)
            inserted = 0
            for b in range(n_batches):
                batch = [result(f"w{worker}-b{b}-i{i}", b * 10 + i) for i in range(3)]
                batch.append(result(f"shared-b{b}", b * 10 + 3))
                inserted += archive.add_results(campaign, batch)
            errors.put(("inserted", worker, inserted))
    except BaseException:  # report to the parent, whatever it is
        errors.put(("error", worker, traceback.format_exc()))


def increment_counter(
    url: str, campaign: str, worker: int, n_increments: int, barrier: Any, errors: Any
) -> None:
    """Worker: read-modify-write the campaign counters ``n_increments`` times."""
    try:
        with Archive.open(url) as archive:
            barrier.wait(timeout=60)
            for _ in range(n_increments):
                archive.increment_counters(campaign, {"evaluations": 1, f"w{worker}": 1})
            errors.put(("done", worker, n_increments))
    except BaseException:
        errors.put(("error", worker, traceback.format_exc()))


def open_fresh(
    url: str, campaign: str, worker: int, _count: int, barrier: Any, errors: Any
) -> None:
    """Worker: open (and so migrate) a fresh archive at the same moment as another process."""
    try:
        barrier.wait(timeout=60)
        with Archive.open(url) as archive:
            new_campaign(archive, f"{campaign}-{worker}")
        errors.put(("done", worker, 1))
    except BaseException:
        errors.put(("error", worker, traceback.format_exc()))
