"""Kernel signatures against independent NumPy formulas.

For every kernel in the registry: the output projection of the whole index space covers the
output exactly once; the block compute of any sub-box equals the matching slice of a whole-array
reference computed by a formula written here (not by the kernel); split reductions sum back.
Also FLOPs and bytes by hand, dtype rules, and signature errors with their messages.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import scipy.special

from ir.kernels import REGISTRY, SignatureError, TensorSpec, get_kernel
from ir.kernels.base import Signature
from ir.zspace import ZRange
from tests.ir.kernel_cases_attention import attention_cases, check_softmax_split
from tests.ir.kernel_cases_import import import_cases
from tests.ir.kernel_cases_training import training_cases

# -- independent references ----------------------------------------------------------------------


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def layernorm_ref(x, g, b, eps=1e-5):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * g + b


def conv2d_naive(x, w, stride=1, padding=0):
    """Direct loops over output cells: y[n,o,i,j] = Σ_{c,u,v} x_pad[n,c,i·s+u,j·s+v] · w[o,c,u,v]."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.zeros((n, c, h + 2 * padding, wd + 2 * padding))
    xp[:, :, padding:padding + h, padding:padding + wd] = x
    oh, ow = (h + 2 * padding - kh) // stride + 1, (wd + 2 * padding - kw) // stride + 1
    y = np.zeros((n, o, oh, ow))
    for a, q, i, j in itertools.product(range(n), range(o), range(oh), range(ow)):
        y[a, q, i, j] = np.sum(xp[a, :, i * stride:i * stride + kh, j * stride:j * stride + kw] * w[q])
    return y


@dataclass
class Case:
    id: str
    kernel: str
    shapes: dict[str, tuple[int, ...]]
    params: dict[str, Any]
    ref: Callable[..., np.ndarray]
    positive: tuple[str, ...] = ()  # ports fed strictly positive values (divisors)
    pads: bool = False  # input boxes may reach past the tensor (conv halos)
    extra: dict = field(default_factory=dict)
    ints: dict[str, int] = field(default_factory=dict)  # int32 index ports: values in [0, high)


def _fused_linear_relu():
    stages = [{"op": "fc", "kernel": "linear", "params": {}, "chain": None, "via": None},
              {"op": "act", "kernel": "relu", "params": {}, "chain": "x", "via": "fc.out"}]
    return Case("fused_linear_relu", "fused", {"0.x": (5, 6), "0.W": (6, 7), "0.b": (7,)}, {"stages": stages},
                lambda i: np.maximum(i["0.x"] @ i["0.W"] + i["0.b"], 0.0))


def _fused_softmax_mul_add():
    stages = [{"op": "sm", "kernel": "softmax", "params": {}, "chain": None, "via": None},
              {"op": "scale", "kernel": "mul", "params": {}, "chain": "a", "via": "sm.out"},
              {"op": "shift", "kernel": "add", "params": {}, "chain": "b", "via": "scale.out"}]
    return Case("fused_softmax_mul_add", "fused", {"0.x": (3, 4, 5), "1.b": (5,), "2.a": (4, 1)},
                {"stages": stages},
                lambda i: i["2.a"] + scipy.special.softmax(i["0.x"], axis=-1) * i["1.b"])


