"""Hardware specs, presets, YAML loading/saving and validation."""

import pickle

import numpy as np
import pytest

from costmodel.hardware import DeviceSpec, Hardware, HardwareError, LinkSpec
from costmodel.hardware_io import hardware_from_yaml_text, load_hardware, save_hardware
from costmodel.presets import PRESETS, preset, preset_names


def test_preset_names():
    assert set(preset_names()) == {"h100-sxm-8", "h200-sxm-8", "h100-sxm-64", "h100-sxm-512", "a100-sxm-8",
                                   "a100-sxm-64", "b200-8", "b200-64", "gb200-nvl72", "gb200-nvl72x2", "cpu"}
    assert preset("cpu") is PRESETS["cpu"]


def test_h100_datasheet_figures():
    hw = load_hardware("h100-sxm-8")
    d = hw.device
    assert hw.n_devices == 8 and hw.n_nodes == 1
    assert hw.peak_flops("bfloat16") == pytest.approx(989.4e12)
    assert hw.peak_flops("float16") == pytest.approx(989.4e12)
    assert hw.peak_flops("float32") == pytest.approx(66.9e12)  # FP32 vector, not TF32
    assert hw.peak_flops("tf32") == pytest.approx(494.7e12)
    assert d.mem_bandwidth == pytest.approx(3.35e12)
    assert d.mem_capacity == pytest.approx(80e9)
    assert d.active_power == 700.0
    assert 60.0 <= d.idle_power <= 100.0
    assert d.launch_overhead == pytest.approx(5e-6)
    assert hw.intra_link.bandwidth == pytest.approx(450e9)  # 900 GB/s bidirectional
    assert hw.inter_link.bandwidth == pytest.approx(50e9)  # 400 Gb/s
    assert 2e-6 <= hw.intra_link.latency <= 3e-6
    assert hw.inter_link.latency == pytest.approx(5e-6)
    assert 0 < hw.intra_link.energy_per_byte < hw.inter_link.energy_per_byte
    assert hw.efficiency == {"default": (1.0, 1.0)}


def test_h200_and_cluster_presets():
    h200 = load_hardware("h200-sxm-8")
    assert h200.device.mem_bandwidth == pytest.approx(4.8e12)
    assert h200.device.mem_capacity == pytest.approx(141e9)
    assert h200.peak_flops("bfloat16") == load_hardware("h100-sxm-8").peak_flops("bfloat16")
    assert h200.device.active_power == 700.0
    big = load_hardware("h100-sxm-64")
    assert (big.n_nodes, big.devices_per_node, big.n_devices) == (8, 8, 64)
    assert big.node_of(0) == 0 and big.node_of(7) == 0 and big.node_of(8) == 1 and big.node_of(63) == 7
    np.testing.assert_array_equal(big.node_of(np.array([0, 9, 17])), [0, 1, 2])
    np.testing.assert_array_equal(big.device_nodes()[[0, 8, 63]], [0, 1, 7])
    cpu = load_hardware("cpu")
    assert cpu.n_devices == 1
    assert cpu.device.mem_capacity <= 24 * 2**30
    assert cpu.peak_flops("float32") < 1e12


def test_a100_and_b200_presets():
    """The datasheets' figures (costmodel/presets.py cites them), and the fleets' links."""
    a100, b200 = load_hardware("a100-sxm-64"), load_hardware("b200-64")
    assert a100.peak_flops("bfloat16") == 312e12 and a100.peak_flops("float32") == 19.5e12
    assert (a100.device.mem_bandwidth, a100.device.mem_capacity, a100.device.active_power) == (2.039e12, 80e9, 400)
    assert b200.peak_flops("bfloat16") == 2250e12 and b200.peak_flops("float32") == 80e12
    assert (b200.device.mem_bandwidth, b200.device.mem_capacity, b200.device.active_power) == (8e12, 180e9, 1000)
    for hw, nvlink, ib in ((a100, 300e9, 25e9), (b200, 900e9, 50e9)):
        assert (hw.n_nodes, hw.devices_per_node) == (8, 8)
        np.testing.assert_array_equal(hw.link_bandwidth(np.array([0, 0]), np.array([7, 8])), [nvlink, ib])
    for one, many in (("a100-sxm-8", a100), ("b200-8", b200)):
        assert load_hardware(one).device == many.device and load_hardware(one).n_devices == 8
    rack = load_hardware("gb200-nvl72x2")  # an NVLink domain of 72 is one "node"
    assert (rack.n_nodes, rack.devices_per_node, rack.peak_flops("bfloat16")) == (2, 72, 2500e12)
    np.testing.assert_array_equal(rack.link_bandwidth(np.array([0, 0]), np.array([71, 72])), [900e9, 50e9])


