"""The cost model on fused attention, by hand: the 64-GPU transformer case on one H100.

Sizes as in the issue's measurement: batch 64, sequence 2048, 64 heads of 128 (d_model 8192),
d_ff 32768, bfloat16. Unfused, the scores and probabilities (64·64·2048·2048·2 bytes each,
34.36 GB) are the whole excess of the peak; fused, no s × s tensor exists and the peak moves to
the feed-forward. The fused op's modelled time is the FlashAttention FLOP count (Dao et al.
2022, §3 and §4.1: 4·N²·d per head, plus the softmax) at the H100's dense bfloat16 peak.
"""

from __future__ import annotations

import pytest

from costmodel import evaluate
from costmodel.hardware_io import load_hardware
from ir import workloads
from ir.rewrites import fuse_attention, split, split_reduction

B, S, H, E, D, F = 64, 2048, 64, 128, 8192, 32768
BF16 = 2
ACT = B * S * D * BF16  # one [b, s, d_model] activation: 2.147 GB
SCORES = B * H * S * S * BF16  # 34.36 GB each: scores and probabilities
RESIDENT = (4 * D * D + 2 * D * F + 4 * D + F + D) * BF16 + ACT  # weights, norms, biases and the input x


@pytest.fixture(scope="module")
def case():
    g = workloads.build("transformer", batch=B, seq=S, d_model=D, heads=H, d_ff=F, dtype="bfloat16")
    return g, fuse_attention(g, "attn_qk"), load_hardware("h100-sxm-8")


def test_peak_memory_drops_by_scores_and_probabilities(case):
    g, h, hw = case
    un, fu = evaluate(g, hw), evaluate(h, hw)
    assert SCORES == 34_359_738_368
    # Unfused, the peak is while the softmax runs: the resident inputs, ln1.out (v_proj still needs
    # it), the scores and the probabilities. 74.6 GB, of which 68.7 GB are the two s × s tensors.
    assert un.peak_memory == RESIDENT + ACT + 2 * SCORES == 74_625_204_224
    # Fused, the attention step holds the inputs, ln1.out and its [b, s, d] output; the plan's peak
    # is now the feed-forward: ff1.out and ff_act.out ([b, s, d_ff] each) and resid1.out.
    ff = B * S * F * BF16
    assert fu.peak_memory == RESIDENT + 2 * ff + ACT == 23_085_596_672
    assert un.peak_memory - 2 * SCORES < fu.peak_memory < un.peak_memory
    # No tensor of the fused program is s × s (the unfused one has the scores and probabilities).
    assert [n for n, t in h.tensors.items() if list(t.shape).count(S) > 1] == []
    assert [n for n, t in g.tensors.items() if list(t.shape).count(S) > 1] == ["attn_qk.out", "attn_softmax.out"]


def test_fused_attention_time_is_the_flash_attention_closed_form(case):
    g, h, hw = case
    ops = {o["op"]: o for o in evaluate(h, hw, curves=None).breakdown().ops}  # the flat roofline of the closed form
    att = ops["attn_qk+attn_av"]
    paper_flops = 4 * B * H * S * S * E  # Dao et al. 2022: 4·N²·d per head (two GEMMs), softmax not counted
    peak = 989.4e12  # H100 SXM dense BF16 tensor-core peak (NVIDIA H100 datasheet), as in the preset
    assert hw.peak_flops("bfloat16") == peak
    closed = paper_flops / peak
    assert att["compute_s"] == pytest.approx(closed, rel=0.10)
    # Exactly: our FLOPs add the softmax's 5 per score; bytes (q, k, v, o once: 8.6 GB, 2.6 ms at
    # 3.35 TB/s) are below the compute time, so the roofline takes the FLOPs; plus one launch.
    assert att["flops"] == B * H * S * S * (4 * E + 5)
    bytes_s = 4 * ACT / hw.device.mem_bandwidth
    assert bytes_s < att["flops"] / peak
    assert att["compute_s"] == pytest.approx(att["flops"] / peak + hw.launch_overhead_for("matmul"), rel=1e-9)
    # Unfused, the same work costs the two bmm plus a memory-bound softmax over 68.7 GB of traffic.
    un = {o["op"]: o for o in evaluate(g, hw).breakdown().ops}
    unfused_s = sum(un[n]["compute_s"] for n in ("k_t", "attn_qk", "attn_softmax", "attn_av"))
    assert unfused_s > 4 * att["compute_s"]


def test_split_key_reduction_costs_only_the_partials(case):
    """Ring/split-K attention over 8 GPUs: each shard reads 1/8 of k and v; the partials add one
    channel per output row, never an s × s block."""
    _, h, hw = case
    p = split(split_reduction(h, "attn_qk+attn_av", 8), "attn_qk+attn_av", "kb", 8)
    assert p.tensors["attn_qk+attn_av.partial"].shape == (8, B, H, S, E + 1)
    ev = evaluate(p, hw)
    ops = {o["op"]: o for o in ev.breakdown().ops}
    assert ops["attn_qk+attn_av"]["flops"] == pytest.approx(B * H * S * S * (4 * E + 5))
    assert ops["attn_qk+attn_av.acc"]["shards"] == 1