CASES = [
    Case("relu", "relu", {"x": (4, 6)}, {}, lambda i: np.where(i["x"] > 0, i["x"], 0.0)),
    Case("gelu", "gelu", {"x": (3, 2, 5)}, {}, lambda i: gelu_tanh(i["x"])),
    Case("exp", "exp", {"x": (7,)}, {}, lambda i: np.exp(i["x"])),
    Case("tanh", "tanh", {"x": (4, 5)}, {}, lambda i: np.tanh(i["x"])),
    Case("add", "add", {"a": (4, 5), "b": (4, 5)}, {}, lambda i: i["a"] + i["b"]),
    Case("add_bias_1N", "add", {"a": (4, 5), "b": (1, 5)}, {}, lambda i: i["a"] + i["b"]),
    Case("add_bias_N", "add", {"a": (4, 5), "b": (5,)}, {}, lambda i: i["a"] + i["b"]),
    Case("add_outer", "add", {"a": (4, 1), "b": (1, 5)}, {}, lambda i: i["a"] + i["b"]),
    Case("sub_col", "sub", {"a": (3, 4, 5), "b": (4, 1)}, {}, lambda i: i["a"] - i["b"]),
    Case("mul", "mul", {"a": (2, 3), "b": (2, 3)}, {}, lambda i: i["a"] * i["b"]),
    Case("div", "div", {"a": (3, 4), "b": (4,)}, {}, lambda i: i["a"] / i["b"], positive=("b",)),
    Case("matmul", "matmul", {"a": (5, 6), "b": (6, 4)}, {}, lambda i: i["a"] @ i["b"]),
    Case("matmul_alpha", "matmul", {"a": (3, 8), "b": (8, 2)}, {"alpha": 0.5}, lambda i: 0.5 * (i["a"] @ i["b"])),
    Case("bmm", "bmm", {"a": (2, 3, 4), "b": (2, 4, 5)}, {},
         lambda i: np.einsum("bmk,bkn->bmn", i["a"], i["b"])),
    Case("bmm4_alpha", "bmm", {"a": (2, 2, 3, 4), "b": (2, 2, 4, 3)}, {"alpha": 0.25},
         lambda i: 0.25 * np.einsum("abmk,abkn->abmn", i["a"], i["b"])),
    Case("einsum_heads", "einsum", {"a": (2, 3, 4), "b": (4, 2, 3)}, {"equation": "bsd,dhe->bhse"},
         lambda i: np.einsum("bsd,dhe->bhse", i["a"], i["b"])),
    Case("einsum_two_reductions", "einsum", {"a": (2, 2, 3, 4), "b": (2, 4, 6)}, {"equation": "bhse,hed->bsd"},
         lambda i: np.einsum("bhse,hed->bsd", i["a"], i["b"])),
    Case("einsum_outer", "einsum", {"a": (3,), "b": (4,)}, {"equation": "i,j->ij"},
         lambda i: np.outer(i["a"], i["b"])),
    Case("linear", "linear", {"x": (5, 6), "W": (6, 4), "b": (4,)}, {}, lambda i: i["x"] @ i["W"] + i["b"]),
    Case("linear1d", "linear", {"x": (6,), "W": (6, 4), "b": (4,)}, {}, lambda i: i["x"] @ i["W"] + i["b"]),
    Case("linear3d", "linear", {"x": (2, 3, 4), "W": (4, 6), "b": (6,)}, {}, lambda i: i["x"] @ i["W"] + i["b"]),
    Case("softmax", "softmax", {"x": (3, 4, 6)}, {}, lambda i: scipy.special.softmax(i["x"], axis=-1)),
    Case("softmax1d", "softmax", {"x": (6,)}, {}, lambda i: np.exp(i["x"]) / np.exp(i["x"]).sum()),
    Case("layernorm", "layernorm", {"x": (4, 6), "gamma": (6,), "beta": (6,)}, {"eps": 1e-3},
         lambda i: layernorm_ref(i["x"], i["gamma"], i["beta"], 1e-3)),
    Case("reduce_sum_last", "reduce_sum", {"x": (3, 4, 5)}, {}, lambda i: i["x"].sum(axis=-1)),
    Case("reduce_sum_mid", "reduce_sum", {"x": (3, 4, 5)}, {"dim": 1}, lambda i: i["x"].sum(axis=1)),
    Case("reduce_max", "reduce_max", {"x": (4, 6)}, {"dim": 0}, lambda i: i["x"].max(axis=0)),
    Case("accumulate_sum", "accumulate", {"p": (3, 4, 2)}, {}, lambda i: i["p"].sum(axis=0)),
    Case("accumulate_max", "accumulate", {"p": (3, 4)}, {"monoid": "max"}, lambda i: i["p"].max(axis=0)),
    Case("permute", "permute", {"x": (2, 3, 4)}, {"perm": [1, 2, 0]}, lambda i: np.transpose(i["x"], (1, 2, 0))),
    Case("transpose", "transpose", {"x": (3, 5)}, {}, lambda i: i["x"].T),
    Case("conv2d", "conv2d", {"x": (2, 4, 6, 5), "w": (3, 4, 3, 3)}, {"padding": 1},
         lambda i: conv2d_naive(i["x"], i["w"], 1, 1), pads=True),
    Case("conv2d_stride2", "conv2d", {"x": (1, 2, 9, 8), "w": (2, 2, 3, 2)}, {"stride": 2},
         lambda i: conv2d_naive(i["x"], i["w"], 2, 0)),
    # stride past the window (ResNet's 1x1 stride-2 downsample): rows between windows are not read
    Case("conv2d_1x1_stride2", "conv2d", {"x": (2, 3, 7, 9), "w": (4, 3, 1, 1)}, {"stride": 2},
         lambda i: conv2d_naive(i["x"], i["w"], 2, 0)),
    Case("conv2d_wide_pad", "conv2d", {"x": (1, 2, 3, 3), "w": (2, 2, 1, 1)}, {"padding": 2},
         lambda i: conv2d_naive(i["x"], i["w"], 1, 2), pads=True),
    _fused_linear_relu(),
    _fused_softmax_mul_add(),
    *training_cases(Case),
    *attention_cases(Case),
    *import_cases(Case),
]
IDS = [c.id for c in CASES]


