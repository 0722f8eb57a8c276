"""Run a graph shard by shard into whole logical tensors.

Each shard reads the projected boxes of its inputs (zero-padded where a box reaches past a
tensor's edge, as conv halos do), computes its output block, and writes it into the output
tensor's box. Ops run in dependency order.
"""

from __future__ import annotations

import zlib
from typing import Any, Mapping

import numpy as np

from executor.backend import exec_dtype, get_backend
from ir.graph import SOURCE_ROLES, Graph
from ir.kernels import INDEX_DTYPE, get_kernel
from ir.zspace import ZRange, project_boxes


def value_range(g: Graph, tensor: str) -> tuple[float, float] | None:
    """The narrowest value range any reader's kernel declares for ``tensor`` (None: any value)."""
    lo, hi = -np.inf, np.inf
    for op, port in g.consumers.get(tensor, []):
        o = g.ops[op]
        if o.kernel == "fused":
            continue
        ins = {p: g.tensors[t].spec for p, t in o.inputs}
        k = get_kernel(o.kernel)
        r = k.value_range(port, ins, k.check_params(o.params))
        if r is not None:
            lo, hi = max(lo, r[0]), min(hi, r[1])
    return None if np.isinf(lo) and np.isinf(hi) else (lo, hi)


def random_inputs(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs per tensor name: the same name gets the same values in any graph.

    Values respect the readers' declared ranges (``Kernel.value_range``): token ids and labels
    are valid indices, optimizer second moments are non-negative.
    """
    out = {}
    for name, t in g.tensors.items():
        if t.role not in SOURCE_ROLES:
            continue
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        rng_range = value_range(g, name)
        if t.dtype == INDEX_DTYPE:
            lo, hi = rng_range if rng_range is not None else (0, 2**31 - 1)
            out[name] = rng.integers(int(lo), int(hi), size=t.shape, dtype=np.int32)
            continue
        if rng_range is not None and np.isfinite(rng_range[0]) and np.isfinite(rng_range[1]):
            out[name] = rng.uniform(rng_range[0], rng_range[1], size=t.shape).astype(
                np.float32 if t.dtype == "bfloat16" else t.dtype)
            continue
        scale = 1.0 / np.sqrt(t.shape[0]) if t.role == "parameter" and len(t.shape) >= 2 else 0.5
        a = rng.standard_normal(t.shape) * scale
        if name.endswith("_g"):  # layernorm gains near one
            a = 1.0 + 0.1 * a
        out[name] = a.astype(np.float32 if t.dtype == "bfloat16" else t.dtype)
    return out


def read_box(xp: Any, arr: Any, lo: np.ndarray, hi: np.ndarray) -> Any:
    """``arr[lo:hi]`` with zeros where the box lies outside the array."""
    # The usual box lies inside: checked on Python ints, since NumPy's clip and compare on a few
    # elements cost ~20 us a box, host time every shard of a measured plan pays.
    lo_i, hi_i = lo.tolist(), hi.tolist()
    if all(0 <= a <= b <= n for a, b, n in zip(lo_i, hi_i, arr.shape)):
        return arr[tuple(slice(a, b) for a, b in zip(lo_i, hi_i))]
    shape = np.array(arr.shape)
    clo, chi = np.clip(lo, 0, shape), np.clip(hi, 0, shape)
    chi = np.maximum(chi, clo)
    if np.array_equal(clo, lo) and np.array_equal(chi, hi):
        return arr[tuple(slice(a, b) for a, b in zip(clo, chi))]
    if np.any(chi <= clo):  # the box misses the array entirely (e.g. padding wider than a 1x1 kernel)
        return xp.zeros(tuple(int(h - l) for l, h in zip(lo, hi)), dtype=arr.dtype)
    block = arr[tuple(slice(a, b) for a, b in zip(clo, chi))]
    pad = [(int(a - l), int(h - b)) for l, a, b, h in zip(lo, clo, chi, hi)]
    return xp.pad(block, pad)


def run_op(xp: Any, g: Graph, name: str, env: dict[str, Any], precision: str | None = None) -> None:
    """Execute every shard of op ``name``, reading and writing tensors in ``env``.

    ``precision`` (e.g. ``"float64"``) overrides the storage dtype of floating tensors: gradient
    checks against finite differences need more than float32."""
    o = g.ops[name]
    sig = g.signature(o)
    k = get_kernel(o.kernel)
    params = o.params if o.kernel == "fused" else k.check_params(o.params)
    out_t = g.tensors[o.output]
    dtype = precision if precision and out_t.dtype != INDEX_DTYPE else out_t.dtype
    out = xp.zeros(out_t.shape, dtype=exec_dtype(xp, dtype))
    sh = o.shards
    in_boxes = {port: project_boxes(sig.inputs[port], sh.lo, sh.hi) for port in sig.inputs}
    out_lo, out_hi = project_boxes(sig.output, sh.lo, sh.hi)
    ports = dict(o.inputs)
    for i in range(len(sh)):
        blocks = {port: read_box(xp, env[ports[port]], lo[i], hi[i]) for port, (lo, hi) in in_boxes.items()}
        y = k.run(xp, blocks, params, ZRange(sh.lo[i], sh.hi[i]), sig)
        want = tuple(int(b - a) for a, b in zip(out_lo[i], out_hi[i]))
        if tuple(y.shape) != want:  # never let assignment broadcast a wrong block into place
            raise ValueError(f"op {name} ({o.kernel}) shard {i}: the kernel returned a block of shape "
                             f"{tuple(y.shape)}, its output box has shape {want}")
        out[tuple(slice(a, b) for a, b in zip(out_lo[i], out_hi[i]))] = y
    env[o.output] = out


def execute(g: Graph, inputs: Mapping[str, Any] | None = None, backend: str = "numpy",
            seed: int = 0, precision: str | None = None) -> dict[str, Any]:
    """Run ``g`` and return every tensor (inputs included) as backend arrays (``precision``: see ``run_op``)."""
    xp = get_backend(backend)
    src = random_inputs(g, seed) if inputs is None else inputs
    env: dict[str, Any] = {n: xp.asarray(a) for n, a in src.items()}
    for name in g.topo_order:
        run_op(xp, g, name, env, precision)
    return env


def outputs(g: Graph) -> list[str]:
    return [n for n, t in g.tensors.items() if t.role == "output"]