def test_links_vectorized():
    hw = load_hardware("h100-sxm-64")
    src = np.array([0, 0, 3, 8])
    dst = np.array([1, 8, 3, 63])
    np.testing.assert_array_equal(hw.link_bandwidth(src, dst), [450e9, 50e9, np.inf, 50e9])
    np.testing.assert_array_equal(hw.link_latency(src, dst), [2.5e-6, 5e-6, 0.0, 5e-6])
    epb = hw.link_energy_per_byte(src, dst)
    assert epb[0] == hw.intra_link.energy_per_byte and epb[1] == hw.inter_link.energy_per_byte and epb[2] == 0
    t = hw.transfer_time(src, dst, np.array([450e9, 50e9, 1e9, 0.0]))
    np.testing.assert_allclose(t, [1 + 2.5e-6, 1 + 5e-6, 0.0, 5e-6])
    with pytest.raises(HardwareError, match="out of range"):
        hw.link_bandwidth([0], [64])
    with pytest.raises(HardwareError, match="out of range"):
        hw.node_of(-1)


def test_roofline_and_efficiency():
    hw = load_hardware("h100-sxm-8")
    # compute-bound: 989.4e12 FLOPs in bf16 = 1 s (+ 5 us launch)
    assert hw.shard_time(989.4e12, 1.0, "bfloat16") == pytest.approx(1 + 5e-6)
    # memory-bound: 3.35e12 bytes = 1 s
    assert hw.shard_time(1.0, 3.35e12, "float32") == pytest.approx(1 + 5e-6)
    cal = hw.with_efficiency(matmul=(0.5, 0.25), launch_overhead_by_class={"matmul": 1e-5})
    assert hw.efficiency_for("matmul") == (1.0, 1.0)  # original untouched
    assert cal.efficiency_for("matmul") == (0.5, 0.25)
    assert cal.efficiency_for("softmax") == (1.0, 1.0)  # falls back to default
    assert cal.shard_time(989.4e12, 1.0, "bfloat16", "matmul") == pytest.approx(2 + 1e-5)
    assert cal.shard_time(1.0, 3.35e12, "bfloat16", "matmul") == pytest.approx(4 + 1e-5)
    np.testing.assert_allclose(cal.shard_time(np.array([989.4e12, 0.0]), np.array([0.0, 3.35e12]), "bfloat16"),
                               [1 + 5e-6, 1 + 5e-6])
    ce, me, lo = cal.efficiency_arrays(["matmul", "default", "gelu"])
    np.testing.assert_array_equal(ce, [0.5, 1.0, 1.0])
    np.testing.assert_array_equal(me, [0.25, 1.0, 1.0])
    np.testing.assert_array_equal(lo, [1e-5, 5e-6, 5e-6])
    with pytest.raises(HardwareError, match="float8"):
        hw.peak_flops("float8")
    with pytest.raises(HardwareError, match="efficiency.matmul"):
        hw.with_efficiency(matmul=(0.0, 1.0))
    with pytest.raises(HardwareError, match="efficiency.default"):
        hw.with_efficiency({"matmul": (0.5, 0.5)}, replace_all=True)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_pickle_yaml_round_trip(name, tmp_path):
    hw = PRESETS[name].with_efficiency(matmul=(0.71, 0.93))
    assert Hardware.from_dict(hw.to_dict()) == hw
    assert pickle.loads(pickle.dumps(hw)) == hw
    assert hash(pickle.loads(pickle.dumps(hw))) == hash(hw)
    p = save_hardware(hw, tmp_path / "hw.yaml")
    back = load_hardware(p)
    assert back == hw
    assert back.to_dict() == hw.to_dict()


