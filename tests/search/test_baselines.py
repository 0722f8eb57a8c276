"""Expert baselines: each only where valid, each meaning-preserving (executed), with the layouts
and memory the recipes promise."""

from __future__ import annotations

import pytest

from costmodel.evaluate import Evaluator
from costmodel.presets import preset
from executor import verify
from ir import workloads
from ir.layout_describe import describe_op
from ir.mesh import parse_mesh
from optimizer.search.baselines import baselines, data_parallel_step, megatron, zero3

MLP = workloads.build("mlp", batch=8, widths=[16, 32, 16])
BLOCK = workloads.build("transformer", batch=4, seq=8, d_model=16, heads=4, d_ff=32)
STEP = workloads.build("llama", mode="train", batch=4, seq=8, layers=1, d_model=16, heads=4, vocab=32, d_ff=32)


@pytest.mark.parametrize("g,names", [
    (MLP, {"single-device", "data-parallel-4", "megatron-tp2-dp2", "megatron-4"}),
    (BLOCK, {"single-device", "data-parallel-4", "megatron-tp2-dp2", "dp2-cp2"}),
    (STEP, {"single-device", "data-parallel-4", "zero3-4", "megatron-tp2-dp2", "dp2-cp2"}),
])
def test_baselines_apply_where_valid_and_verify(g, names):
    plans = baselines(g, 4, 2)
    assert set(plans) == names
    for name, p in plans.items():
        assert verify(p, reference=g).ok, name


def test_zero3_shards_the_state_and_plain_dp_homes_it_on_device_0():
    z, d = zero3(STEP, 4, 2), data_parallel_step(STEP, 4, 2)
    for nxt in STEP.carried.values():
        upd = STEP.producers[nxt]
        assert set(d.ops[upd].shards.device.tolist()) == {0}
        if STEP.tensors[nxt].shape[0] >= 4:
            assert len(set(z.ops[upd].shards.device.tolist())) == 4, upd
    ev = Evaluator(preset("h100-sxm-8"))
    ez, ed = ev(z), ev(d)
    # plain DP holds every parameter and optimizer state on device 0; ZeRO-3 splits them
    assert ed.peak_memory_per_device[0] > 1.5 * max(ez.peak_memory_per_device[:4])


def test_plain_dp_reduces_each_gradient_to_device_0_in_bf16_too():
    """A bf16 step's update reads the fp32 copy of the gradient (``W.cast.dx``): the accumulate
    and that cast are on device 0 too (they stayed reduce-scattered over every device, so the
    plan scattered, gathered to device 0, and priced an all-to-all that plain DP does not run)."""
    step = workloads.build("llama", mode="train", batch=4, seq=8, layers=1, d_model=16, heads=4, vocab=32, d_ff=32,
                           dtype="bfloat16")
    d = data_parallel_step(step, 4, 2)
    homed = 0
    for nxt in step.carried.values():
        for _, t in d.ops[step.producers[nxt]].inputs:
            p = d.producers.get(t)
            while p is not None and d.ops[p].kernel == "cast":
                assert set(d.ops[p].shards.device.tolist()) == {0} and len(d.ops[p].shards) == 1, p
                p = d.producers.get(d.ops[p].inputs[0][1])
            if p is not None and d.ops[p].kernel == "accumulate":
                assert set(d.ops[p].shards.device.tolist()) == {0} and len(d.ops[p].shards) == 1, p
                homed += 1
    assert homed >= 9  # every weight's gradient
    assert verify(d, reference=step).ok


def test_megatron_is_tensor_parallel_inside_nodes_and_data_parallel_across():
    p = megatron(BLOCK, 4, 2)
    m = parse_mesh("2x2", 2)
    assert describe_op(p, "q_proj", m).startswith("b/2 over n0 · h/2 over g0")
    assert describe_op(p, "ff1", m).startswith("n0/2 over n0 · o/2 over g0")
    single = megatron(BLOCK, 2, 8)  # one node: tensor parallel only
    assert describe_op(single, "q_proj", parse_mesh("2")).startswith("h/2 over g0")


def test_layered_training_steps_get_recomputing_experts():
    from ir import workloads
    from ir.rewrites.recompute import recomputed

    step = workloads.build("llama", layers=3, d_model=32, heads=4, kv_heads=2, d_ff=64, vocab=64, seq=8, batch=8,
                           mode="train", dtype="bfloat16")
    plans = baselines(step, 8)
    ev = Evaluator(preset("h100-sxm-8"))
    for name in ("zero3-8", "megatron-3d"):
        r = plans[f"{name}-recompute"]
        again = recomputed(r)
        assert {n[:3] for n in again if not n.endswith(".cast")} == {"l0.", "l1.", "l2."}  # every layer's forward
        assert {n.split("_")[0] for n in again if n.endswith(".cast")} == {"l0", "l1", "l2"}  # weights gathered again
        assert verify(r, reference=step).ok
    # only each layer's input stays alive across the turn: less memory, more time
    z, zr = ev(plans["zero3-8"]), ev(plans["zero3-8-recompute"])
    assert zr.peak_memory < z.peak_memory and zr.makespan > z.makespan
    assert "zero3-4-recompute" not in baselines(STEP, 4, 2)  # no layers: no such expert


