"""Kernel subclasses (``matmul.attention``, ``matmul.norm``, ``matmul.einsum``): their own factors where a hardware
has them, their parent's where it does not; targets that never name them are costed as before."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.hardware import class_chain, class_family
from costmodel.hardware_io import load_hardware
from costmodel.lowering import Lowerer, kernel_class_of
from costmodel.presets import PRESETS
from ir import workloads
from ir.kernels.attention import Attention
from ir.kernels.contraction import Einsum
from ir.kernels.prenorm import NormMatmul
from ir.rewrites import fuse_attention, fuse_norm, split


def test_class_chain_and_family():
    assert class_chain("matmul.attention") == ("matmul.attention", "matmul", "default")
    assert class_chain("matmul") == ("matmul", "default")
    assert class_chain("default") == ("default",)
    assert class_family("matmul.norm") == "matmul" and class_family("conv") == "conv"


def test_subclass_takes_its_parent_factors_until_it_has_its_own():
    hw = load_hardware("cpu").with_efficiency({"matmul": (0.5, 0.25)}, launch_overhead_by_class={"matmul": 1e-4})
    assert hw.efficiency_for("matmul.attention") == (0.5, 0.25)
    assert hw.launch_overhead_for("matmul.attention") == 1e-4
    # 1 GFLOP at 150 GFLOP/s x 0.5, plus the launch
    assert float(hw.shard_time(1e9, 1e3, "float32", "matmul.attention")) == pytest.approx(1e9 / 75e9 + 1e-4)
    own = hw.with_efficiency({"matmul.attention": (0.25, 0.25)}, launch_overhead_by_class={"matmul.attention": 2e-4})
    assert float(own.shard_time(1e9, 1e3, "float32", "matmul.attention")) == pytest.approx(1e9 / 37.5e9 + 2e-4)
    assert float(own.shard_time(1e9, 1e3, "float32", "matmul")) == pytest.approx(1e9 / 75e9 + 1e-4)
    # a class without an entry of its own keeps the device's launch, not a "default" entry's
    odd = hw.with_efficiency(launch_overhead_by_class={"default": 5e-3})
    assert odd.launch_overhead_for("conv") == hw.device.launch_overhead


def _plan():
    g = workloads.build("transformer", batch=2, seq=64, d_model=128, heads=4, d_ff=256)
    g = fuse_norm(fuse_attention(g, "attn_qk"), "ln2")
    att = next(n for n, o in g.ops.items() if o.kernel == "attention")
    nm = next(n for n, o in g.ops.items() if o.kernel == "norm_matmul")
    return split(split(g, att, 0, 2), nm, 0, 2), att, nm


def test_attention_norm_matmul_and_einsum_have_their_subclasses():
    g, att, nm = _plan()
    assert kernel_class_of(g.ops[att]) == "matmul.attention"
    assert kernel_class_of(g.ops[nm]) == "matmul.norm"
    assert kernel_class_of(g.ops["o_proj"]) == "matmul.einsum"
    assert kernel_class_of(g.ops["ff2"]) == "matmul"  # linear stays a plain GEMM


@pytest.mark.parametrize("preset", ["h100-sxm-8", "h200-sxm-8", "cpu"])
def test_targets_that_never_name_a_subclass_are_costed_as_before(preset, monkeypatch):
    """The same plan with the three kernels declared plain ``matmul`` (the old classes) gives
    bit-identical shard durations and makespan, GEMM efficiency curves included (H100, H200)."""
    g, att, nm = _plan()
    hw = PRESETS[preset]
    new = Evaluator(hw)(g)
    new_dur = Lowerer(hw).lower(g).dur.copy()
    monkeypatch.setattr(Attention, "kernel_class", "matmul")
    monkeypatch.setattr(NormMatmul, "kernel_class", "matmul")
    monkeypatch.setattr(Einsum, "kernel_class", "matmul")
    assert kernel_class_of(g.ops[att]) == "matmul" and kernel_class_of(g.ops["o_proj"]) == "matmul"
    old = Evaluator(hw)(g)
    old_dur = Lowerer(hw).lower(g).dur
    np.testing.assert_array_equal(new_dur, old_dur)
    assert new.makespan == old.makespan


def test_a_subclass_entry_changes_only_its_ops():
    g, att, nm = _plan()
    hw = load_hardware("cpu").with_efficiency({"matmul": (0.5, 0.5)})
    slow = hw.with_efficiency({"matmul.attention": (0.1, 0.5)})
    a, b = Lowerer(hw).lower(g), Lowerer(slow).lower(g)
    off = {n: (int(a.op_offsets[i]), int(a.op_offsets[i + 1])) for i, n in enumerate(a.op_names)}
    for n, (lo, hi) in off.items():
        if n == att:
            assert np.all(b.dur[lo:hi] > a.dur[lo:hi])
        else:
            np.testing.assert_array_equal(b.dur[lo:hi], a.dur[lo:hi])
