"""The one-process search: improves on the program, keeps replayable lineages, and a plan found
on a proxy with fewer identical layers replays on the deeper model and verifies equal there."""

from __future__ import annotations

from costmodel.evaluate import Evaluator
from costmodel.presets import preset
from executor import verify
from ir import workloads
from ir.rewrites import RewriteError
from optimizer.search.baselines import baselines
from optimizer.search.local import local_search, replay, time_to_within


def test_search_improves_and_lineage_replays():
    g = workloads.build("mlp", batch=1024, widths=[2048, 8192, 2048], dtype="bfloat16")
    ev = Evaluator(preset("h100-sxm-8"), curves=None)  # flat roofline: the 2x margin below is not about GEMM curves
    single = ev(g).makespan  # numba compiles on the first evaluation: outside the budget
    run = local_search(g, ev, budget_s=3.0, seed=1, replayable=True)
    assert run.best.feasible and run.best.makespan < 0.5 * single
    assert run.evaluations > 10 and run.trace[-1][1] == run.best.makespan
    assert replay(g, run.best.lineage).digest == run.best.graph.digest
    assert 0 <= time_to_within(run.trace, run.best.makespan) <= run.seconds


def test_proxy_plan_replays_on_the_deeper_model():
    kw = dict(mode="train", batch=4, seq=8, d_model=16, heads=4, vocab=32, d_ff=32)
    proxy, full = workloads.build("gpt", layers=1, **kw), workloads.build("gpt", layers=2, **kw)
    ev = Evaluator(preset("h100-sxm-8"))
    ev(proxy)
    seeds = {k: v for k, v in baselines(proxy, 8).items() if k != "single-device"}
    run = local_search(proxy, ev, budget_s=3.0, seeds=seeds, seed=2, replayable=True)
    replayed = 0
    for p in run.population[:4]:
        try:
            plan = replay(full, p.lineage, lambda name: baselines(full, 8)[name])
        except RewriteError:
            continue  # a move naming a shard index that the deeper model lays out differently
        assert verify(plan, reference=full).ok
        replayed += 1
    assert replayed >= 1


def test_replay_broadcasts_layer_one_moves_to_every_layer():
    from ir import workloads
    from optimizer.search.local import replay

    step = workloads.build("gpt", mode="train", layers=4, d_model=8, heads=2, vocab=10, seq=4, batch=4)
    lin = ("layout{ops=all,mesh=2,use=b,node=8}", "split{op=l1.ff1,dim=o,parts=2}", "split{op=l0.ff2,dim=o,parts=2}")
    plain = replay(step, lin)
    wide = replay(step, lin, broadcast=True)
    assert [len(plain.ops[f"l{k}.ff1"].shards) for k in range(4)] == [2, 4, 2, 2]
    assert [len(wide.ops[f"l{k}.ff1"].shards) for k in range(4)] == [2, 4, 4, 4]  # layer 0 keeps its own
    assert [len(wide.ops[f"l{k}.ff2"].shards) for k in range(4)] == [4, 2, 2, 2]


class _Counting:
    """A stand-in evaluator whose plans get better for the first ``k`` evaluations, then worse:
    the restart rule sees only the sequence of makespans."""

    def __init__(self, k: int) -> None:
        self.hw, self.k, self.calls = preset("h100-sxm-8"), k, 0

    def __call__(self, g):
        from types import SimpleNamespace

        self.calls += 1
        m = 1.0 / self.calls if self.calls <= self.k else 2.0
        return SimpleNamespace(makespan=m, peak_memory=0.0, feasible=True)


def test_a_population_stuck_for_its_patience_restarts_from_the_program():
    g = workloads.build("mlp", batch=64, widths=[32, 64, 32])
    k, patience = 20, 15
    run = local_search(g, _Counting(k), budget_s=1.5, seed=3, patience=patience)
    # the last gain at evaluation k (the program is evaluation 1): stuck for max(15, 2 * (k - 1)) = 38
    assert run.restarts and run.restarts[0] == k + 2 * (k - 1)
    # later starts never improve (every plan is worse now): one restart every `patience` evaluations
    assert all(b - a == patience for a, b in zip(run.restarts, run.restarts[1:]))
    assert run.best.makespan == 1.0 / k and run.population[0] is run.best  # the best of all starts kept
    assert len({p.graph.digest for p in run.population}) == len(run.population) <= 12
    assert local_search(g, _Counting(k), budget_s=0.5, seed=3, patience=None).restarts == []