def specs(case: Case, dtype: str = "float32") -> dict[str, TensorSpec]:
    return {p: TensorSpec(s, "int32" if p in case.ints else dtype) for p, s in case.shapes.items()}


def data(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {p: rng.standard_normal(s) for p, s in case.shapes.items()}
    for p in case.positive:
        out[p] = np.abs(out[p]) + 0.5
    for p, high in case.ints.items():
        out[p] = rng.integers(0, high, size=case.shapes[p]).astype(np.int32)
    for p in case.extra.get("masks", ()):  # 0/1 masks for the boolean kernels
        out[p] = (out[p] > 0).astype(np.float64)
    return out


def read(arr: np.ndarray, box: ZRange) -> np.ndarray:
    """``arr[box]`` with zeros outside the array (written independently of the executor)."""
    out = np.zeros(box.shape, dtype=arr.dtype)
    inside = box.intersect(ZRange.of_shape(arr.shape))
    if not inside.is_empty:
        src = tuple(slice(a, b) for a, b in zip(inside.start, inside.end))
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(inside.start, inside.end, box.start))
        out[dst] = arr[src]
    return out


def run_box(case: Case, sig: Signature, params: dict, whole: dict[str, np.ndarray], box: ZRange) -> np.ndarray:
    k = get_kernel(case.kernel)
    blocks = {p: read(whole[p], proj.apply(box)) for p, proj in sig.inputs.items()}
    full = params if case.kernel == "fused" else k.check_params(params)
    return np.asarray(k.run(np, blocks, full, box, sig))


def random_subbox(rng: np.random.Generator, whole: ZRange) -> ZRange:
    lo, hi = [], []
    for e in whole.shape:
        a = int(rng.integers(0, e))
        b = int(rng.integers(a + 1, e + 1))
        lo.append(a)
        hi.append(b)
    return ZRange(lo, hi)


def slice_of(arr: np.ndarray, box: ZRange) -> np.ndarray:
    return arr[tuple(slice(a, b) for a, b in zip(box.start, box.end))]


