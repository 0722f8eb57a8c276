"""Where a plan's time goes: per-op bounds, the critical path, the collectives, a Gantt chart.

``explain(evaluator, g)`` evaluates ``g`` (keeping the schedule) and returns plain data:

- ``ops``: per operation, what bounds it: ``compute`` (its shards' FLOP time exceeds their memory
  time), ``memory`` (the reverse), or ``comm`` (the port time of the transfers and collectives
  bringing its inputs exceeds its compute time), with those three times;
- ``critical_path``: from the node that finishes last, back through what held each node up:
  the data predecessor that finished last (a transfer: its data arrived), or the node that held
  its device (compute) or one of its ports (transfers, collectives) last before it started,
  whichever was later;
  merged into runs of one op or one transfer kind: ``{what, kind, start, finish}``;
- ``collectives``: every group of transfers timed as one NCCL collective
  (``costmodel.collectives``): tensor, producer, kind, algorithm, ranks, nodes, buffer bytes (an
  all-to-all: the bytes it moves), seconds.

``gantt(evaluation, path)`` draws the simulated schedule per device (compute on one lane,
transfers and collectives on a second), PNG or SVG by the file's suffix (matplotlib).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from costmodel.efficiency import gemm_efficiency, memory_efficiency
from costmodel.evaluate import Evaluation, Evaluator
from costmodel.hardware import class_family
from costmodel.lowering import Lowerer, kernel_class_of
from ir.graph import Graph

__all__ = ["explain", "gantt"]


def _bounds(ev: Evaluation, g: Graph, lowerer: Lowerer) -> list[dict[str, Any]]:
    """Per op: its shards' FLOP time and memory time as the lowering prices them (the efficiency
    curves by shard size where the hardware has them, else its constant factors), and which bounds it."""
    low = ev.lowered
    b = ev.breakdown()
    c = lowerer.curves
    out = []
    for i, o in enumerate(b.ops):
        a, z = int(low.op_offsets[i]), int(low.op_offsets[i + 1])
        op = g.ops[o["op"]]
        kclass = kernel_class_of(op)
        f_den, b_den, _launch = lowerer._denominators(g.tensors[op.output].dtype, kclass)
        flops, nbytes = low.flops[a:z], low.nbytes[a:z]
        f_eff = b_eff = np.ones(z - a)
        if c is not None:
            fpp = float(g.signature(op).flops_per_point)
            if class_family(kclass) == "matmul" and fpp > 0:
                f_eff = gemm_efficiency(flops / fpp, max(fpp / 2.0, 1.0), c)
            b_eff = np.where(nbytes > 0, memory_efficiency(np.maximum(nbytes, 1.0), c), 1.0)
        t_f = float((flops / (f_den * f_eff)).sum())
        t_b = float((nbytes / (b_den * b_eff)).sum())
        bound = "comm" if o["in_s"] > o["compute_s"] else ("compute" if t_f >= t_b else "memory")
        out.append({"op": o["op"], "bound": bound, "compute_s": o["compute_s"], "flop_s": t_f, "memory_s": t_b,
                    "comm_s": o["in_s"], "shards": o["shards"], "start": o["start"], "finish": o["finish"]})
    return out


def _resource_lanes(low: Any, nc: int) -> list[dict[int, np.ndarray]]:
    """Per device, its compute nodes and its communication nodes (a transfer on its source and
    destination, a collective on each participant), in node order."""
    n = low.kind.shape[0]
    comm: dict[int, list[int]] = {}
    for u in range(nc, n):
        if low.kind[u] == 2 and low.part_ptr is not None:
            devs = low.part_dev[low.part_ptr[u]:low.part_ptr[u + 1]].tolist()
        else:
            devs = [int(low.dev[u]), int(low.dst[u])]
        for d in devs:
            comm.setdefault(d, []).append(u)
    compute: dict[int, list[int]] = {}
    for u, d in enumerate(low.dev[:nc].tolist()):
        compute.setdefault(d, []).append(u)
    return [{d: np.array(v, np.int64) for d, v in lane.items()} for lane in (compute, comm)]


def _critical_path(ev: Evaluation) -> list[dict[str, Any]]:
    low, s = ev.lowered, ev.schedule
    n = low.kind.shape[0]
    if n == 0:
        return []
    src = np.repeat(np.arange(n), np.diff(low.succ_ptr))
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, v in zip(src.tolist(), low.succ_idx.tolist()):
        preds[v].append(u)
    nc = low.n_compute
    op_of = np.repeat(np.arange(len(low.op_names)), np.diff(low.op_offsets))
    compute_lanes, comm_lanes = _resource_lanes(low, nc)
    release = s.finish - low.lat  # a transfer holds its ports until its latency starts
    for lanes in (compute_lanes, comm_lanes):
        for d, nodes in lanes.items():
            lanes[d] = nodes[np.argsort(release[nodes], kind="stable")]

    tol = 1e-9 * s.makespan  # the simulator's sums of durations round: equal times differ in the last bits

    def held_by(u: int) -> list[int]:
        """Per resource ``u`` needs, the node that held it last before ``u`` started (it may have
        released it a little earlier: compute slowed by concurrent communication holds its device
        past its own finish)."""
        if u < nc:
            lanes, devs = compute_lanes, [int(low.dev[u])]
        elif low.kind[u] == 2 and low.part_ptr is not None:
            lanes, devs = comm_lanes, low.part_dev[low.part_ptr[u]:low.part_ptr[u + 1]].tolist()
        else:
            lanes, devs = comm_lanes, [int(low.dev[u]), int(low.dst[u])]
        t, out = s.start[u], []
        for d in devs:
            nodes = lanes.get(d)
            if nodes is None:
                continue
            i = int(np.searchsorted(release[nodes], t + tol, side="right")) - 1
            while i >= 0 and nodes[i] == u:
                i -= 1
            if i >= 0:
                out.append(int(nodes[i]))
        return out

    u = int(np.argmax(s.finish))
    path = []
    seen = set()
    while u not in seen:
        seen.add(u)
        if u < nc:
            what, kind = low.op_names[int(op_of[u])], "compute"
        else:
            what = low.op_names[int(low.transfer_op[u - nc])]
            kind = "collective" if low.kind[u] == 2 else "transfer"
        path.append((what, kind, float(s.start[u]), float(s.finish[u])))
        cands = [(s.finish[p], 1, -p) for p in preds[u]] + [(release[p], 0, -p) for p in held_by(u)]
        cands = [c for c in cands if -c[2] not in seen]
        if not cands:
            break
        u = -max(cands)[2]  # the latest to finish; on a tie the data predecessor
    runs: list[dict[str, Any]] = []
    for what, kind, a, z in reversed(path):
        if runs and runs[-1]["what"] == what and runs[-1]["kind"] == kind:
            runs[-1]["start"] = min(runs[-1]["start"], a)
            runs[-1]["finish"] = max(runs[-1]["finish"], z)
        else:
            runs.append({"what": what, "kind": kind, "start": a, "finish": z})
    return runs


def _collectives(evaluator: Evaluator) -> list[dict[str, Any]]:
    low = evaluator.lowerer
    if not low._states:
        return []
    st = low._states[-1]  # the plan just lowered
    out = []
    for gi, piece in enumerate(st.group_pieces):
        if piece.collective is None:
            continue
        prod, tensor, _readers = st.struct.groups[gi]
        seen: dict = {}  # one row per distinct collective of the group (each replica runs its own)
        for c in piece.collective:
            row = seen.get(c)
            if row is None:
                row = seen[c] = {"tensor": tensor, "producer": st.struct.order[prod], "kind": c.kind,
                                 "algorithm": c.algorithm, "ranks": c.ranks, "nodes": c.nodes, "bytes": c.nbytes,
                                 "seconds": c.seconds, "count": 0}
                out.append(row)
            row["count"] += 1
    return out


def explain(evaluator: Evaluator, g: Graph) -> dict[str, Any]:
    """Evaluate ``g`` and explain where its time goes (see the module docstring)."""
    ev = evaluator(g, keep=True)
    ops = _bounds(ev, g, evaluator.lowerer)
    counts = {k: sum(1 for o in ops if o["bound"] == k) for k in ("compute", "memory", "comm")}
    return {"makespan": ev.makespan, "bounds": counts, "ops": ops, "critical_path": _critical_path(ev),
            "collectives": _collectives(evaluator), "evaluation": ev}


def gantt(ev: Evaluation, path: str | Path, title: str = "") -> Path:
    """Draw ``ev``'s schedule (evaluated with ``keep=True``) per device to ``path`` (.png/.svg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    low, s = ev.lowered, ev.schedule
    nc = low.n_compute
    used = np.flatnonzero(s.used)
    row = {int(d): i for i, d in enumerate(used)}
    op_of = np.repeat(np.arange(len(low.op_names)), np.diff(low.op_offsets))
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * len(used)))
    scale = 1e3  # ms
    for u in range(nc):
        d = int(low.dev[u])
        # as simulated: a shard slowed by concurrent communication runs longer than its ``dur``
        ax.broken_barh([(s.start[u] * scale, max((s.finish[u] - s.start[u]) * scale, 1e-9))], (row[d] - 0.4, 0.5),
                       facecolors=cmap(int(op_of[u]) % 20), linewidth=0)
    for u in range(nc, low.kind.shape[0]):
        if low.kind[u] == 2:
            devs = low.part_dev[low.part_ptr[u]:low.part_ptr[u + 1]]
            color = "black"
        else:
            devs = [low.dst[u]]
            color = "grey"
        for d in devs:
            if int(d) in row:
                ax.broken_barh([(s.start[u] * scale, max(low.dur[u] * scale, 1e-9))], (row[int(d)] + 0.12, 0.25),
                               facecolors=color, linewidth=0)
    ax.set_yticks(range(len(used)))
    ax.set_yticklabels([f"dev {d}" for d in used])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms): compute coloured by op; grey = transfers in, black = collectives")
    ax.set_title(title or f"simulated schedule, makespan {ev.makespan * 1e3:.3g} ms")
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, format=p.suffix.lstrip(".") or "png")
    plt.close(fig)
    return p