def test_base_plus_overrides(tmp_path):
    p = tmp_path / "cal.yaml"
    p.write_text(
        "base: h100-sxm-8\n"
        "name: h100-calibrated\n"
        "devices_per_node: 4\n"
        "device:\n"
        "  mem_capacity: 75 GB\n"
        "  peak_flops: {float32: 60 TFLOP/s}\n"
        "intra_link: {latency: 3 us}\n"
        "efficiency:\n"
        "  matmul: {compute: 0.7, memory: 0.9}\n"
        "  elementwise: [0.5, 0.8]\n"
        "  default: {memory: 0.85}\n"
    )
    hw = load_hardware(p)
    base = PRESETS["h100-sxm-8"]
    assert hw.name == "h100-calibrated" and hw.n_devices == 4
    assert hw.device.mem_capacity == 75e9
    assert hw.peak_flops("float32") == 60e12
    assert hw.peak_flops("bfloat16") == base.peak_flops("bfloat16")  # merged, not replaced
    assert hw.intra_link.latency == 3e-6 and hw.intra_link.bandwidth == base.intra_link.bandwidth
    assert hw.efficiency["matmul"] == (0.7, 0.9)
    assert hw.efficiency["elementwise"] == (0.5, 0.8)
    assert hw.efficiency["default"] == (1.0, 0.85)
    assert hw.inter_link == base.inter_link


def test_base_chain_relative_path(tmp_path):
    (tmp_path / "a.yaml").write_text("base: h200-sxm-8\nn_nodes: 2\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\nname: two-h200\n")
    hw = load_hardware(tmp_path / "sub" / "b.yaml")
    assert hw.name == "two-h200" and hw.n_devices == 16 and hw.device.mem_bandwidth == 4.8e12
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    with pytest.raises(HardwareError, match="circular"):
        load_hardware(tmp_path / "c.yaml")


def test_save_calibrated_with_base(tmp_path, monkeypatch):
    cal = PRESETS["h100-sxm-64"].with_efficiency(matmul=(0.72, 0.9), default=(0.9, 0.88))
    p = save_hardware(cal, tmp_path / "calibrated.yaml", base="h100-sxm-64")
    text = p.read_text()
    assert text.startswith("base: h100-sxm-64")
    assert "peak_flops" not in text and "intra_link" not in text
    assert load_hardware(p) == cal
    # a change that cannot be expressed as a merge (class removed) falls back to the full spec
    monkeypatch.setitem(PRESETS, "tmp-base", cal)
    reduced = cal.with_efficiency({"default": (0.9, 0.88)}, replace_all=True)
    q = save_hardware(reduced, tmp_path / "full.yaml", base="tmp-base")
    assert "base:" not in q.read_text()
    assert load_hardware(q) == reduced
    with pytest.raises(HardwareError, match="known presets"):
        save_hardware(cal, tmp_path / "x.yaml", base="h100-pcie")


def test_unknown_preset_lists_known():
    with pytest.raises(HardwareError) as ei:
        load_hardware("h100-sxm-9")
    msg = str(ei.value)
    assert "h100-sxm-9" in msg
    for name in PRESETS:
        assert name in msg
    with pytest.raises(HardwareError, match="known presets"):
        hardware_from_yaml_text("base: a100\n")
    assert issubclass(HardwareError, ValueError)


