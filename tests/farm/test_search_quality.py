"""Search quality: from the single-device program alone (no baselines seeded), a campaign finds a
plan at least as fast (within 5%) as the better of Megatron tensor parallelism and data
parallelism, at a small and a large token count, and a plan using no more peak memory than
Megatron's — all under the same cost model.

Budget: 7,000 evaluations per token count (about 15 s with two local workers).
"""

from __future__ import annotations

import pytest

from costmodel import Evaluator
from ir import workloads
from optimizer.campaign.config import parse_config
from optimizer.campaign.lifecycle import run_campaign
from optimizer.search.baselines import data_parallel, megatron_mlp
from storage import Archive

HIDDEN = 1024


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [16, 8192])
def test_search_matches_hand_built_plans(tmp_path, tokens):
    db = str(tmp_path / "q.db")
    name = f"quality{tokens}"
    cfg = parse_config({
        "name": name, "hardware": "h100-sxm-8",
        "workload": {"name": "mlp", "params": {"batch": tokens, "widths": [HIDDEN, 4 * HIDDEN, HIDDEN]}},
        "objectives": ["makespan", "peak_memory"],
        "search": {"seed_baselines": False, "steps_per_task": 150, "seed": 1},
        "budget": {"evaluations": 7000}, "cluster": {"workers": 2}, "storage": {"url": db}})
    run_campaign(cfg, quiet=True)
    with Archive.open(db, readonly=True) as a:
        front = a.current_front(name)
        assert all(r["rewrite"] != "baseline:megatron-8" for r in front)
    ev = Evaluator("h100-sxm-8")
    g = workloads.build("mlp", batch=tokens, widths=[HIDDEN, 4 * HIDDEN, HIDDEN])
    megatron, dp = ev(megatron_mlp(g, 8)), ev(data_parallel(g, 8))
    best = min(r["objectives"]["makespan"] for r in front)
    assert best <= 1.05 * min(megatron.makespan, dp.makespan)
    assert min(r["objectives"]["peak_memory"] for r in front) <= megatron.peak_memory
