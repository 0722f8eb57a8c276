"""What ``tapestry status`` and ``summary.md`` say about the model's fidelity and the best plans' MFU.

- :func:`calibration_report`: the campaign's latest refit of its sampling hardware
  (``optimizer.realrun.online``, stored by the sampler in the archive's ``calibrations``): per
  sampled plan the measured time, the prediction of the uncalibrated and of the calibrated
  hardware, and the rank correlation and mean |log(predicted / measured)| before and after.
- :func:`best_mfu`: MFU of the fastest front plans on the campaign's hardware (model FLOPs
  utilisation, ``costmodel.evaluate``: ``program_facts(unshard(plan), hw).ideal_seconds /
  (makespan · devices used)``), re-evaluated from the stored plans.
- :func:`meaning`: one sentence saying what the rank correlation means for this campaign.
- :func:`kept_sentence`: one sentence naming the terms the refit left at the preset's values
  because the samples cannot identify them.
"""

from __future__ import annotations

from typing import Any

from optimizer.campaign.progress import fmt_seconds

__all__ = ["best_mfu", "calibration_report", "kept_sentence", "markdown", "meaning", "status_lines"]


def calibration_report(archive: Any, name: str) -> dict[str, Any] | None:
    """``{"sampling": latest sampling calibration report + plans/created_at/hardware name, "target":
    latest target calibration report or None, "refits": how many}``, or None without one."""
    try:
        cals = archive.calibrations(name)
    except AttributeError:  # pragma: no cover - an archive object without calibrations
        return None
    sampling = [c for c in cals if c["role"] == "sampling"]
    if not sampling:
        return None
    last = sampling[-1]
    target = [c for c in cals if c["role"] == "target"]
    return {"sampling": {**last["report"], "plans": last["plans"], "created_at": str(last["created_at"])[:19],
                         "hardware_name": last["hardware"].get("name")},
            "target": target[-1]["report"] if target else None, "refits": len(sampling)}


def best_mfu(archive: Any, name: str, hw: Any, front: list[dict], k: int = 3) -> list[dict[str, Any]]:
    """MFU of the ``k`` fastest front plans on ``hw`` (plans that cannot be read or evaluated are
    left out)."""
    from costmodel.evaluate import Evaluator
    from ir.serialize import loads
    from optimizer.campaign.plans import replay_rewrite

    ev = Evaluator(hw)
    out = []
    for r in sorted(front, key=lambda r: r["objectives"]["makespan"])[:k]:
        try:
            g = loads(archive.get_graph_json(name, r["digest"], replay=replay_rewrite), f"plan {r['digest'][:12]}")
            e = ev(g)
        except Exception:  # noqa: BLE001  (a courtesy figure; status stands without it)
            continue
        out.append({"digest": r["digest"], "makespan": float(e.makespan), "mfu": float(e.mfu),
                    "model_flops": float(e.model_flops), "devices": int(e.devices)})
    return out


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def meaning(rep: dict[str, Any], campaign_hw: str) -> str:
    """One sentence: what the rank correlation after the refit says, and about which hardware."""
    s = rep["sampling"]
    rho = s["after"]["spearman"]
    hw = s.get("sampling_hardware") or s.get("hardware_name") or "the sampling hardware"
    if rho is None:
        how = "there are too few sampled plans to rank yet"
    elif rho >= 0.9:
        how = "the calibrated model orders the sampled plans almost exactly as their real runs do"
    elif rho >= 0.6:
        how = "the calibrated model mostly orders the sampled plans as their real runs do, swapping some neighbours"
    elif rho >= 0.3:
        how = "the calibrated model only roughly follows the real order of the sampled plans"
    else:
        how = "the calibrated model does not rank these sampled plans (their real times may differ by less than the noise)"
    where = ("" if hw == campaign_hw else
             f"; these are predictions for `{hw}` (where the samples ran, each plan's shards one after another), "
             f"not for the campaign's `{campaign_hw}`")
    return (f"Spearman ρ = {_fmt(rho)} (1: same order as the measurements, 0: unrelated): {how}{where}.")


def kept_sentence(factors: dict[str, dict[str, Any]], hw: str) -> str:
    """One sentence: which fitted classes' terms the refit kept at ``hw``'s values, and why; ""
    when it changed every term (or fitted nothing)."""
    why = {"compute": "compute efficiency", "memory": "memory efficiency", "launch": "launch overhead"}
    kept = []
    for k, v in factors.items():
        if not v.get("fitted"):
            continue
        terms = [why[t] for t in ("compute", "memory", "launch") if not v.get(f"{t}_identified", True)]
        if terms:
            kept.append(f"{k}'s {' and '.join(terms)}")
    if not kept:
        return ""
    return (f"The refit changed only what these samples can tell apart: it kept {'; '.join(kept)} at `{hw}`'s "
            f"values (a term that never binds, one whose fit is within two standard errors of that value, or a fixed "
            f"cost per shard where the class's shards are too alike in size, under 4x apart, to separate it from a "
            f"rate).")