def test_unknown_and_missing_fields(tmp_path):
    p = tmp_path / "typo.yaml"
    p.write_text("base: h100-sxm-8\ndevice:\n  mem_capacty: 1\n")
    with pytest.raises(HardwareError, match=r"unknown field device\.mem_capacty"):
        load_hardware(p)
    with pytest.raises(HardwareError, match=r"unknown field nodes"):
        hardware_from_yaml_text("base: cpu\nnodes: 2\n")
    with pytest.raises(HardwareError, match=r"unknown field intra_link\.bw"):
        hardware_from_yaml_text("base: cpu\nintra_link: {bw: 3}\n")
    full = PRESETS["h100-sxm-8"].to_dict()
    del full["inter_link"]
    with pytest.raises(HardwareError, match=r"missing field inter_link"):
        load_hardware(full)
    full = PRESETS["h100-sxm-8"].to_dict()
    del full["device"]["peak_flops"]["bfloat16"]
    with pytest.raises(HardwareError, match=r"missing field device\.peak_flops\.bfloat16"):
        Hardware.from_dict(full)
    full = PRESETS["h100-sxm-8"].to_dict()
    del full["device"]["idle_power"]
    with pytest.raises(HardwareError, match=r"missing field device\.idle_power"):
        Hardware.from_dict(full)
    with pytest.raises(HardwareError, match="not found"):
        load_hardware(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("base: [unclosed\n")
    with pytest.raises(HardwareError, match="not valid YAML"):
        load_hardware(tmp_path / "bad.yaml")


def test_bad_values():
    with pytest.raises(HardwareError, match=r"intra_link\.bandwidth"):
        hardware_from_yaml_text("base: cpu\nintra_link: {bandwidth: -1}\n")
    with pytest.raises(HardwareError, match="idle_power"):
        hardware_from_yaml_text("base: cpu\ndevice: {idle_power: 50}\n")
    with pytest.raises(HardwareError, match="n_nodes"):
        hardware_from_yaml_text("base: cpu\nn_nodes: 0\n")
    with pytest.raises(HardwareError, match="n_nodes"):
        hardware_from_yaml_text("base: cpu\nn_nodes: 1.5\n")
    with pytest.raises(HardwareError, match="unknown unit"):
        hardware_from_yaml_text("base: cpu\ndevice: {mem_capacity: 80 parsecs}\n")
    with pytest.raises(HardwareError, match="unknown unit"):  # a bandwidth is not a size
        hardware_from_yaml_text("base: cpu\ndevice: {mem_capacity: 80 GB/s}\n")
    with pytest.raises(HardwareError, match="expected a number"):
        hardware_from_yaml_text("base: cpu\ndevice: {launch_overhead: fast}\n")
    with pytest.raises(HardwareError, match=r"efficiency\.matmul"):
        hardware_from_yaml_text("base: cpu\nefficiency: {matmul: 0.5}\n")


def test_units():
    hw = hardware_from_yaml_text(
        "base: cpu\n"
        "device: {mem_bandwidth: 3.35 TB/s, mem_capacity: 2 GiB, launch_overhead: 7 us, active_power: 1 kW,"
        " idle_power: 100 W, peak_flops: {float32: 1.5e12}}\n"
        "intra_link: {bandwidth: 400 Gb/s, latency: 2.5e-6, energy_per_byte: 5 pJ/bit}\n")
    assert hw.device.mem_bandwidth == pytest.approx(3.35e12)
    assert hw.device.mem_capacity == 2 * 2**30
    assert hw.device.launch_overhead == pytest.approx(7e-6)
    assert hw.device.active_power == 1000.0 and hw.device.idle_power == 100.0
    assert hw.peak_flops("float32") == 1.5e12  # YAML reads 1.5e12 as a string; still parsed
    assert hw.intra_link.bandwidth == pytest.approx(50e9)
    assert hw.intra_link.latency == pytest.approx(2.5e-6)
    assert hw.intra_link.energy_per_byte == pytest.approx(40e-12)


def test_direct_construction():
    dev = DeviceSpec("x", {"float32": 1e12, "float16": 2e12, "bfloat16": 2e12}, 1e12, 1e9, 1e-6, 100, 10)
    link = LinkSpec(1e9, 1e-6)
    hw = Hardware("toy", dev, 2, 2, link, LinkSpec(1e8, 1e-5, 1e-10))
    assert hw.n_devices == 4 and hw.efficiency == {"default": (1.0, 1.0)}
    assert link.energy_per_byte == 0.0
    assert float(link.transfer_time(1e9)) == pytest.approx(1 + 1e-6)
    assert hw.replace(n_nodes=3).n_devices == 6
    assert "toy" in hw.summary()
    with pytest.raises(HardwareError, match="peak_flops.bfloat16"):
        DeviceSpec("x", {"float32": 1e12, "float16": 2e12}, 1e12, 1e9, 1e-6, 100, 10)


@pytest.mark.parametrize("text,field", [
    # a misspelt class was accepted, and (any factor other than 1 switching the published curves
    # off) made the plan 4.9x faster on paper
    ("efficiency:\n  mtmul: {compute: 0.5, memory: 1}\n", "efficiency.mtmul"),
    ("launch_overhead_by_class: {matmull: 1e-6}\n", "launch_overhead_by_class.matmull"),
    ("efficiency:\n  matmul: {compute: 5, memory: 1}\n", "efficiency.matmul"),  # 500% of the peak
    ("devices_per_node: 10000000\n", "n_nodes x devices_per_node"),  # 36 s and 5.9 GB before the refusal
    ("n_nodes: 2\nn_nodes: 4\n", "'n_nodes' is given twice"),  # YAML kept the last silently
])
def test_bad_hardware_files_name_the_field(tmp_path, text, field):
    p = tmp_path / "hw.yaml"
    p.write_text("base: h100-sxm-8\n" + text)
    with pytest.raises(HardwareError, match=field.replace(".", r"\.")):
        load_hardware(p)


def test_every_kernel_class_may_be_calibrated():
    from costmodel.hardware import kernel_classes

    classes = kernel_classes()
    assert {"default", "matmul", "matmul.attention", "elementwise"} <= classes
    hw = PRESETS["h100-sxm-8"].with_efficiency({c: (0.5, 0.5) for c in classes})
    assert hw.efficiency_for("matmul.attention") == (0.5, 0.5)
