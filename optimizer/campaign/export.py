"""``tapestry export``: a campaign's front as files people and tools can use.

``OUT/plans/NN_<digest12>.json`` (+ ``.svg`` through Graphviz, else ``.dot``), ``front.parquet``
(objectives and metadata), ``pareto.png`` (the front with the baselines), and ``summary.md``
comparing the front with the single-device and data-parallel baselines on the same model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.campaign.history import plot_progress, progress_report
from optimizer.campaign.plans import replay_rewrite
from optimizer.campaign.progress import fmt_bytes, fmt_seconds


def _plot(path: Path, objectives: list[str], front: list[dict], base: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_name = "makespan"
    y_name = next((o for o in objectives if o != "makespan"), "peak_memory")
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    fx = [r["objectives"][x_name] for r in front]
    fy = [r["objectives"][y_name] for r in front]
    from optimizer.search.pareto import nondominated_mask

    if fx:
        # The front may be non-dominated only in more than these two objectives: draw the step
        # through the plans that are non-dominated in this plane alone.
        F2 = np.column_stack([fx, fy])
        nd = F2[nondominated_mask(F2)]
        nd = nd[np.argsort(nd[:, 0])]
        ax.step(nd[:, 0], nd[:, 1], where="post", color="#1a73e8", alpha=0.6)
    ax.scatter(fx, fy, color="#1a73e8", label=f"front ({len(fx)} plans)", zorder=3)
    markers = iter(["s", "^", "D", "v"])
    for name, ev in base.items():
        ax.scatter([ev[x_name]], [ev[y_name]], marker=next(markers, "o"), s=60, label=name, zorder=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"{x_name} (s)")
    ax.set_ylabel(y_name + (" (bytes)" if y_name == "peak_memory" else " (J)" if y_name == "energy" else ""))
    ax.set_title("Pareto front")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def export_campaign(name: str, out: str, db: str | None = None) -> dict[str, Any]:
    from costmodel.evaluate import Evaluator
    from costmodel.hardware import Hardware
    from ir.dot import RenderError, render_svg, to_dot
    from ir.rewrites.substitute_attention import substitution_summary
    from ir.serialize import loads
    from optimizer.search.baselines import baselines
    from optimizer.campaign.lifecycle import resolve_url
    from optimizer.realrun.sampling import rank_correlation
    from storage import Archive

    url = resolve_url("tapestry.db", db)
    outdir = Path(out)
    with Archive.open(url, readonly=True) as archive:
        row = archive.get_campaign(name)
        objectives = row["objectives"]
        front = sorted(archive.current_front(name), key=lambda r: r["objectives"]["makespan"])
        graphs = {r["digest"]: archive.get_graph_json(name, r["digest"], replay=replay_rewrite) for r in front}
        measurements = archive.measurements(name)
        progress = progress_report(row, archive.storage_stats(name))
        (outdir / "plans").mkdir(parents=True, exist_ok=True)
        archive.export_front_parquet(name, outdir / "front.parquet")
    have_dot = shutil.which("dot") is not None
    substituted: list[dict[str, int]] = []
    for i, r in enumerate(front):
        stem = outdir / "plans" / f"{i:02d}_{r['digest'][:12]}"
        stem.with_suffix(".json").write_text(graphs[r["digest"]])
        g = loads(graphs[r["digest"]], f"plan {r['digest'][:12]}")
        substituted.append(substitution_summary(g))
        dot = to_dot(g)
        try:
            if not have_dot:
                raise RenderError("no dot")
            stem.with_suffix(".svg").write_text(render_svg(dot))
        except RenderError:
            stem.with_suffix(".dot").write_text(dot)
    hw = Hardware.from_dict(row["config"]["hardware"])
    ev = Evaluator(hw)
    program = loads(graphs[front[0]["digest"]]) if front else None
    base_evals: dict[str, dict] = {}
    if program is not None:
        for bname, bg in baselines(program, hw.n_devices).items():
            e = ev(bg)
            base_evals[bname] = {**e.objectives(), "gap": e.gap, "feasible": e.feasible}
    _plot(outdir / "pareto.png", objectives, front, base_evals)
    plot_progress(progress, outdir / "progress.png", f"campaign {name}: hypervolume and best makespan over time")
    corr = rank_correlation(measurements)
    (outdir / "summary.md").write_text(_summary(name, row, hw, front, base_evals, corr) + _substitutions(substituted))
    return {"out": str(outdir), "plans": len(front), "have_svg": have_dot}


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


def _summary(name: str, row: dict, hw: Any, front: list[dict], base: dict[str, dict], corr: dict | None) -> str:
    c = row["counters"]
    lines = [f"# Campaign `{name}`", "",
             f"- hardware: `{hw.name}` ({hw.n_devices} devices); objectives: {', '.join(row['objectives'])}",
             f"- status: {row['status']}; evaluations: {c.get('evaluations', 0)}; front plans: {len(front)}", ""]
    single = base.get("single-device")
    head = "| plan | makespan | vs single device | gap to bound | energy | peak memory | devices |"
    lines += ["## Front against baselines", "", head, "|---|---:|---:|---:|---:|---:|---:|"]

    def row_of(label: str, o: dict, gap: float | None) -> str:
        speed = f"{single['makespan'] / o['makespan']:.2f}×" if single else "-"
        g = f"{gap:.2f}×" if gap is not None and np.isfinite(gap) else "-"
        return (f"| {label} | {fmt_seconds(o['makespan'])} | {speed} | {g} | {o['energy']:.3g} J | "
                f"{fmt_bytes(o['peak_memory'])} | {int(o['devices'])} |")

    for bname, o in base.items():
        lines.append(row_of(f"baseline: {bname}", o, o.get("gap")))
    for i, r in enumerate(front):
        lines.append(row_of(f"front {i:02d} `{r['digest'][:12]}`", r["objectives"], r.get("gap")))
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