def test_every_registered_kernel_has_a_case():
    assert {c.kernel for c in CASES} == set(REGISTRY)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_output_projection_covers_output_exactly_once(case):
    sig = get_kernel(case.kernel).signature(specs(case), case.params)
    out = sig.out_spec.shape
    assert sig.output.apply(sig.index) == ZRange.of_shape(out)
    # Brute force: every index point's output box, counted cell by cell.
    count = np.zeros(out, dtype=int)
    for pt in itertools.product(*[range(e) for e in sig.extents]):
        count[tuple(slice(a, b) for a, b in zip(*(lambda r: (r.start, r.end))(sig.output.apply_point(pt))))] += 1
    assert (count == 1).all()
    # Inputs: the whole index space reads inside each tensor (except zero-padded conv halos).
    for port, proj in sig.inputs.items():
        img = proj.apply(sig.index)
        if case.pads:
            assert img.intersect(ZRange.of_shape(case.shapes[port])) == ZRange.of_shape(case.shapes[port])
        else:
            assert img == ZRange.of_shape(case.shapes[port]), port


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_block_compute_equals_slice_of_independent_reference(case):
    sig = get_kernel(case.kernel).signature(specs(case), case.params)
    whole = data(case)
    ref = case.ref(whole)
    assert ref.shape == sig.out_spec.shape
    rng = np.random.default_rng(1)
    boxes = [sig.index] + [random_subbox(rng, sig.index) for _ in range(25)]
    for box in boxes:
        y = run_box(case, sig, case.params, whole, box)
        np.testing.assert_allclose(y, slice_of(ref, sig.output.apply(box)), rtol=1e-10, atol=1e-12,
                                   err_msg=f"{case.id} box {box}")


def _split_cases():
    out = []
    for case in CASES:
        if case.kernel == "fused":
            continue
        sig = get_kernel(case.kernel).signature(specs(case), case.params)
        for red in sig.reductions:
            for parts in [p for p in range(2, red.extent + 1) if red.extent % p == 0][:2]:
                out.append(pytest.param(case, red.name, red.monoid, parts, id=f"{case.id}-{red.name}-{parts}"))
    return out


SPLITS = _split_cases()


def test_split_cases_cover_every_reducing_kernel():
    assert {c.values[0].kernel for c in SPLITS} == {
        "matmul", "bmm", "einsum", "linear", "conv2d", "reduce_sum", "reduce_max", "reduce_mean", "reduce_to",
        "embedding_grad", "conv2d_input_grad", "conv2d_weight_grad", "mse_loss", "cross_entropy", "attention",
        "attention_grad_q", "attention_grad_k", "attention_grad_v", "accumulate",
        "batchnorm2d_param_grad"}  # accumulate: two-level reductions


@pytest.mark.parametrize("case,red,monoid,parts", SPLITS)
def test_split_reduction_sums_back(case, red, monoid, parts):
    k = get_kernel(case.kernel)
    params = {**case.params, "split": {"reduction": red, "parts": parts}}
    sig = k.signature(specs(case), params)
    assert sig.dims[0] == "kb" and sig.extents[0] == parts and sig.split_from.name == red
    base = k.signature(specs(case), case.params)
    if monoid == "softmax":  # attention: its partials carry their log-sum-exp, combined by attention_combine
        return check_softmax_split(case, sig, base, params, parts, data(case), run_box, random_subbox, slice_of)
    assert sig.out_spec.shape == (parts,) + base.out_spec.shape
    assert sig.output.apply(sig.index) == ZRange.of_shape(sig.out_spec.shape)
    # Total FLOPs are unchanged by the split.
    assert sig.flops_per_point * sig.index.size == pytest.approx(base.flops_per_point * base.index.size)
    whole = data(case)
    partials = run_box(case, sig, params, whole, sig.index)
    combined = partials.sum(axis=0) if monoid == "sum" else partials.max(axis=0)
    np.testing.assert_allclose(combined, case.ref(whole), rtol=1e-10, atol=1e-12)
    # Through the accumulate kernel too, and block by block over sub-boxes of the partial op.
    acc = get_kernel("accumulate")
    np.testing.assert_allclose(acc.compute(np, {"p": partials}, {"monoid": monoid}), case.ref(whole), rtol=1e-10,
                               atol=1e-12)
    rng = np.random.default_rng(2)
    for _ in range(10):
        box = random_subbox(rng, sig.index)
        np.testing.assert_allclose(run_box(case, sig, params, whole, box), slice_of(partials, sig.output.apply(box)),
                                   rtol=1e-10, atol=1e-12, err_msg=str(box))


# -- FLOPs and bytes by hand ---------------------------------------------------------------------


def _arrays(box: ZRange):
    return np.array([box.start]), np.array([box.end])


