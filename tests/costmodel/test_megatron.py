"""Megatron tensor parallelism vs data parallelism for one MLP block on h100-sxm-8.

``mlp(batch=T, widths=[H, 4H, H])`` (float32): ``fc1 = x·W1 + b1``, ``act1 = relu``,
``fc2 = act1·W2 + b2``; hidden sizes H = 4096 and H = 1024.

- TP (Megatron): fc1 and act1 split by output columns over devices 0..7, fc2 split by its
  reduction into 8 blocks (block k on device k, reading act1's columns there: no communication),
  and ``fc2.acc`` split by rows over 0..7 (a reduce-scatter: every device pulls its rows of the 7
  other partials).
- DP: every op split by batch rows over 0..7; every device reads all the weights.

Closed form (roofline per shard + transfer time; P, B, L: float32 peak, HBM bandwidth, launch;
t = T/8 rows per device):

    DP(T) = roof(t·4H·(2H+1), 4(tH + 4H² + 4H + 4tH))         fc1
          + roof(4tH, 4·2·4tH)                                  act1
          + roof(tH·(8H+1), 4(4tH + 4H² + H + tH))              fc2
    TP(T) = roof(T·H/2·(2H+1), 4(TH + H²/2 + H/2 + TH/2))       fc1 (all rows, H/2 columns)
          + roof(TH/2, 4·2·TH/2)                                act1
          + roof(TH(8H+1)/8, 4(TH/2 + H²/2 + H + TH))           fc2 partial (1/8 of the reduction)
          + latency + 7·4tH / NVLink bandwidth                  7 partial blocks in per device
          + roof(7tH, 4·9tH)                                    fc2.acc
    roof(F, bytes) = max(F / P, bytes / B) + L

The 7 partial blocks (4tH bytes each) queue on each device's NVLink ingress port (and 7 leave by
its egress port) for 4tH / bandwidth each; the link latency delays each block's arrival but
holds no port, so the latencies overlap and the last block lands latency + 7·4tH / bandwidth
after the first starts (before links were pipelined in the cost model, it was
7·(latency + 4tH / bandwidth), and tensor parallelism never won at H = 1024).

Few tokens: every op is memory-bound, DP reads 32H² bytes of weights per device against TP's 4H²,
and TP wins when the weight traffic it saves exceeds its reduce-scatter and its extra launch
(fc2.acc): by far at H = 4096 (up to T = 256), by a few percent at H = 1024 (T <= 32). Many
tokens: both are compute-bound with the same FLOPs per device, and TP still pays the
reduce-scatter: DP wins. At T = 8 tensor parallelism first wins at H = 960 (multiples of 64;
H = 2176 before latencies were pipelined).

This file pins the point-to-point model (``Evaluator(HW, collectives=False)``); with the
reduce-scatter run as a NCCL collective (the default), see ``test_collectives.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.presets import PRESETS
from ir import workloads
from ir.rewrites import retile, split_reduction

HW = PRESETS["h100-sxm-8"]
P, B, L = HW.peak_flops("float32"), HW.device.mem_bandwidth, HW.device.launch_overhead
LAT, BW = HW.intra_link.latency, HW.intra_link.bandwidth
DEV = range(8)
# per hidden size: token counts where TP wins, and by how much (tp < margin · dp)
FEW = {4096: ((8, 16, 32, 64), 0.75), 1024: ((8, 16, 32), 0.98)}


def mlp(T, H):
    return workloads.build("mlp", batch=T, widths=[H, 4 * H, H])


def tensor_parallel(T, H):
    g = mlp(T, H)
    g = retile(g, "fc1", [1, 8], DEV)
    g = retile(g, "act1", [1, 8], DEV)
    g = split_reduction(g, "fc2", 8)
    g = retile(g, "fc2", [8, 1, 1], DEV)
    return retile(g, "fc2.acc", [8, 1], DEV)


def data_parallel(T, H):
    g = mlp(T, H)
    for name in list(g.ops):
        g = retile(g, name, [8, 1], DEV)
    return g


def roof(flops, nbytes):
    return max(flops / P, nbytes / B) + L


def dp_closed(T, H):
    t = T / 8
    return (roof(t * 4 * H * (2 * H + 1), 4 * (t * H + 4 * H * H + 4 * H + 4 * t * H))
            + roof(4 * t * H, 4 * 2 * 4 * t * H)
            + roof(t * H * (8 * H + 1), 4 * (4 * t * H + 4 * H * H + H + t * H)))


def tp_closed(T, H):
    t = T / 8
    return (roof(T * H / 2 * (2 * H + 1), 4 * (T * H + H * H / 2 + H / 2 + T * H / 2))
            + roof(T * H / 2, 4 * 2 * T * H / 2)
            + roof(T * H * (8 * H + 1) / 8, 4 * (T * H / 2 + H * H / 2 + H + T * H))
            + LAT + 7 * 4 * t * H / BW  # 7 blocks back to back on the ingress port, latencies overlapped
            + roof(7 * t * H, 4 * 9 * t * H))


def closed_form_crossover(H):
    lo, hi = 8.0, 1e6  # TP wins at lo, DP at hi; bisection on a log scale
    assert tp_closed(lo, H) < dp_closed(lo, H) and tp_closed(hi, H) > dp_closed(hi, H)
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if tp_closed(mid, H) < dp_closed(mid, H) else (lo, mid)
    return lo


SWEEP = [8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512, 768, 1024, 2048, 4096, 8192]


@pytest.fixture(scope="module", params=[4096, 1024], ids=lambda h: f"H{h}")
def sweep(request):
    H = request.param
    ev = Evaluator(HW, collectives=False, curves=None)  # the flat roofline of the closed forms
    return H, {T: (ev(tensor_parallel(T, H), keep=True), ev(data_parallel(T, H), keep=True)) for T in SWEEP}


def weights_resident(e, H, x_rows):
    """Resident bytes per device minus the input rows of x each device holds."""
    return e.lowered.resident - 4.0 * x_rows * H


def test_data_parallel_matches_the_closed_form(sweep):
    H, runs = sweep
    for T, (tp, dp) in runs.items():
        assert dp.makespan == pytest.approx(dp_closed(T, H), rel=1e-9)
        assert dp.bytes_moved == 0
        # TP: the closed form assumes each device's 7 incoming partials run back to back on its
        # ingress (56 transfers in 7 rounds); the list scheduler is close to that
        assert tp_closed(T, H) * (1 - 1e-9) <= tp.makespan <= 1.35 * tp_closed(T, H)
        assert tp.bytes_moved == pytest.approx(8 * 7 * 4.0 * (T / 8) * H)


def test_reduce_scatter_pays_one_latency(sweep):
    # all fc2 partials finish together; the first fc2.acc shard starts one latency plus the port
    # time of its 7 incoming blocks later (4tH / BW each, back to back), not 7 latencies later
    H, runs = sweep
    for T in (8, 64, 1024):
        tp = runs[T][0]
        ops = {o["op"]: o for o in tp.breakdown().ops}
        wait = ops["fc2.acc"]["start"] - ops["fc2"]["finish"]
        occ = 4.0 * (T / 8) * H / BW
        assert wait == pytest.approx(LAT + 7 * occ, rel=1e-9)
        assert ops["fc2.acc"]["in_latency_s"] == pytest.approx(8 * 7 * LAT)
        assert ops["fc2.acc"]["in_s"] == pytest.approx(8 * 7 * occ)


def test_few_tokens_memory_bound_tensor_parallel_wins(sweep):
    H, runs = sweep
    few, margin = FEW[H]
    for T in few:
        tp, dp = runs[T]
        low = dp.lowered
        fc1 = list(low.op_names).index("fc1")
        a, b = low.op_offsets[fc1], low.op_offsets[fc1 + 1]
        # each data-parallel device reads all of W1 (and is memory-bound doing so)
        assert np.all(low.nbytes[a:b] >= 4.0 * H * 4 * H)
        assert np.all(low.nbytes[a:b] / B > low.flops[a:b] / P)
        assert tp.makespan < margin * dp.makespan
        assert tp_closed(T, H) < dp_closed(T, H)


def test_many_tokens_data_parallel_wins(sweep):
    H, runs = sweep
    for T in (1024, 2048, 4096, 8192):
        tp, dp = runs[T]
        assert dp.makespan < tp.makespan
        assert dp.bytes_moved == 0 < tp.bytes_moved


def test_tensor_parallel_needs_an_eighth_of_the_weight_memory(sweep):
    H, runs = sweep
    for T, (tp, dp) in runs.items():
        w_tp = weights_resident(tp, H, T)      # TP: every device holds all of x
        w_dp = weights_resident(dp, H, T // 8)  # DP: its rows of x
        np.testing.assert_allclose(w_dp, 4.0 * (8 * H * H + 5 * H))  # W1, b1, W2, b2
        np.testing.assert_allclose(w_tp / w_dp, 1 / 8, rtol=0.01)


def test_crossover_against_the_closed_form(sweep):
    H, runs = sweep
    wins = [T for T in SWEEP if runs[T][1].makespan <= runs[T][0].makespan]
    t_sim = wins[0]
    assert all(T in wins for T in SWEEP if T >= t_sim)  # one crossover
    assert t_sim > 8  # TP wins at the fewest tokens
    t_star = closed_form_crossover(H)
    assert t_star / 2 <= t_sim <= 2 * t_star, (t_sim, t_star)


def test_hidden_size_where_tensor_parallelism_first_wins():
    # at T = 8 tokens: DP wins at H = 512 and 896, TP at H = 960 and 1024, in the simulator and
    # in the closed form. With 7 latencies in a row (links not pipelined) the closed form needed
    # H >= 1664 (and the simulator, whose schedule then paid about 12 latencies, H >= 2176).
    ev = Evaluator(HW, collectives=False, curves=None)  # the flat roofline of the closed forms
    T = 8
    for H, tp_wins in ((512, False), (896, False), (960, True), (1024, True)):
        tp, dp = ev(tensor_parallel(T, H)), ev(data_parallel(T, H))
        assert (tp.makespan < dp.makespan) == tp_wins, H
        assert (tp_closed(T, H) < dp_closed(T, H)) == tp_wins, H
    unpipelined = lambda H: tp_closed(T, H) + 6 * LAT  # noqa: E731  (7 latencies in a row)
    assert unpipelined(1024) > dp_closed(T, 1024) and unpipelined(1600) > dp_closed(T, 1600)
    assert unpipelined(1664) < dp_closed(T, 1664)
