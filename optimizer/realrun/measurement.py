"""Real measurements of a plan next to the cost model's predictions, ready for the archive.

``measure_plan(g, hw, backend)`` runs ``g`` device-aware (``executor.device_run``: one buffer set
per plan device, moving exactly the boxes of ``costmodel.transfers.transfer_plan``), checks its
outputs against the unsharded program, and returns one record per shard, per transfer and for the
whole plan, each with the model's prediction on ``hw``:

- ``shard``: the lowering's duration of that shard (roofline with the efficiency factors and
  launch overhead of its kernel class);
- ``transfer``: the lowering's duration of that transfer (link latency + bytes / bandwidth);
- ``plan``: the serial prediction (``costmodel.evaluate.serial_prediction``: every shard one
  after another on one device, which is how one machine executes it); ``details`` adds the
  simulated makespan and the serial time including transfers.

Predictions are made on ``hw`` as given; pass ``executed_hardware(hw)`` (``hw`` with
``staged_fusion``, as the sampler, the offline calibration and ``scripts/bench_fidelity.py`` do)
to predict what this executor does: it runs a fused op's stages one after another
(``ir.kernels.fused``), each its own NumPy or CuPy kernel. Shard records of fused ops carry that
per-stage work (``details["stages"]``), which the online refit uses.

The plan's measured time is *robust to other processes*: the sum of the medians (``statistic``:
or minima) of its shards and transfers plus the median of the executor's own time between them (``DeviceRunResult.
gap_seconds``), not the median of whole-run wall times. On a shared machine the scheduler takes
time slices of ~4 ms from a run (measured on this 2-vCPU VM: a 17-shard MLP plan whose shard
medians add up to 15 ms had whole runs of 28-45 ms, each run hit on different shards), which
the per-item medians drop and the whole-run median keeps. The wall median stays in
``details["wall_median_seconds"]``.

Records have the keys of ``storage.Archive.add_measurements``; ``store_measurements`` writes them.

``merge_rounds`` makes one measurement of a plan out of several ``measure_plan`` calls made at
different times (``optimizer.realrun.rounds``: interleaved passes over many plans, so that a slow
spell of the machine hits every plan alike instead of the few measured during it).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np


def _plan_hardware(g: Any, hw: Any) -> Any:
    """``hw``, or (when the plan names more devices than it has) one node big enough for the plan."""
    top = 1 + max(g.devices, default=0)
    if top <= hw.n_devices:
        return hw
    return hw.replace(n_nodes=1, devices_per_node=top)


def executed_hardware(hw: Any) -> Any:
    """``hw`` as this repository's executor runs plans on it: fused ops stage by stage
    (``Hardware.staged_fusion``)."""
    from costmodel.hardware_io import load_hardware

    hw = load_hardware(hw)
    return hw if hw.staged_fusion else hw.replace(staged_fusion=True)


def stage_work(g: Any, o: Any) -> list[list[list[Any]]] | None:
    """Per shard of a fused op ``o``: ``[[kernel_class, flops, bytes], ...]`` of its stages as the
    executor runs them (stage 0 at the op's class with the op's bytes, then each epilogue stage
    from ``Fused.epilogue_work``); None for other ops."""
    if o.kernel != "fused":
        return None
    from costmodel.lowering import kernel_class_of
    from ir.kernels import get_kernel
    from ir.zspace import project_boxes

    sig = g.signature(o)
    sh = o.shards
    work = get_kernel("fused").epilogue_work(sig, o.params)
    lo, hi = project_boxes(sig.output, sh.lo, sh.hi)
    cells = np.prod(np.maximum(hi - lo, 0), axis=1).astype(np.float64)
    flops = sig.flops(sh.lo, sh.hi).astype(np.float64)
    read, written = sig.io_bytes(sh.lo, sh.hi)
    nbytes = (read + written).astype(np.float64)
    k0 = kernel_class_of(o)
    out = []
    for i in range(len(sh)):
        ep = sum(fl for _, fl, _ in work) * cells[i]
        out.append([[k0, float(max(flops[i] - ep, 0.0)), float(nbytes[i])]]
                   + [[k, float(fl * cells[i]), float(by * cells[i])] for k, fl, by in work])
    return out


def measure_plan(g: Any, hw: Any, backend: str = "numpy", repeats: int = 3, warmup: int = 1, seed: int = 0,
                 campaign: str | None = None, device_map: Any = None,
                 statistic: str = "median") -> list[dict[str, Any]]:
    """Measurement records (kinds ``plan``, ``shard``, ``transfer``) of plan ``g``; see the module
    docstring. ``hw``: a Hardware, preset name or YAML path (the model the predictions use).
    ``statistic``: of each shard's and transfer's timed runs, ``median`` or ``min`` (the least
    disturbed run; on a shared machine the steadier figure)."""
    from executor.measure import STATISTICS

    pick = STATISTICS[statistic]
    from costmodel.evaluate import serial_prediction
    from costmodel.lowering import Lowerer
    from costmodel.transfers import transfer_plan
    from executor.device_run import device_name, run_on_devices
    from executor.run import execute, outputs, random_inputs
    from executor.verify import TOLERANCE, rel_error
    from ir.rewrites import unshard

    from costmodel.hardware_io import load_hardware

    hw = load_hardware(hw)
    hwp = _plan_hardware(g, hw)
    tp = transfer_plan(g, hwp)
    ref_graph = unshard(g)
    inputs = random_inputs(ref_graph, seed)
    run = run_on_devices(g, tp.transfers, tp.residency, backend=backend, device_map=device_map, timing=True,
                         repeats=repeats, warmup=warmup, inputs=inputs, state_transfers=tp.state_transfers)
    ref = execute(ref_graph, inputs, "numpy")
    per = {n: rel_error(run.outputs[n], np.asarray(ref[n])) for n in outputs(ref_graph)}
    worst = max(per.values(), default=0.0)
    tol = max((TOLERANCE[ref_graph.tensors[n].dtype] for n in per), default=TOLERANCE["float32"])

    low = Lowerer(hwp).lower(g)
    nc = int(low.op_offsets[-1])
    first = {name: int(low.op_offsets[i]) for i, name in enumerate(low.op_names)}
    moves = tp.transfers + tp.state_transfers  # the lowering's transfer nodes, in this order
    aligned = (len(low.dur) - nc == len(moves)
               and all(int(low.dev[nc + k]) == t["src"] and int(low.dst[nc + k]) == t["dst"]
                       for k, t in enumerate(moves)))
    base = {"plan_digest": g.digest, "backend": backend}
    if campaign is not None:
        base["campaign"] = campaign
    names = {gpu: device_name(backend, gpu) for gpu in set(run.device_map.values())}
    plan_device = names[next(iter(run.device_map.values()))] if run.device_map else device_name(backend)
    from costmodel.lowering import kernel_class_of

    kclass = {n: kernel_class_of(o) for n, o in g.ops.items()}
    dtypes = {n: g.tensors[o.output].dtype for n, o in g.ops.items()}
    stages = {n: stage_work(g, o) for n, o in g.ops.items()}
    records: list[dict[str, Any]] = []
    for s in run.shards:
        records.append({**base, "kind": "shard", "device_name": names[s["gpu"]], "op": s["op"], "shard": s["shard"],
                        "measured_seconds": float(pick(s["samples"])),
                        "predicted_seconds": float(low.dur[first[s["op"]] + s["shard"]]),
                        "details": {"device": s["device"], "gpu": s["gpu"],
                                    # what the online refit (optimizer.realrun.online) needs per shard
                                    "kernel_class": kclass[s["op"]], "dtype": dtypes[s["op"]],
                                    "flops": float(low.flops[first[s["op"]] + s["shard"]]),
                                    "bytes": float(low.nbytes[first[s["op"]] + s["shard"]])
                                    if hasattr(low, "nbytes") else None}
                        | ({"stages": stages[s["op"]][s["shard"]]} if stages[s["op"]] is not None else {})})
    for t in run.transfers:
        k = t["index"] + (len(tp.transfers) if t.get("state") else 0)
        pred = (float(low.elapsed[nc + k]) if aligned
                else float(hwp.transfer_time(t["src"], t["dst"], t["bytes"] or 0.0)))
        records.append({**base, "kind": "transfer", "device_name": names[run.device_map[t["dst"]]],
                        "op": t["producer"], "shard": t["shard"], "measured_seconds": float(pick(t["samples"])),
                        "predicted_seconds": pred,
                        "details": {"tensor": t["tensor"], "src": t["src"], "dst": t["dst"], "bytes": t["bytes"],
                                    "index": k}})
    serial = serial_prediction(g, hw)
    details: dict[str, Any] = {
        "hardware": hw.name, "prediction": "serial", "n_devices": len(run.device_map), "shards": len(run.shards),
        "transfers": len(run.transfers), "repeats": run.repeats, "statistic": statistic,
        "transfer_bytes": tp.transfer_bytes,
        "serial_with_transfers": serial + float(low.elapsed[nc:].sum()),
        "measured_shards_sum": float(sum(pick(s["samples"]) for s in run.shards)),
        "measured_transfers_sum": float(sum(pick(t["samples"]) for t in run.transfers)),
        "wall_median_seconds": run.plan_seconds, "gap_seconds": run.gap_seconds,
        "gpus": sorted({v for v in run.device_map.values() if v is not None})}
    try:
        from costmodel.evaluate import evaluate

        details["model_makespan"] = float(evaluate(g, hwp).makespan)
    except Exception as e:  # noqa: BLE001  (the breakdown is a courtesy; the records stand without it)
        details["model_makespan_error"] = f"{type(e).__name__}: {e}"
    measured = details["measured_shards_sum"] + details["measured_transfers_sum"] + max(run.gap_seconds or 0.0, 0.0)
    records.append({**base, "kind": "plan", "device_name": plan_device, "measured_seconds": measured,
                    "predicted_seconds": serial, "verified": bool(worst <= tol), "max_rel_error": float(worst),
                    "details": details})
    return records


def store_measurements(archive: Any, records: Iterable[Mapping[str, Any]]) -> int:
    """Write records to an open ``storage.Archive`` or an archive URL/path; returns how many."""
    from storage import Archive

    if isinstance(archive, Archive):
        return archive.add_measurements(records)
    with Archive.open(archive) as a:
        return a.add_measurements(records)


def plan_predictions(g: Any, hw: Any) -> tuple[float, float]:
    """``(serial, serial with the modelled transfers)`` of plan ``g`` on ``hw``: the figures
    ``measure_plan`` stores as the plan's ``predicted_seconds`` and ``details["serial_with_transfers"]``,
    for predicting already measured plans on another (e.g. calibrated) hardware."""
    from costmodel.evaluate import serial_prediction
    from costmodel.hardware_io import load_hardware
    from costmodel.lowering import Lowerer

    hw = load_hardware(hw)
    low = Lowerer(_plan_hardware(g, hw)).lower(g)
    serial = float(serial_prediction(g, hw))
    return serial, serial + float(low.elapsed[int(low.op_offsets[-1]):].sum())


def merge_rounds(rounds: list[list[dict[str, Any]]], statistic: str = "median") -> list[dict[str, Any]]:
    """One plan's records from several ``measure_plan`` calls (its rounds, oldest first) as one
    measurement, in the first round's order and form: each shard's and transfer's
    ``measured_seconds`` is ``statistic`` over the rounds' figures (with ``min``, the minimum over
    every timed run of every round; with ``median``, the median of the rounds' medians); the plan's
    measured time is again their sum plus the median of the rounds' gaps between them; it is
    ``verified`` only if every round verified (``max_rel_error``: the worst). ``details["rounds"]``
    says how many rounds were merged. Raises ValueError for rounds of different plans or shapes."""
    from executor.measure import STATISTICS

    if not rounds:
        raise ValueError("merge_rounds: no rounds")
    pick = STATISTICS[statistic]

    def key(r: dict[str, Any]) -> tuple:
        if r["kind"] == "transfer":
            return ("transfer", r["details"]["index"])
        return (r["kind"], r.get("op"), r.get("shard"))

    digests = {r["plan_digest"] for rs in rounds for r in rs}
    keys = [[key(r) for r in rs] for rs in rounds]
    if len(digests) != 1 or any(k != keys[0] for k in keys[1:]):
        raise ValueError(f"merge_rounds: the rounds are not measurements of one plan (digests {sorted(digests)})")
    out = [{**r, "details": dict(r["details"])} for r in rounds[0]]
    for i, r in enumerate(out):
        if r["kind"] != "plan":
            r["measured_seconds"] = float(pick([rs[i]["measured_seconds"] for rs in rounds]))
    plans = [next(r for r in rs if r["kind"] == "plan") for rs in rounds]
    plan = next(r for r in out if r["kind"] == "plan")
    d = plan["details"]
    d["measured_shards_sum"] = float(sum(r["measured_seconds"] for r in out if r["kind"] == "shard"))
    d["measured_transfers_sum"] = float(sum(r["measured_seconds"] for r in out if r["kind"] == "transfer"))
    gaps = [p["details"].get("gap_seconds") for p in plans]
    gaps = [x for x in gaps if x is not None]
    d["gap_seconds"] = float(np.median(gaps)) if gaps else None
    walls = [p["details"].get("wall_median_seconds") for p in plans]
    walls = [x for x in walls if x is not None]
    d["wall_median_seconds"] = float(np.median(walls)) if walls else None
    d["rounds"] = len(rounds)
    d["statistic"] = statistic
    plan["measured_seconds"] = (d["measured_shards_sum"] + d["measured_transfers_sum"]
                                + max(d["gap_seconds"] or 0.0, 0.0))
    plan["verified"] = all(bool(p["verified"]) for p in plans)
    plan["max_rel_error"] = float(max(p["max_rel_error"] for p in plans))
    return out