def test_matmul_flops_and_bytes_by_hand():
    sig = get_kernel("matmul").signature({"a": TensorSpec((64, 32), "float32"), "b": TensorSpec((32, 48), "float32")},
                                         {})
    assert sig.dims == ("m", "n") and sig.extents == (64, 48)
    box = ZRange((8, 0), (24, 12))  # 16 rows of a, 12 columns of b, all of k = 32
    lo, hi = _arrays(box)
    assert sig.flops(lo, hi)[0] == 2 * 32 * 16 * 12
    read, written = sig.io_bytes(lo, hi)
    assert read[0] == 4 * (16 * 32 + 32 * 12)
    assert written[0] == 4 * 16 * 12
    sig16 = get_kernel("matmul").signature({"a": TensorSpec((64, 32), "float16"),
                                            "b": TensorSpec((32, 48), "float16")}, {})
    assert sig16.io_bytes(lo, hi)[0][0] == 2 * (16 * 32 + 32 * 12)


def test_conv2d_flops_and_halo_bytes_by_hand():
    # x[2, 3, 8, 8], w[4, 3, 3, 3], padding 1: output [2, 4, 8, 8].
    sig = get_kernel("conv2d").signature({"x": TensorSpec((2, 3, 8, 8), "float32"),
                                          "w": TensorSpec((4, 3, 3, 3), "float32")}, {"padding": 1})
    assert sig.extents == (2, 4, 8, 8)
    interior = ZRange((0, 0, 2, 2), (1, 2, 5, 4))  # 1 image, 2 out channels, 3x2 output pixels
    lo, hi = _arrays(interior)
    assert sig.flops(lo, hi)[0] == 2 * 3 * 3 * 3 * (1 * 2 * 3 * 2)
    read, written = sig.io_bytes(lo, hi)
    # x rows 1..5 (3 + 2 halo), columns 1..4 (2 + 2 halo), all 3 input channels; w: 2 out channels whole.
    assert read[0] == 4 * (1 * 3 * 5 * 4) + 4 * (2 * 3 * 3 * 3)
    assert written[0] == 4 * 1 * 2 * 3 * 2
    edge = ZRange((0, 0, 0, 0), (1, 1, 2, 8))  # top rows: the halo above and at the sides is padding
    lo, hi = _arrays(edge)
    read, _ = sig.io_bytes(lo, hi)
    assert read[0] == 4 * (3 * 3 * 8) + 4 * (1 * 3 * 3 * 3)  # rows 0..2 (-1 clipped), all 8 columns


def test_conv2d_stride_input_box():
    sig = get_kernel("conv2d").signature({"x": TensorSpec((1, 1, 9, 9), "float32"),
                                          "w": TensorSpec((1, 1, 3, 3), "float32")}, {"stride": 2})
    assert sig.extents == (1, 1, 4, 4)
    assert sig.inputs["x"].apply(ZRange((0, 0, 1, 0), (1, 1, 3, 1))) == ZRange((0, 0, 2, 0), (1, 1, 7, 3))


def test_linear_and_fused_flops():
    specs_ = {"x": TensorSpec((5, 6), "float32"), "W": TensorSpec((6, 4), "float32"), "b": TensorSpec((4,), "float32")}
    lin = get_kernel("linear").signature(specs_, {})
    assert lin.flops_per_point == 2 * 6 + 1
    case = _fused_linear_relu()
    fused = get_kernel("fused").signature(specs(case), case.params)
    assert fused.flops_per_point == 2 * 6 + 1 + 1
    # The intermediate never leaves the kernel: bytes are the external inputs and the final output.
    lo, hi = _arrays(fused.index)
    read, written = fused.io_bytes(lo, hi)
    assert read[0] == 4 * (5 * 6 + 6 * 7 + 7) and written[0] == 4 * 5 * 7
    sm = _fused_softmax_mul_add()
    fsig = get_kernel("fused").signature(specs(sm), sm.params)
    assert fsig.dims == ("d0", "d1") and fsig.flops_per_point == 5 * 5 + 5 + 5


# -- dtype rules ---------------------------------------------------------------------------------


