"""``tapestry export``: a campaign's front as files people and tools can use.

``OUT/plans/NN_<digest12>.json`` (+ ``.svg`` through Graphviz, else ``.dot``; each plan file
names and embeds the campaign's program, so ``tapestry verify`` checks it against the program),
``front.parquet`` (objectives and metadata), ``pareto.png`` (every pair of objectives, front and
baselines, in readable units), and ``summary.md`` comparing the front with the single-device and
data-parallel baselines on the same model and saying what each front plan does in words.
Exporting again into the same folder replaces the plans of the previous export.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.campaign.history import plot_progress, progress_report
from optimizer.campaign.plans import replay_rewrite
from optimizer.campaign.progress import fmt_bytes, fmt_seconds


#: plan files an export writes (``NN_<digest12>.json|svg|dot``, and with ``--program`` the generated
#: ``.py`` and ``.placements.json`` after it): a new export removes the old ones
_PLAN_FILE = re.compile(r"^\d{2,}_[0-9a-f]{12}\.(json|svg|dot|py|placements\.json)$")

_UNITS = {"makespan": [(1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")],
          "energy": [(1.0, "J"), (1e-3, "mJ"), (1e-6, "µJ")],
          "peak_memory": [(1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")],
          "devices": [(1.0, "devices")]}


def _unit(name: str, values: list[float]) -> tuple[float, str]:
    """(scale, unit) so that the smallest value reads as a number >= 1 (2×10⁻⁵ s → 20 µs)."""
    steps = _UNITS.get(name, [(1.0, "")])
    low = min((v for v in values if v > 0), default=1.0)
    for scale, unit in steps:
        if low >= scale:
            return scale, unit
    return steps[-1]


def _plot(path: Path, objectives: list[str], front: list[dict], base: dict[str, dict], campaign: str = "") -> None:
    """Every pair of objectives in its own panel (a front in three objectives has points that look
    dominated in any one plane: the step line marks the plans non-dominated in that plane)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from optimizer.search.pareto import nondominated_mask

    names = list(objectives) if len(objectives) > 1 else list(objectives) + ["devices"]
    pairs = list(itertools.combinations(names, 2))
    cols = min(3, len(pairs))
    rows = -(-len(pairs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), dpi=110, squeeze=False)
    markers = ["s", "^", "D", "v", "P", "X"]
    for k, (x_name, y_name) in enumerate(pairs):
        ax = axes[k // cols][k % cols]
        xs = [r["objectives"][x_name] for r in front] + [ev[x_name] for ev in base.values()]
        ys = [r["objectives"][y_name] for r in front] + [ev[y_name] for ev in base.values()]
        (sx, ux), (sy, uy) = _unit(x_name, xs or [1.0]), _unit(y_name, ys or [1.0])
        fx = np.array([r["objectives"][x_name] for r in front], dtype=float) / sx
        fy = np.array([r["objectives"][y_name] for r in front], dtype=float) / sy
        if len(fx):
            F2 = np.column_stack([fx, fy])
            nd = F2[nondominated_mask(F2)]
            nd = nd[np.argsort(nd[:, 0])]
            ax.step(nd[:, 0], nd[:, 1], where="post", color="#1a73e8", alpha=0.6)
        ax.scatter(fx, fy, color="#1a73e8", label=f"front ({len(fx)} plans)", zorder=3)
        for (bname, ev), m in zip(base.items(), itertools.cycle(markers)):
            ax.scatter([ev[x_name] / sx], [ev[y_name] / sy], marker=m, s=60, label=bname, zorder=4)
        for axis, set_scale, name, vals in ((ax.xaxis, ax.set_xscale, x_name, xs), (ax.yaxis, ax.set_yscale, y_name, ys)):
            if name != "devices" and any(v > 0 for v in vals):  # an empty front (a campaign stopped at once): linear
                set_scale("log")
                # plain numbers (20, 30, 40 µs), not 2×10¹; minor ticks labelled where they fit
                axis.set_major_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False))
                axis.set_minor_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False,
                                                                         minor_thresholds=(2, 0.5)))
        ax.set_xlabel(f"{x_name} ({ux})")
        ax.set_ylabel(f"{y_name} ({uy})")
        ax.grid(True, which="both", alpha=0.3)
        if k == 0:
            ax.legend(fontsize=7)
    for k in range(len(pairs), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(f"campaign {campaign}: Pareto front of {len(front)} plans over {', '.join(objectives)}"
                 if campaign else "Pareto front")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plan_in_words(g: Any) -> str:
    """What a plan does, in the words practitioners use: ``data parallel 8 + fused fc1·act1``,
    ``fc1 split o×4, fc2 reduction split 4 (tensor parallel) on 4 devices``, ``single device``."""
    notes: list[str] = []
    splits: dict[str, list[str]] = {}
    batch_only: set[int] = set()
    other = False
    for name in g.topo_order:
        o = g.ops[name]
        if o.kernel == "fused":
            notes.append("fused " + "·".join(str(s.get("op", "?")) for s in o.params.get("stages", [])))
        if o.params.get("split"):
            notes.append(f"{name} reduction split {o.params['split'].get('parts', '?')}")
        sh = o.shards
        if len(sh) <= 1:
            continue
        dims = g.signature(o).dims
        factors = [(dims[d], len(np.unique(sh.lo[:, d]))) for d in range(sh.ndim)]
        factors = [(d, f) for d, f in factors if f > 1]
        splits[name] = [f"{d}×{f}" for d, f in factors]
        if len(factors) == 1 and factors[0][0] == dims[0] and not o.params.get("split"):
            batch_only.add(factors[0][1])
        else:
            other = True
    devices = len(set(g.devices))
    if not splits:
        layout = "single device" if devices <= 1 else f"whole ops on {devices} devices"
    elif not other and len(batch_only) == 1 and len(splits) == sum(1 for o in g.ops.values() if len(o.shards) > 1):
        layout = f"data parallel {batch_only.pop()}"
    else:
        shown = [f"{n} split {' '.join(s)}" for n, s in list(splits.items())[:4]]
        more = len(splits) - len(shown)
        layout = ", ".join(shown) + (f" and {more} more split ops" if more > 0 else "")
    text = " + ".join([layout] + notes[:4] + ([f"{len(notes) - 4} more"] if len(notes) > 4 else []))
    return f"{text} on {devices} device{'s' if devices != 1 else ''}" if splits or devices > 1 else text


MAX_DRAWN_OPS = 1500  # larger plans are exported as .dot text, not drawn


def export_campaign(name: str, out: str, db: str | None = None) -> dict[str, Any]:
    from costmodel.evaluate import Evaluator
    from costmodel.repetition import layers_mode
    from costmodel.hardware import Hardware
    from ir.dot import RenderError, render_svg, to_dot
    from ir.rewrites.substitute_attention import substitution_summary
    from ir.serialize import dumps, loads
    from optimizer.campaign.lifecycle import effective_status, existing_archive
    from optimizer.realrun.sampling import rank_correlation
    from optimizer.search.baselines import baselines
    from storage import Archive

    url = existing_archive(db)
    outdir = Path(out)
    with Archive.open(url, readonly=True) as archive:
        row = archive.get_campaign(name)
        objectives = row["objectives"]
        front = sorted(archive.current_front(name), key=lambda r: r["objectives"]["makespan"])
        graphs = {r["digest"]: archive.get_graph_json(name, r["digest"], replay=replay_rewrite) for r in front}
        measurements = archive.measurements(name)
        program = _program(archive, name, row["config"].get("base_digest"))
        progress = progress_report(row, archive.storage_stats(name))
        from optimizer.campaign.fidelity import best_mfu, calibration_report

        fidelity = (calibration_report(archive, name),
                    best_mfu(archive, name, Hardware.from_dict(row["config"]["hardware"]), front)
                    if row["config"].get("hardware") else [])
        (outdir / "plans").mkdir(parents=True, exist_ok=True)
        archive.export_front_parquet(name, outdir / "front.parquet", front)  # the front read above
        if row["status"] == "running":  # a driver killed without a word: interrupted, as status says
            ckpt = archive.latest_checkpoint(name)
            row = {**row, "status": effective_status(row, ckpt["created_at"] if ckpt else None)}
    have_dot = shutil.which("dot") is not None
    substituted: list[dict[str, int]] = []
    words: dict[str, str] = {}
    written: set[str] = set()  # this export's plan files (the others in plans/ are removed at the end)
    for i, r in enumerate(front):
        stem = outdir / "plans" / f"{i:02d}_{r['digest'][:12]}"
        g = loads(graphs[r["digest"]], f"plan {r['digest'][:12]}")
        # the file names (and embeds) the campaign's program, so 'tapestry verify' checks the plan against it
        stem.with_suffix(".json").write_text(dumps(g, program=program, program_digest=row["config"].get(
            "base_digest")) + "\n")
        written.add(stem.name + ".json")
        substituted.append(substitution_summary(g))
        words[r["digest"]] = plan_in_words(g)
        dot = to_dot(g)
        try:
            if not have_dot:
                raise RenderError("no dot")
            if len(g.ops) > MAX_DRAWN_OPS:  # a whole model: dot would take minutes per plan
                raise RenderError("too large to draw")
            stem.with_suffix(".svg").write_text(render_svg(dot))
            written.add(stem.name + ".svg")
        except RenderError:
            stem.with_suffix(".dot").write_text(dot)
            written.add(stem.name + ".dot")
    hw = Hardware.from_dict(row["config"]["hardware"])
    if program is None and front:
        program = loads(graphs[front[0]["digest"]])  # the baselines unshard it first
    setting = (row["config"].get("search") or {}).get("layers", "auto")
    ev = Evaluator(hw, layers=layers_mode(program, setting) if program is not None else "whole")
    base_evals: dict[str, dict] = {}
    if program is not None:
        for bname, bg in baselines(program, hw.n_devices, hw.devices_per_node).items():
            e = ev(bg)
            base_evals[bname] = {**e.objectives(), "gap": e.gap, "feasible": e.feasible}
    _plot(outdir / "pareto.png", objectives, front, base_evals, name)
    plot_progress(progress, outdir / "progress.png", f"campaign {name}: hypervolume and best makespan over time")
    corr = rank_correlation(measurements)
    from optimizer.campaign.fidelity import markdown

    (outdir / "summary.md").write_text(_summary(name, row, hw, front, base_evals, corr, words)
                                       + "\n".join(markdown(fidelity[0], fidelity[1], hw.name) + [""])
                                       + _substitutions(substituted))
    # the plans of an earlier export that this one does not list, last: an export killed midway
    # leaves the earlier summary with its plans, or this one with its plans (and some stale ones)
    for old in (outdir / "plans").iterdir():
        if old.is_file() and _PLAN_FILE.match(old.name) and old.name not in written:
            old.unlink()
    return {"out": str(outdir), "plans": len(front), "have_svg": have_dot}


def _program(archive: Any, name: str, digest: str | None) -> Any:
    """The campaign's program as the archive stores it (its single-device baseline), checked
    against the campaign's program digest; None when it is not there."""
    from ir.serialize import loads
    from storage import StorageError

    if not digest:
        return None
    try:
        g = loads(archive.get_graph_json(name, digest), f"program of campaign {name}")
    except StorageError:
        return None
    return g if g.digest == digest else None


def _substitutions(per_plan: list[dict[str, int]]) -> str:
    """The substitutions the front plans use (fused attention), or nothing when none could apply."""
    fused = [s["attention"] for s in per_plan]
    total = [s["attention"] + s["attention_sites"] for s in per_plan]
    if not any(total):
        return ""
    n = sum(1 for f in fused if f)
    return "\n".join(["", "## Substitutions", "",
                      f"{n} of {len(per_plan)} front plans run fused attention (`fuse_attention`: the scores and "
                      f"probabilities are never materialised); per plan, fused/attention blocks: "
                      + ", ".join(f"{f}/{t}" for f, t in zip(fused, total)) + ".", ""])


def _summary(name: str, row: dict, hw: Any, front: list[dict], base: dict[str, dict], corr: dict | None,
             words: dict[str, str] | None = None) -> str:
    c = row["counters"]
    lines = [f"# Campaign `{name}`", "",
             f"- hardware: `{hw.name}` ({hw.n_devices} devices); objectives: {', '.join(row['objectives'])}",
             f"- status: {row['status']}; evaluations: {c.get('evaluations', 0)}; front plans: {len(front)}", ""]
    single = base.get("single-device")
    head = "| plan | what it does | makespan | vs single device | gap to bound | energy | peak memory | devices |"
    lines += ["## Front against baselines", "", head, "|---|---|---:|---:|---:|---:|---:|---:|"]

    def row_of(label: str, what: str, o: dict, gap: float | None) -> str:
        speed = f"{single['makespan'] / o['makespan']:.2f}×" if single else "-"
        g = f"{gap:.2f}×" if gap is not None and np.isfinite(gap) else "-"
        return (f"| {label} | {what} | {fmt_seconds(o['makespan'])} | {speed} | {g} | {o['energy']:.3g} J | "
                f"{fmt_bytes(o['peak_memory'])} | {int(o['devices'])} |")

    for bname, o in base.items():
        lines.append(row_of(f"baseline: {bname}", "", o, o.get("gap")))
    for i, r in enumerate(front):
        lines.append(row_of(f"front {i:02d} `{r['digest'][:12]}`", (words or {}).get(r["digest"], ""),
                            r["objectives"], r.get("gap")))
    if front and base:
        best = min(r["objectives"]["makespan"] for r in front)
        ref = min(o["makespan"] for o in base.values())
        lines += ["", f"Best front makespan is {ref / best:.2f}× faster than the best baseline "
                      f"({fmt_seconds(best)} vs {fmt_seconds(ref)})."]
    if corr:
        rho = corr.get("spearman")
        lines += ["", "## Model vs real executions", "",
                  f"{corr['n']} sampled plans; Spearman rank correlation of predicted vs measured time: "
                  + (f"{rho:.3f}" if rho is not None else "n/a (fewer than 3 plans)")
                  + f"; verified against the original: {corr.get('verified', 0)}."]
    lines += ["", "Files: `plans/` (JSON and pictures), `front.parquet`, `pareto.png`.", ""]
    return "\n".join(lines)