@pytest.mark.parametrize("n,stages", [(24, 3), (40, 5)])
def test_megatron_3d_stages_are_whole_nodes(n, stages):
    """Three (five) nodes of 8: the default two stages were 12 (20) devices each, laid out on an
    8-device TP mesh (16 of them): 8 (16) GPUs of the fleet idle, and the second stage's TP groups
    (devices 12-19; 20-27, 28-35) straddled two nodes, tensor parallelism over InfiniBand. A stage
    is now a whole number of nodes (one stage a node here), every device in use."""
    from ir import workloads
    from ir.rewrites.pipeline import op_layers
    from optimizer.search.baselines import megatron_3d

    step = workloads.build("gpt", mode="train", layers=stages, d_model=16, heads=2, vocab=10, seq=4, batch=8)
    p = megatron_3d(step, n)
    lay, _ = op_layers(p)
    used, by_layer = set(), {}
    for name, o in p.ops.items():
        d = set(o.shards.device.tolist())
        used |= d
        by_layer.setdefault(lay[name], set()).update(d)
    assert used == set(range(n))
    for k in range(stages):  # each layer's ops (a stage) on whole nodes
        nodes = {d // 8 for d in by_layer[k]}
        assert by_layer[k] == {d for q in nodes for d in range(8 * q, 8 * q + 8)}, k
    for name, o in p.ops.items():  # tensor parallelism inside a node: an op's shards of one batch range
        if name.startswith("l0.") and o.kernel == "linear":
            assert {d // 8 for d in o.shards.device.tolist()} == {0}, name
    if n == 24:
        assert verify(p, reference=step).ok


def test_a_campaigns_baselines_follow_its_fleets_nodes():
    """A fleet of 4 nodes of 4 GPUs: the campaign's seeded baselines took nodes of 8 (the default
    where 16 divides), so its Megatron yardstick was TP 8 over two nodes (``megatron-tp8-dp2``,
    tensor parallelism over InfiniBand). They follow the fleet's ``devices_per_node``."""
    import dataclasses

    from costmodel.presets import PRESETS
    from optimizer.campaign.config import parse_config
    from optimizer.campaign.lifecycle import initial_records

    hw = dataclasses.replace(PRESETS["h100-sxm-64"], name="h100-4x4", n_nodes=4, devices_per_node=4)
    cfg = parse_config({"name": "n4x4", "hardware": "h100-sxm-64",
                        "workload": {"name": "mlp", "params": {"batch": 16, "widths": [16, 32, 16]}}})
    base = workloads.build("mlp", batch=16, widths=[16, 32, 16])
    names = {r["rewrite"] for r in initial_records(cfg, hw, base, None)}
    assert "baseline:megatron-tp4-dp4" in names and "baseline:megatron-tp8-dp2" not in names


def test_an_nvlink_rack_runs_eight_gpu_groups_side_by_side():
    """A GB200 NVL72 rack is one node of 72 (one NVLink domain). Its experts keep tensor, context
    and expert parallelism to groups of 8, as Megatron-LM's recipes do, with the other factor of 9
    data parallel (TP72 would split 8 heads 72 ways); the 3D expert's two stages of 36 take TP 4."""
    from ir.mesh import Mesh
    from optimizer.search.baselines import inner_group

    assert [inner_group(n, p) for n, p in ((64, 8), (4, 8), (6, 6), (72, 72), (144, 72), (36, 36))] == \
        [8, 4, 6, 8, 8, 4]
    step = workloads.build("llama", layers=2, d_model=32, heads=8, d_ff=48, vocab=40, seq=16, batch=18,
                           mode="train", experts=8, top_k=2)
    hw = preset("gb200-nvl72")
    plans = baselines(step, hw.n_devices, hw.devices_per_node)
    assert {"megatron-tp8-dp9", "dp9-cp8", "dp9-ep8", "zero3-72", "megatron-3d"} <= set(plans)
    m = Mesh((9, 8), 72)
    assert describe_op(plans["megatron-tp8-dp9"], "l0.q_proj", m).startswith("b/9 over g0 · k/8 over g1")
    assert describe_op(plans["dp9-ep8"], "l1.ff_gate", m).startswith("e/8 over g1 · b/9 over g0")
    sh = plans["megatron-3d"].ops["l1.q_proj"].shards  # the second stage: devices 36..71, 9 x TP 4
    assert set(sh.device.tolist()) == set(range(36, 72)) and len(sh) == 72  # two microbatches a device
    assert {int(b - a) for a, b in zip(sh.lo[:, 1], sh.hi[:, 1])} == {2}  # 8 heads' k: 4 ways (q_proj's kv dim)
    assert verify(plans["megatron-tp8-dp9"], reference=step).ok