def status_lines(rep: dict[str, Any] | None, mfu: list[dict[str, Any]], campaign_hw: str) -> list[str]:
    """Plain lines for ``tapestry status``."""
    lines = []
    if mfu:
        lines.append("best plans' MFU (model FLOPs / (makespan × peak of the devices used)): "
                     + ", ".join(f"{m['digest'][:12]} {100 * m['mfu']:.1f}% ({fmt_seconds(m['makespan'])}, "
                                 f"{m['devices']} dev)" for m in mfu))
    if rep:
        s = rep["sampling"]
        b, a, h = s["before"], s["after"], s.get("held_out")
        lines.append(f"calibration ({rep['refits']} refit(s) of `{s.get('sampling_hardware')}` on {s['plans']} sampled "
                     f"plans): Spearman {_fmt(b['spearman'])} -> {_fmt(a['spearman'])}, mean |log(pred/measured)| "
                     f"{_fmt(b['mean_abs_log'])} -> {_fmt(a['mean_abs_log'])}"
                     + (f"; held out (new plans, previous refit): Spearman {_fmt(h['spearman'])}, "
                        f"mean |log| {_fmt(h['mean_abs_log'])} on {h['n']}" if h else ""))
        for p in s.get("points", [])[-8:]:
            lines.append(f"  {p['digest'][:12]}: measured {fmt_seconds(p['measured'])}, predicted "
                         f"{fmt_seconds(p['before'])}, calibrated {fmt_seconds(p['after'])}")
        lines.append(meaning(rep, campaign_hw))
        t = rep.get("target")
        if t and t.get("front"):
            lines.append("front re-scored on the calibrated campaign hardware: "
                         + ", ".join(f"{f['digest'][:12]} {fmt_seconds(f['makespan'])} -> "
                                     f"{fmt_seconds(f['calibrated_makespan'])}" for f in t["front"][:6]))
    return lines


def markdown(rep: dict[str, Any] | None, mfu: list[dict[str, Any]], campaign_hw: str) -> list[str]:
    """``summary.md`` sections: MFU of the best plans, calibrated predictions next to measurements."""
    lines: list[str] = []
    if mfu:
        lines += ["", "## MFU of the best plans", "",
                  "Model FLOPs utilisation on the campaign's hardware: the program's FLOPs at peak, over "
                  "(makespan × devices used).", "",
                  "| plan | makespan | devices | model FLOPs | MFU |", "|---|---:|---:|---:|---:|"]
        lines += [f"| `{m['digest'][:12]}` | {fmt_seconds(m['makespan'])} | {m['devices']} | {m['model_flops']:.3g} | "
                  f"{100 * m['mfu']:.1f}% |" for m in mfu]
    if rep:
        s = rep["sampling"]
        b, a, h = s["before"], s["after"], s.get("held_out")
        hw = s.get("sampling_hardware")
        lines += ["", "## Calibrated predictions vs measurements", "",
                  f"The campaign refit `{hw}` ({rep['refits']} time(s), last on {s['plans']} sampled plans, "
                  f"{s['shards']} shard timings) from its own sampled executions.", "",
                  meaning(rep, campaign_hw), "",
                  "| | Spearman ρ | mean \\|log(pred/measured)\\| |", "|---|---:|---:|",
                  f"| `{hw}` as given | {_fmt(b['spearman'])} | {_fmt(b['mean_abs_log'])} |",
                  f"| after the refit (in sample) | {_fmt(a['spearman'])} | {_fmt(a['mean_abs_log'])} |"]
        if h:
            lines.append(f"| new plans on the previous refit (held out, {h['n']}) | {_fmt(h['spearman'])} | "
                         f"{_fmt(h['mean_abs_log'])} |")
        lines += ["", f"| sampled plan | measured | predicted (`{hw}`) | calibrated prediction | calibrated / measured |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| `{p['digest'][:12]}` | {fmt_seconds(p['measured'])} | {fmt_seconds(p['before'])} | "
                  f"{fmt_seconds(p['after'])} | {p['after'] / p['measured']:.2f} |" for p in s.get("points", [])]
        fac = s.get("factors", {})
        if fac:
            lines += ["", "Refit factors per kernel class (compute and memory efficiency of the datasheet peaks, "
                          "launch overhead; \"kept\": the samples cannot identify that term, the preset's value stays): "
                      + "; ".join(f"{k} {v['compute']:.3g}{'' if v['compute_identified'] else ' (kept)'} / "
                                  f"{v['memory']:.3g}{'' if v['memory_identified'] else ' (kept)'} / "
                                  f"{fmt_seconds(v['launch']) if v['launch'] >= 1e-9 else '0 s'}"
                                  f"{'' if v.get('launch_identified', True) else ' (kept)'}" for k, v in fac.items() if v.get("fitted"))
                      + (f"; plus {fmt_seconds(s['dispatch'])} per shard that the executor spends between shards "
                         f"(measured by the executor where plans record it, else fitted on the plan times; added to every launch overhead)" if s.get("dispatch") else "")
                      + "."]
            kept = kept_sentence(fac, hw)
            if kept:
                lines += ["", kept]
        t = rep.get("target")
        if t and t.get("front"):
            lines += ["", "The samples ran on the campaign's device kind, so the refit factors re-score the front:", "",
                      "| plan | makespan (stored) | makespan (calibrated) | MFU (calibrated) |", "|---|---:|---:|---:|"]
            lines += [f"| `{f['digest'][:12]}` | {fmt_seconds(f['makespan'])} | {fmt_seconds(f['calibrated_makespan'])} | "
                      f"{100 * f['calibrated_mfu']:.1f}% |" for f in t["front"]]
    return lines