def test_mixed_dtypes_refused():
    with pytest.raises(SignatureError, match="one dtype"):
        get_kernel("add").signature({"a": TensorSpec((2, 3), "float32"), "b": TensorSpec((2, 3), "float16")}, {})
    with pytest.raises(SignatureError, match="one dtype"):
        get_kernel("linear").signature({"x": TensorSpec((2, 3), "bfloat16"), "W": TensorSpec((3, 4), "bfloat16"),
                                        "b": TensorSpec((4,), "float32")}, {})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_half_dtypes_accepted_and_kept(dtype):
    case = next(c for c in CASES if c.id == "linear")
    sig = get_kernel("linear").signature(specs(case, dtype), {})
    assert sig.out_spec.dtype == dtype
    sm = get_kernel("softmax").signature({"x": TensorSpec((2, 3), dtype)}, {})
    assert sm.out_spec.dtype == dtype


def test_index_ports_take_int32_only():
    table, ids = TensorSpec((5, 3), "float32"), TensorSpec((4,), "int32")
    assert get_kernel("embedding").signature({"table": table, "ids": ids}, {}).out_spec == TensorSpec((4, 3),
                                                                                                      "float32")
    with pytest.raises(SignatureError, match="input 'ids' has dtype 'float32'; allowed: \\['int32'\\]"):
        get_kernel("embedding").signature({"table": table, "ids": TensorSpec((4,), "float32")}, {})
    with pytest.raises(SignatureError, match="input 'table' has dtype 'int32'"):
        get_kernel("embedding").signature({"table": TensorSpec((5, 3), "int32"), "ids": ids}, {})


@pytest.mark.parametrize("dtype", ["float64", "int32", "int8"])
def test_unknown_dtypes_refused(dtype):
    with pytest.raises(SignatureError, match=f"dtype '{dtype}'"):
        get_kernel("relu").signature({"x": TensorSpec((2, 3), dtype)}, {})


# -- signature errors ----------------------------------------------------------------------------

T = TensorSpec
BAD = [
    ("matmul", {"a": T((2, 3, 4), "float32"), "b": T((4, 5), "float32")}, {}, "use bmm"),
    ("matmul", {"a": T((2, 3), "float32"), "b": T((4, 5), "float32")}, {}, "letter 'k' has extent 3 and 4"),
    ("matmul", {"a": T((2, 3), "float32")}, {}, "missing \\['b'\\]"),
    ("matmul", {"a": T((2, 3), "float32"), "b": T((3, 2), "float32"), "c": T((1,), "float32")}, {}, "unexpected"),
    ("matmul", {"a": T((2, 3), "float32"), "b": T((3, 2), "float32")}, {"beta": 1}, "no parameter 'beta'"),
    ("bmm", {"a": T((2, 3, 4), "float32"), "b": T((3, 4, 5), "float32")}, {}, "letter 'a' has extent 2 and 3"),
    ("bmm", {"a": T((3, 4), "float32"), "b": T((4, 5), "float32")}, {}, "rank >= 3"),
    ("linear", {"x": T((2, 3), "float32"), "W": T((4, 5), "float32"), "b": T((5,), "float32")}, {},
     "linear needs x\\[..., F\\]"),
    ("linear", {"x": T((2, 3), "float32"), "W": T((3, 5), "float32"), "b": T((4,), "float32")}, {},
     "b\\[4\\]"),
    ("einsum", {"a": T((2, 3), "float32"), "b": T((3, 2), "float32")}, {"equation": "ij->i"}, "two operands"),
    ("einsum", {"a": T((2, 3), "float32"), "b": T((3, 2), "float32")}, {"equation": "ii,ij->j"}, "repeats"),
    ("einsum", {"a": T((2, 3), "float32"), "b": T((3, 2), "float32")}, {"equation": "ij,jk->iz"},
     "appear in no input"),
    ("einsum", {"a": T((2, 3), "float32"), "b": T((3, 2), "float32")}, {"equation": "ijk,jk->i"}, "needs ranks"),
    ("add", {"a": T((2, 3), "float32"), "b": T((4,), "float32")}, {}, "do not broadcast"),
    ("conv2d", {"x": T((1, 3, 8, 8), "float32"), "w": T((4, 2, 3, 3), "float32")}, {}, "conv2d needs x"),
    ("conv2d_input_grad", {"dy": T((1, 4, 3, 3), "float32"), "w": T((4, 3, 3, 3), "float32")}, {"stride": 2},
     "needs size \\[H, W\\]"),
    ("conv2d_input_grad", {"dy": T((1, 4, 3, 3), "float32"), "w": T((4, 3, 3, 3), "float32")},
     {"stride": 2, "size": [9, 7]}, "is not the conv2d output of an input plane \\[9, 7\\]"),
    ("conv2d", {"x": T((1, 3, 8, 8), "float32"), "w": T((4, 3, 3, 3), "float32")}, {"padding": -1},
     "padding >= 0"),
    ("conv2d", {"x": T((1, 3, 2, 2), "float32"), "w": T((4, 3, 3, 3), "float32")}, {}, "output would be empty"),
    ("layernorm", {"x": T((2, 4), "float32"), "gamma": T((3,), "float32"), "beta": T((4,), "float32")}, {},
     "gamma must have shape \\(4,\\)"),
    ("reduce_sum", {"x": T((2, 4), "float32")}, {"dim": 2}, "out of range"),
    ("reduce_sum", {"x": T((4,), "float32")}, {}, "rank >= 2"),
    ("accumulate", {"p": T((2, 4), "float32")}, {"monoid": "min"}, "monoid 'min'"),
    ("permute", {"x": T((2, 3, 4), "float32")}, {"perm": [0, 0, 1]}, "not a permutation"),
    ("relu", {"x": T((), "float32")}, {}, "0-dimensional"),
    ("matmul", {"a": T((4, 6), "float32"), "b": T((6, 2), "float32")}, {"split": {"reduction": "z", "parts": 2}},
     "no splittable reduction 'z'"),
    ("matmul", {"a": T((4, 6), "float32"), "b": T((6, 2), "float32")}, {"split": {"reduction": "k", "parts": 4}},
     "cannot be split into 4"),
    ("relu", {"x": T((4, 6), "float32")}, {"split": {"reduction": "k", "parts": 2}}, "splittable: \\[\\]"),
    ("fused", {"0.x": T((2, 3), "float32")}, {"stages": []}, "at least two stages"),
    ("fused", {"0.x": T((2, 3), "float32")},
     {"stages": [{"op": "a", "kernel": "relu"}, {"op": "b", "kernel": "reduce_sum", "chain": "x"}]},
     "not elementwise"),
    ("fused", {"0.x": T((2, 3), "float32")},
     {"stages": [{"op": "a", "kernel": "relu"}, {"op": "b", "kernel": "add", "chain": "a"}]}, "lacks input '1.b'"),
    ("fused", {"0.x": T((2, 3), "float32"), "1.b": T((4, 2, 3), "float32")},
     {"stages": [{"op": "a", "kernel": "relu"}, {"op": "b", "kernel": "add", "chain": "a"}]}, "broadcasts"),
    ("fused", {"0.a": T((2, 4), "float32"), "0.b": T((4, 3), "float32")},
     {"stages": [{"op": "m", "kernel": "matmul", "params": {"split": {"reduction": "k", "parts": 2}}},
                 {"op": "r", "kernel": "relu", "chain": "x"}]}, "split reduction"),
]


@pytest.mark.parametrize("kernel,ins,params,message", BAD, ids=[f"{b[0]}-{b[3][:24]}" for b in BAD])
def test_signature_errors_say_why(kernel, ins, params, message):
    with pytest.raises(SignatureError, match=message):
        get_kernel(kernel).signature(ins, params)


def test_unknown_kernel():
    with pytest.raises(SignatureError, match="unknown kernel 'lienar'.*linear"):
        get_kernel("lienar")


def test_dim_index_by_name_and_position():
    sig = get_kernel("matmul").signature({"a": T((2, 3), "float32"), "b": T((3, 4), "float32")}, {})
    assert sig.dim_index("n") == sig.dim_index(1) == sig.dim_index(-1) == sig.dim_index("1") == 1
    with pytest.raises(SignatureError, match="no index dimension 'k'"):
        sig.dim_index("k")
    with pytest.raises(SignatureError, match="out of range"):
        sig.dim_index(2)
    assert math.isclose(sig.flops_per_point, 6.0)
